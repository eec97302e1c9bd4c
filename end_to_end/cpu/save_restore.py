"""Save -> restore gives the same next-step loss (bitwise), on the default model and corpus.

    python end_to_end/cpu/save_restore.py [--steps 20]

Three runs of the default model (a smaller batch, so it takes about a minute on 2 cores), all with
the learning-rate schedule of a 2N-step run (learning_rate_schedule_steps=2N):
    uninterrupted  N+1 steps, no checkpoints
    first half     N steps; saves a checkpoint at step N and exits
    resumed        the same command with steps=N+1: restores step N (params, optimizer state,
                   PRNG key, data iterator) and trains step N+1
PASS when step N+1's loss and gradient norm of the resumed run equal the uninterrupted run's
exactly (and steps 1..N of the first half equal the uninterrupted run's, too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

SMALL = ["per_device_batch_size=4", "max_target_length=128", "eval_interval=-1", "max_new_tokens=0",
         "viz_period=-1", "log_period=5", "async_checkpointing=false"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="save_restore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="N: the step the checkpoint is saved at")
    n = common.positive(parser, "--steps", parser.parse_args(argv).steps)
    out = common.out_dir("save_restore")
    args = [*SMALL, f"base_output_directory={out}", f"learning_rate_schedule_steps={2 * n}"]
    common.run("maxtrain.train", [*args, "run_name=uninterrupted", f"steps={n + 1}", "enable_checkpointing=false",
                                  f"metrics_file={out}/uninterrupted.jsonl"], out / "uninterrupted.log")
    common.run("maxtrain.train", [*args, "run_name=interrupted", f"steps={n}", f"checkpoint_period={n}",
                                  f"metrics_file={out}/interrupted.jsonl"], out / "first_half.log")
    resumed_log = common.run("maxtrain.train", [*args, "run_name=interrupted", f"steps={n + 1}",
                                                f"checkpoint_period={n}", f"metrics_file={out}/interrupted.jsonl"],
                             out / "resumed.log")
    a, b = common.train_losses(out / "uninterrupted.jsonl"), common.train_losses(out / "interrupted.jsonl")
    if f"Resuming from {out}/interrupted/checkpoints/{n}" not in resumed_log:
        return common.verdict("save_restore", False, f"the second run did not resume from step {n}; see {out}/resumed.log")
    same_before = all(a[s]["learning/loss"] == b[s]["learning/loss"] for s in range(1, n + 1))
    la, lb = a[n + 1]["learning/loss"], b[n + 1]["learning/loss"]
    ga, gb = a[n + 1]["learning/grad_norm"], b[n + 1]["learning/grad_norm"]
    ok = same_before and la == lb and ga == gb
    return common.verdict("save_restore", ok,
                          f"step {n + 1} loss uninterrupted {la!r} vs restored {lb!r} (difference {abs(la - lb):.3g}), "
                          f"grad norm {ga!r} vs {gb!r}; steps 1-{n} {'equal' if same_before else 'DIFFER'}")


if __name__ == "__main__":
    common.main("save_restore", main)
