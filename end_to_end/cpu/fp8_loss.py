"""quantization=fp8 trains like bfloat16: the default model, dtype=bfloat16, with and without float8 matmuls.

    python end_to_end/cpu/fp8_loss.py              # 300 steps each, one run after the other (XLA:CPU emulates float8)
    python end_to_end/cpu/fp8_loss.py --steps 100  # shorter

Runs `python -m maxtrain.train configs/base.yml dtype=bfloat16 steps=N` twice, the second with
quantization=fp8 (e4m3 weights and activations, e5m2 gradients in the attention projections and the
MLP; models/fp8.py), and compares their eval losses at every evaluation (every 50 steps and the end).
PASS when each fp8 eval loss is within TOLERANCE (3%) of the bfloat16 one at the same step. The two
curves and the CPU time per step of each run are printed; docs/scale.md ("float8 matmuls") records them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

TOLERANCE = 0.03


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fp8_loss", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run")
    steps = parser.parse_args(argv).steps
    common.positive(parser, "--steps", steps)
    out = common.out_dir("fp8_loss")
    curves = {}
    for name, extra in (("bfloat16", []), ("fp8", ["quantization=fp8"])):
        common.run("maxtrain.train", ["dtype=bfloat16", *extra, f"base_output_directory={out}", f"run_name={name}",
                                      f"steps={steps}", "viz_period=-1", "max_new_tokens=0",
                                      f"metrics_file={out}/{name}.jsonl"], out / f"{name}.log")
        curves[name] = common.eval_losses(out / f"{name}.jsonl")
    print("step  bfloat16  fp8     fp8/bfloat16")
    worst = 0.0
    for step in sorted(curves["bfloat16"]):
        a, b = curves["bfloat16"][step], curves["fp8"].get(step)
        ratio = b / a if b is not None else float("inf")
        worst = max(worst, abs(ratio - 1))
        print(f"{step:4d}  {a:.4f}    {b if b is None else f'{b:.4f}'}  {ratio:.4f}")
    ok = bool(curves["bfloat16"]) and worst <= TOLERANCE
    return common.verdict("fp8_loss", ok, f"largest relative difference of the eval losses {worst:.2%} "
                                          f"(tolerance {TOLERANCE:.0%}) over {len(curves['bfloat16'])} evaluations")


if __name__ == "__main__":
    common.main("fp8_loss", main)
