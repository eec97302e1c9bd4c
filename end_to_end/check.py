"""Checks on a run's metrics_file, for the end-to-end shell scripts; prints one PASS/FAIL line.

    python end_to_end/check.py eval-loss METRICS_FILE --below 3.0 [--name NAME]
    python end_to_end/check.py throughput METRICS_FILE [--skip 10]

eval-loss: the last eval loss in the file must be below the threshold (the figure: that loss).
throughput: prints the median tokens/s/device, TFLOP/s/device and MFU of the train steps after the
first --skip (compilation and warm-up); informational, it always passes when there are steps.
Exit status 0 on PASS, 1 on FAIL, 2 (one line `check: error: ...`) for a file that is not a metrics file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  pylint: disable=wrong-import-position


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["eval-loss", "throughput"])
    parser.add_argument("metrics_file", type=Path)
    parser.add_argument("--below", type=float, help="eval-loss: the threshold")
    parser.add_argument("--skip", type=int, default=10, help="throughput: leading steps to leave out")
    parser.add_argument("--name", help="the name printed in the verdict line")
    options = parser.parse_args(argv)
    name = options.name or options.check
    if not options.metrics_file.is_file():
        return common.verdict(name, False, f"no metrics file {options.metrics_file} (did the run fail?)")
    if options.check == "eval-loss":
        if options.below is None:
            parser.error("eval-loss needs --below THRESHOLD")
        evals = common.eval_losses(options.metrics_file)
        if not evals:
            return common.verdict(name, False, f"{options.metrics_file} has no eval loss (eval_interval=-1?)")
        step = max(evals)
        return common.verdict(name, evals[step] < options.below,
                              f"eval loss {evals[step]:.4f} at step {step} (threshold < {options.below})")
    steps = [m for s, m in sorted(common.train_losses(options.metrics_file).items()) if s > options.skip]
    if not steps:
        return common.verdict(name, False, f"no train steps after step {options.skip}")

    def median(key):
        values = [m[key] for m in steps if m.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    return common.verdict(name, True, f"median over {len(steps)} steps: {median('perf/per_device_tokens_per_sec'):,.0f} "
                                      f"tokens/s/device, {median('perf/per_device_tflops_per_sec'):.1f} TFLOP/s/device, "
                                      f"MFU {100 * median('perf/mfu'):.1f}%")


if __name__ == "__main__":
    common.main("check", main)
