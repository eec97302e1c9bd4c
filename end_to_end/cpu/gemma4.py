"""A tiny Gemma 4 (decoder_block gemma4_text) with every feature trains on the default corpus: its eval loss
falls at every evaluation and ends below a threshold.

    python end_to_end/cpu/gemma4.py             # 50 steps of 8 x 256 tokens

The default model's width with Gemma 4's layers: two 64-token sliding-window layers and two full-attention
ones of twice the head dim (128) with one kv head and keys as values, proportional RoPE (a quarter of each
global head, theta 1M; 10k on the sliding layers), per-layer input embeddings of 32 per layer, the last two
layers sharing the keys and values of the first two (double-wide MLPs), and 4 experts (2 per token, capacity
dispatch: on CPU dropless computes every expert; docs/moe.md) beside each dense MLP.

Threshold = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the corpus)
+ a margin, as end_to_end/cpu/default_loss.py's:
    steps  measured  threshold
    50     6.0797    6.4
The eval loss at initialization is 8.70; measured curve, every 10 steps: 8.6959, 8.0044, 7.3896, 6.5785, 6.1741,
6.0797 (183 s on the 2-core CPU, shared; 2026-11-28). The run ends with a greedy sample through the KV cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

STEPS, THRESHOLD = 50, 6.4
GEMMA4 = ["decoder_block=gemma4_text", "attention_layer_types=[sliding,full,sliding,full]", "sliding_window_size=64",
          "global_head_dim=128", "global_num_kv_heads=1", "attention_k_eq_v=true", "rope_type=proportional",
          "rope_proportion=0.25", "rope_max_timescale=1000000", "local_rope_max_timescale=10000",
          "per_layer_input_dim=32", "num_kv_shared_layers=2", "double_wide_mlp=true", "logits_via_embedding=true",
          "final_logits_soft_cap=30", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=256",
          "moe_dispatch=capacity", "per_device_batch_size=8"]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="gemma4", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    return common.eval_loss_falls_below("gemma4", GEMMA4, STEPS, THRESHOLD)


if __name__ == "__main__":
    common.main("gemma4", main)
