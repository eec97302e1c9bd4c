"""The default config reaches an eval-loss threshold.

    python end_to_end/cpu/default_loss.py              # the default run: 300 steps (~6-8 min on 2 idle cores)
    python end_to_end/cpu/default_loss.py --steps 100  # shorter, with its own threshold (~2-3 min)

Runs `python -m maxtrain.train configs/base.yml` with nothing changed but the run's location (and
--steps), then checks the eval loss at the end against THRESHOLDS. With fewer steps the cosine
schedule is compressed to the shorter run, so each length has its own measured threshold.

Thresholds = the eval loss measured on CPU (jax 0.10.2, Python 3.11's standard library as the
corpus) + a margin for other CPUs, library versions and Python versions (whose standard library,
hence corpus, differs a little):
    steps  measured  threshold
    300    4.3611    4.6
    100    5.0415    5.3
The loss at initialization is ln(4096) = 8.3 (measured 8.86 with the initial logit scale).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

THRESHOLDS = {300: 4.6, 100: 5.3}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="default_loss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, choices=sorted(THRESHOLDS))
    steps = parser.parse_args(argv).steps
    out = common.out_dir("default_loss")
    log = common.run("maxtrain.train", [f"base_output_directory={out}", "run_name=default", f"steps={steps}",
                                        f"metrics_file={out}/metrics.jsonl"], out / "train.log")
    evals = common.eval_losses(out / "metrics.jsonl")
    heatmaps = sorted((out / "default" / "viz").glob("step_*.html"))
    print(f"eval losses: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(evals.items()))}; "
          f"token heatmaps: {[h.name for h in heatmaps]}; last lines:\n" + "\n".join(log.splitlines()[-4:]), flush=True)
    loss = evals.get(steps)
    ok = loss is not None and loss < THRESHOLDS[steps]
    return common.verdict("default_loss", ok, f"eval loss {loss:.4f} at step {steps} (threshold < {THRESHOLDS[steps]})"
                          if loss is not None else f"no eval loss at step {steps}")


if __name__ == "__main__":
    common.main("default_loss", main)
