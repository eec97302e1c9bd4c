"""A tiny OLMo 3 trains on the default corpus: its eval loss falls below a threshold.

    python end_to_end/cpu/olmo3.py                # 50 steps of 8 x 256 tokens

The default model's sizes (D 256, 4 layers, 4 heads of 64, V 4096, T 256) as an OLMo 3: post-norms only,
qk-norm over all heads' features, three 64-token sliding-window layers then one full layer, YaRN RoPE
(factor 4 over an original 64-token context) on the full layer and an unscaled RoPE at theta 10k on the
sliding ones; 10 warmup steps (warmup_steps_fraction=0.2). Checks that the eval loss falls at every evaluation
and ends below THRESHOLD.

Threshold = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the corpus)
+ a margin, as end_to_end/cpu/default_loss.py's:
    steps  measured  threshold
    50     6.0353    6.4
The eval loss at initialization is 8.82; measured curve, every 10 steps: 8.8169, 7.3653, 7.0428, 6.4792, 6.1210,
6.0353 (160 s on the 2-core CPU, shared). With the default 2.5 warmup steps to the peak learning rate 3e-3 the
post-normed layers bump once: 8.8169, 7.5186, 7.6196 (step 20), 6.4106, 6.1978, 6.1337.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

STEPS, THRESHOLD = 50, 6.4
OLMO3 = ["decoder_block=olmo3", "per_device_batch_size=8", "sliding_window_size=64", "rope_type=yarn", "rope_factor=4",
         "original_max_position_embeddings=64", "local_rope_max_timescale=10000.0",
         "normalization_layer_epsilon=1.0e-06", "warmup_steps_fraction=0.2"]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="olmo3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)
    return common.eval_loss_falls_below("olmo3", OLMO3, STEPS, THRESHOLD)


if __name__ == "__main__":
    common.main("olmo3", main)
