"""DeepSeek-V3.2's indexer trained as DeepSeek trained it, on a tiny model: the indexer's KL falls in the dense
warm-up, then the language-model loss falls under sparse attention.

    python end_to_end/cpu/deepseek_indexer.py        # three runs of the deepseek3.2-tiny preset, 8 x 256 tokens

1. pre-training: 40 steps at 64 tokens, where every query sees at most index_topk = 64 keys, so attention is
   dense and the indexer is skipped (the model DeepSeek started from was trained densely too);
2. dense warm-up (indexer_training=dense_warmup): 30 steps at 256 tokens from 1.'s weights, every weight but the
   indexer's frozen, the indexer trained towards the attention's head-averaged distribution by the KL loss;
3. sparse stage (indexer_training=sparse): 40 steps at 256 tokens from 2.'s weights, each query attending to the
   64 keys the indexer keeps; the model trained by the language-model loss, the indexer by the KL on the kept keys.

PASS when the warm-up's KL (metric indexer_kl) ends below 0.7 x where it started and the sparse stage's eval
loss falls at every evaluation (every 10 steps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

MODEL = ["model_name=deepseek3.2-tiny", "moe_dispatch=capacity", "per_device_batch_size=8"]
STAGES = (("pretrain", 40, ["max_target_length=64"]),
          ("dense_warmup", 30, ["max_target_length=256", "indexer_training=dense_warmup"]),
          ("sparse", 40, ["max_target_length=256", "indexer_training=sparse"]))


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="deepseek_indexer", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    out = common.out_dir("deepseek_indexer")
    previous = None
    for name, steps, overrides in STAGES:
        start = [f"load_parameters_path={out / previous}"] if previous else []
        log = common.run("maxtrain.train", [*MODEL, f"base_output_directory={out}", f"run_name={name}",
                                            f"steps={steps}", "eval_interval=10", f"metrics_file={out}/{name}.jsonl",
                                            *start, *overrides], out / f"{name}.log")
        print(f"{name}: " + log.splitlines()[-1], flush=True)
        previous = name
    kl = {s: m["learning/indexer_kl"] for s, m in common.train_losses(out / "dense_warmup.jsonl").items()}
    evals = common.eval_losses(out / "sparse.jsonl")
    curve = [evals[s] for s in sorted(evals)]
    sparse_kl = {s: m["learning/indexer_kl"] for s, m in common.train_losses(out / "sparse.jsonl").items()}
    first, last = kl[min(kl)], kl[max(kl)]
    print(f"dense warm-up indexer KL: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(kl.items()) if s % 5 == 0)}\n"
          f"sparse stage eval losses: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(evals.items()))}\n"
          f"sparse stage indexer KL: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(sparse_kl.items()) if s % 10 == 0)}",
          flush=True)
    falling = len(curve) >= 2 and all(b < a for a, b in zip(curve, curve[1:]))
    ok = last < 0.7 * first and falling
    return common.verdict("deepseek_indexer", ok, f"warm-up KL {first:.4f} -> {last:.4f}; sparse eval loss "
                          f"{curve[0]:.4f} -> {curve[-1]:.4f}, {'falling' if falling else 'not falling'} at every "
                          "evaluation" if curve else "no eval loss in the sparse stage")


if __name__ == "__main__":
    common.main("deepseek_indexer", main)
