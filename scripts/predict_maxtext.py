"""The step-time prediction (maxtrain/compile/predict.py) against MaxText's published step times (issue 48).

    /work/venv-maxtext/bin/python scripts/maxtext_rows.py --out /tmp/maxtext-rows    # MaxText's own compiles
    python scripts/predict_maxtext.py /tmp/maxtext-rows                              # the table for docs/scale.md
    python scripts/predict_maxtext.py /tmp/maxtext-rows --fit                        # refit on CALIBRATION_ROWS
    PYTHONPATH=/work/extra-maxtext-cuda /work/venv-maxtext/bin/python scripts/maxtext_rows.py \
        --out /tmp/maxtext-gpu-rows --rows h100-7b-1x,h100-7b-2x,h100-7b-4x,h100-7b-8x,h100-7b-16x
    python scripts/predict_maxtext.py /tmp/maxtext-gpu-rows --parts                  # H100 rows, with their parts
    /work/venv-maxtext/bin/python scripts/maxtext_rows.py --out /tmp/maxtext-v6e-rows \
        --rows v6e-llama3.1-8b,v6e-llama3.1-70b,v6e-llama2-70b                        # MaxText's v6e Gold rows
    python scripts/predict_maxtext.py /tmp/maxtext-v6e-rows --parts

Each row (its logic: maxtrain/compile/maxtext_steps.py) is one figure MaxText publishes for its performance configs (TFLOP/s per chip: its configs/tpu/*/README.md),
whose script scripts/maxtext_rows.py compiled ahead of time with MaxText 0.2.5's own train_compile for the
published target (the same program, the same compiler). The published figure is MaxText's own count of a step's
FLOPs per device (calculate_tflops_training_per_device) divided by the measured step time, so the measured step
time is that count over the figure: measured seconds = MaxText's TFLOPs per device per step / published TFLOP/s per
chip. The prediction reads the row's optimized HLO (its kernels, and its collectives with their replica groups
over the row's mesh and slices) against the chip's record (config/chips.py). Rows in CALIBRATION_ROWS are the ones
predict.TPU_CALIBRATION was fitted on; the others are held out. Of those, SEEN_ROWS were predicted, and their errors
read, before TPU_CALIBRATION's memory and link were fixed (2026-11-28); the rest were compiled after that change
and are the rows it was never seen against: the table's last lines summarize both. The GPU rows (MaxText's A3
Llama 2 7B, configs/gpu/a3/llama_2_7b/README.md) are predicted with the GPU calibration (fitted on maxtrain's own
H100 steps) against the a3 target's record (A3 High's network): held out, but seen (SEEN_ROWS), and summarized on a
line of their own. MaxText's v6e rows (its docs/reference/models/tiering.md) publish approximate tokens/s per device
and MFU instead: their measured step is the global tokens per step / (tokens/s per device x chips), and the step
the MFU reads from MaxText 0.2.5's FLOP count is printed beside it. The error is (predicted - measured) / measured.
Needs no compiler: the rows' HLO text is read as it is.
"""

from __future__ import annotations

import argparse

from maxtrain.compile.maxtext_steps import errors_of, fit, load_rows, parts_table, table
from maxtrain.errors import run_cli


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("directory", help="scripts/maxtext_rows.py's output directory")
    parser.add_argument("--fit", action="store_true", help="refit the TPU matmul efficiency on CALIBRATION_ROWS")
    parser.add_argument("--rows", default="", help="only rows whose name contains this text")
    parser.add_argument("--parts", action="store_true", help="also print each row's predicted parts")
    args = parser.parse_args(argv)
    rows = load_rows(args.directory, args.rows)
    cal = None
    if args.fit:
        cal = fit(rows)
        print(f"fitted: matmul {cal.matmul} (memory {cal.memory}, link {cal.link} fixed)")
    results = errors_of(rows, cal)
    print(table(results))
    if args.parts:
        print("\n" + parts_table(results))


if __name__ == "__main__":
    run_cli("predict_maxtext", main)
