#!/usr/bin/env python3
"""Tokenize raw text into ArrayRecord shards for dataset_type=arrayrecord (see maxtrain/data/prepare.py).

    python scripts/prepare_data.py --input 'raw/*.jsonl.zst' --tokenizer tok.model --output-dir data/web \
        [--text-field text] [--eval-fraction 0.01] [--workers 8]
"""

from maxtrain import errors
from maxtrain.data import prepare


def main(argv: list[str]) -> dict:
    with errors.user_paths():  # an input that vanished, an output directory that fills its disk
        return prepare.main(argv)


if __name__ == "__main__":
    errors.run_cli("prepare_data", main)
