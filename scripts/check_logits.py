"""Prove a conversion: maxtrain's logits for a checkpoint against golden logits (see maxtrain/check_logits.py).

    python scripts/check_logits.py CKPT --golden FILE.npz [--rtol 1e-5]
    python scripts/check_logits.py CKPT --hf HF_DIR [--golden FILE.npz]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtrain.check_logits import main  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.errors import run_cli  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
    sys.exit(run_cli("check_logits", main))
