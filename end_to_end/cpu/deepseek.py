"""A tiny DeepSeek-V3 trains on the default corpus: its eval loss falls below a threshold.

    python end_to_end/cpu/deepseek.py             # 50 steps of 8 x 256 tokens

The `deepseek3-tiny` preset (configs/models/deepseek3-tiny.yml: the default model's width, 4 layers with the
first dense, MLA, 16 routed experts of which 4 per token from 2 of 4 groups, 1 shared expert, the selection
bias updated outside the gradient) with capacity dispatch (on CPU dropless computes every expert;
docs/moe.md). Checks that the eval loss falls at every evaluation and ends below THRESHOLD.

Threshold = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the corpus)
+ a margin, as end_to_end/cpu/default_loss.py's:
    steps  measured  threshold
    50     5.8707    6.2
The eval loss at initialization is 8.88; measured curve, every 10 steps: 8.8813, 7.6072, 7.0604, 6.1692, 5.8996,
5.8707 (180 s on the 2-core CPU, shared).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

STEPS, THRESHOLD = 50, 6.2
DEEPSEEK = ["model_name=deepseek3-tiny", "moe_dispatch=capacity", "per_device_batch_size=8"]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="deepseek", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    return common.eval_loss_falls_below("deepseek", DEEPSEEK, STEPS, THRESHOLD)


if __name__ == "__main__":
    common.main("deepseek", main)
