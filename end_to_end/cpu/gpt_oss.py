"""A tiny gpt-oss trains on the default corpus: its eval loss falls below a threshold.

    python end_to_end/cpu/gpt_oss.py              # 50 steps of 8 x 256 tokens

The default model's sizes (D 256, 4 layers, 4 heads of 64, V 4096, T 256) as a gpt-oss: attention sinks,
q/k/v/o biases, layers alternating a 64-token sliding window and full attention, YaRN RoPE (factor 4 over an
original 64-token context), 4 clamped-SwiGLU experts of width 384 with biases, 2 per token, capacity
dispatch (on CPU dropless computes every expert; docs/moe.md). Checks that the eval loss falls at every
evaluation and ends below THRESHOLD.

Threshold = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the corpus)
+ a margin, as end_to_end/cpu/default_loss.py's:
    steps  measured  threshold
    50     6.0722    6.4
The eval loss at initialization is 8.94 (ln(4096) = 8.3 and the initial logit scale); measured curve, every
10 steps: 8.9403, 7.7170, 7.3317, 6.4416, 6.1660, 6.0722 (880 s on the 2-core CPU, shared).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

STEPS, THRESHOLD = 50, 6.4
GPT_OSS = ["decoder_block=gpt_oss", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=384",
           "moe_dispatch=capacity", "per_device_batch_size=8",
           "sliding_window_size=64", "rope_type=yarn", "rope_factor=4", "original_max_position_embeddings=64",
           "rope_truncate=false", "normalization_layer_epsilon=1.0e-05"]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="gpt_oss", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)
    out = common.out_dir("gpt_oss")
    log = common.run("maxtrain.train", [f"base_output_directory={out}", "run_name=gpt_oss", f"steps={STEPS}",
                                        "eval_interval=10", f"metrics_file={out}/metrics.jsonl", *GPT_OSS],
                     out / "train.log")
    evals = common.eval_losses(out / "metrics.jsonl")
    curve = [evals[s] for s in sorted(evals)]
    print(f"eval losses: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(evals.items()))}; last lines:\n"
          + "\n".join(log.splitlines()[-4:]), flush=True)
    loss = evals.get(STEPS)
    falling = len(curve) >= 2 and all(b < a for a, b in zip(curve, curve[1:]))
    ok = loss is not None and loss < THRESHOLD and falling
    return common.verdict("gpt_oss", ok, f"eval loss {loss:.4f} at step {STEPS} (threshold < {THRESHOLD}), "
                          f"{'falling' if falling else 'not falling'} at every evaluation"
                          if loss is not None else f"no eval loss at step {STEPS}")


if __name__ == "__main__":
    common.main("gpt_oss", main)
