#!/usr/bin/env python3
"""Tokenize raw text into ArrayRecord shards for dataset_type=arrayrecord (see maxtrain/data/prepare.py).

    python scripts/prepare_data.py --input 'raw/*.jsonl.zst' --tokenizer tok.model --output-dir data/web \
        [--text-field text] [--eval-fraction 0.01] [--workers 8]
"""

from maxtrain.data import prepare
from maxtrain.errors import run_cli

if __name__ == "__main__":
    run_cli("prepare_data", prepare.main)
