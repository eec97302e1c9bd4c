"""A tiny GLM-4.5 trains on the default corpus: its eval loss falls below a threshold.

    python end_to_end/cpu/glm4_moe.py             # 50 steps of 8 x 256 tokens

GLM-4.5's architecture (decoder_block=glm4_moe) at the default model's sizes (D 256, 4 layers of 4 heads of 64):
RoPE on half of each head, qk-norm, q/k/v biases, the first layer dense, then 16 routed experts of width 128
(4 per token from 2 of 4 groups, sigmoid scores, the selection bias updated outside the gradient, weights x 2.5)
and 1 shared expert, and one next-token-prediction (MTP) module; capacity dispatch (on CPU dropless computes
every expert; docs/moe.md). Checks that the eval loss falls at every evaluation and ends below THRESHOLD.

Threshold = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the corpus)
+ a margin, as end_to_end/cpu/deepseek.py's:
    steps  measured  threshold
    50     5.8775    6.2
The eval loss at initialization is 8.76; measured curve, every 10 steps: 8.7641, 7.6947, 6.9870, 6.2982, 5.9471,
5.8775 (the MTP module's cross-entropy 6.13 at the end; 328 s on the 2-core CPU, shared, 2026-11-28).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

STEPS, THRESHOLD = 50, 6.2
GLM4_MOE = ["decoder_block=glm4_moe", "partial_rotary_factor=0.5", "use_qk_norm=true", "attention_bias=true",
            "first_num_dense_layers=1", "num_experts=16", "num_experts_per_tok=4", "base_moe_mlp_dim=128",
            "shared_experts=1", "n_routing_groups=4", "topk_routing_group=2", "routed_scaling_factor=2.5",
            "routed_bias=true", "routed_bias_update_rate=0.001", "load_balance_loss_weight=0.0",
            "seq_balance_loss_weight=0.0001", "mtp_num_layers=1", "moe_dispatch=capacity", "per_device_batch_size=8"]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="glm4_moe", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    return common.eval_loss_falls_below("glm4_moe", GLM4_MOE, STEPS, THRESHOLD)


if __name__ == "__main__":
    common.main("glm4_moe", main)
