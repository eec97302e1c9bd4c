"""A tiny Llama 4 (text) trains on the default corpus: its eval loss falls below a threshold.

    python end_to_end/cpu/llama4.py              # 50 steps of 8 x 256 tokens

The default model's sizes (D 256, 4 layers, 4 heads of 64, V 4096, T 256) as a llama4_text: RoPE layers 0
and 2 with L2 qk-norm attending in chunks of 64 positions, NoPE layers 1 and 3 with attention temperature
(floor scale 32, so that it changes within the sequence), a dense SwiGLU of width 1024 in layers 0 and 2,
and in layers 1 and 3 4 experts of width 384 (1 per token, its sigmoid router weight scaling its input)
beside one shared expert; capacity dispatch at factor 2 (on CPU dropless computes every expert; docs/moe.md). Checks
that the eval loss falls at every evaluation and ends below THRESHOLD.

Threshold = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the corpus)
+ a margin, as end_to_end/cpu/gpt_oss.py's:
    steps  measured  threshold
    50     5.8944    6.3
The eval loss at initialization is 8.83; measured curve, every 10 steps: 8.8316, 7.7944, 6.9597, 6.4544,
5.9938, 5.8944 (328 s on the 2-core CPU, shared).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

STEPS, THRESHOLD = 50, 6.3
LLAMA4 = ["decoder_block=llama4_text", "num_experts=4", "num_experts_per_tok=1", "base_moe_mlp_dim=384",
          "shared_experts=1", "decoder_sparse_step=2", "nope_layer_interval=2", "chunk_attn_window_size=64",
          "use_qk_norm=true", "temperature_tuning=true", "temperature_tuning_floor_scale=32",
          "moe_dispatch=capacity", "capacity_factor=2.0", "per_device_batch_size=8",
          "normalization_layer_epsilon=1.0e-05"]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="llama4", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)
    return common.eval_loss_falls_below("llama4", LLAMA4, STEPS, THRESHOLD)


if __name__ == "__main__":
    common.main("llama4", main)
