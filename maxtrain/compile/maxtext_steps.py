"""MaxText's published step times against the step-time prediction (scripts/predict_maxtext.py is the command,
its docstring says how the rows are made and read): each row's measured step from its published figure, the
prediction of its compiled HLO, the fit of the TPU calibration on CALIBRATION_ROWS, and the tables for
docs/scale.md."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

from maxtrain.compile import predict, targets
from maxtrain.config import chips
from maxtrain.errors import ToolError

CALIBRATION_ROWS = {"v5p-32b", "v5e-16b"}
SEEN_ROWS = {"v5p-64b", "v5p-32b-2x", "v5p-64b-2x", "v5p-128b", "v5p-128b-512", "v5p-256b", "v5p-512b", "v5e-32b",
             "v5e-64b", "v5e-128b", "v5e-16b-2x", "v5e-32b-2x", "v5e-64b-2x", "v5e-128b-2x", "v5p-128b-2x",
             "v5e-16b-4x",
             # the A3 rows were predicted (-25% to -37%) before the GPU matmul efficiency became the measured GEMM
             # rate and the a3 target got A3 High's network (2026-11-28), so they are no blind check of either
             "h100-7b-1x", "h100-7b-2x", "h100-7b-4x", "h100-7b-8x", "h100-7b-16x"}


def load_rows(directory: str, only: str = "") -> list[tuple[dict, predict.ProgramCosts]]:
    """Each row's record (row.json) and its program's costs (step.hlo)."""
    if not os.path.isdir(directory):
        raise ToolError(f"no directory {directory}: write it with scripts/maxtext_rows.py --out {directory}")
    rows = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if only not in name or not os.path.exists(os.path.join(path, "row.json")):
            continue
        with open(os.path.join(path, "row.json")) as f:
            row = json.load(f)
        with open(os.path.join(path, "step.hlo")) as f:
            hlo = f.read()
        devices = [predict.DeviceRecord(**d) for d in row["devices"]]
        costs = predict.program_costs(hlo, devices, dict(zip(row["mesh_axes"], row["mesh_shape"])))
        rows.append((row, costs))
    if not rows:
        raise ToolError(f"{directory} holds no rows (row.json and step.hlo): run scripts/maxtext_rows.py --out "
                        f"{directory}")
    return rows


def measured_seconds(row: dict) -> float:
    """The measured step: MaxText's TFLOPs per device over the published TFLOP/s per chip, or (MaxText's v6e rows,
    which publish approximate tokens/s per device) the global tokens per step over tokens/s per device x chips."""
    if row.get("published_tokens_per_s_per_device"):
        return row["tokens_per_step"] / (row["published_tokens_per_s_per_device"] * row["num_chips"])
    return row["maxtext_tflops_per_device"] / row["published_tflops_per_chip"]


def mfu_step_disagreement(row: dict) -> float | None:
    """For a row publishing tokens/s and MFU: (MaxText 0.2.5's TFLOPs per device / (MFU x the chip's bf16 peak)) /
    the tokens/s step - 1, how far the two readings of the published row disagree (None for the other rows). MaxText
    changed its FLOP count (causal attention halved, its PR 1988), so an MFU published before that reads a
    different step from the count MaxText 0.2.5 computes."""
    if not row.get("published_mfu"):
        return None
    peak = chips.by_name(row["chip"]).bf16_flops
    return row["maxtext_tflops_per_device"] * 1e12 / (row["published_mfu"] * peak) / measured_seconds(row) - 1


def published(row: dict) -> str:
    """The published figure as the table prints it."""
    if row.get("published_tokens_per_s_per_device"):
        return f"{row['published_tokens_per_s_per_device']:,} tokens/s/chip, MFU {row['published_mfu']:.2%}"
    return str(row["published_tflops_per_chip"])


def errors_of(rows, cal: predict.Calibration | None = None) -> list[tuple[dict, float, float, float, dict]]:
    """(row, measured s, predicted s, error, the prediction) per row; `cal` (a TPU one) for the TPU rows, the GPU
    rows keep the GPU calibration."""
    out = []
    for row, costs in rows:
        measured = measured_seconds(row)
        chip = targets.chip_record(targets.parse(row["compile_topology"], row["slices"]))  # a3: A3 High's network
        p = predict.predict(costs, chip, tokens_per_step=row["tokens_per_step"],
                            model_flops_per_step=row["maxtext_tflops_per_device"] * 1e12, num_chips=row["num_chips"],
                            cal=cal if chip.kind == "tpu" else None)
        out.append((row, measured, p["step_seconds"], (p["step_seconds"] - measured) / measured, p))
    return out


def fit(rows) -> predict.Calibration:
    """The matmul efficiency that minimizes the worst error on the calibration rows (then the median), memory and
    link held at TPU_CALIBRATION's fixed values: two rows cannot pin three efficiencies, and memory-bound time and
    link time trade against each other on them (with all three free, memory 0.5 and link at the grid's top fit
    both rows as well as memory 1.0 and link 2.0), so only matmul is fitted."""
    calibration = [r for r in rows if r[0]["row"] in CALIBRATION_ROWS]
    best = None
    for matmul in [x / 100 for x in range(40, 101, 1)]:
        cal = dataclasses.replace(predict.TPU_CALIBRATION, matmul=matmul)
        errs = [abs(e[3]) for e in errors_of(calibration, cal)]
        key = (round(max(errs), 3), statistics.median(errs))
        if best is None or key < best[0]:
            best = (key, cal)
    return best[1]


def table(results) -> str:
    figure = ("published TFLOP/s/chip" if all(not r[0].get("published_tokens_per_s_per_device") for r in results)
              else "published")
    lines = [f"| row | chips | {figure} | measured s | predicted s | error | exposed collectives s "
             "| set | source |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row, measured, predicted, err, p in results:
        kind = ("calibration" if row["row"] in CALIBRATION_ROWS else "held out, seen" if row["row"] in SEEN_ROWS
                else "held out, new")
        chip = f"{row['slices']}x {row['compile_topology']}" if row["slices"] > 1 else row["compile_topology"]
        lines.append(f"| {row['row']} | {chip} ({row['num_chips']}) | {published(row)} "
                     f"| {measured:.3f} | {predicted:.3f} | {err:+.0%} | {p['parts']['collectives_exposed']:.3f} "
                     f"| {kind} | maxtext/{row['published_source']} |")
    tpu = [r for r in results if chips.by_name(r[0]["chip"]).kind == "tpu"]
    held = [r[3] for r in tpu if r[0]["row"] not in CALIBRATION_ROWS]
    new = [r[3] for r in tpu if r[0]["row"] not in CALIBRATION_ROWS | SEEN_ROWS]
    gpu = [r[3] for r in results if chips.by_name(r[0]["chip"]).kind == "gpu"]
    for row, measured, *_ in results:
        gap = mfu_step_disagreement(row)
        if gap is not None:
            far = "; more than 10%" if abs(gap) > 0.1 else ""
            lines.append(f"{row['row']}: the published MFU reads a {measured * (1 + gap):.3f} s step from MaxText "
                         f"0.2.5's FLOPs ({gap:+.0%} from the tokens/s step{far})")
    if held:
        lines.append("\n" + predict.held_out_summary(held))
    if new:
        lines.append("new (compiled after the calibration was fixed): " + predict.held_out_summary(new))
    if gpu:
        lines.append(("\n" if not held else "") + "GPU rows (the GPU calibration, fitted on maxtrain's steps; seen): "
                     + predict.held_out_summary(gpu))
    return "\n".join(lines)


def parts_table(results) -> str:
    """Each row's predicted parts in seconds: kernels by what bounds them, collectives by mesh axis, and of those
    how much the schedule hides."""
    lines = ["| row | matmul | attention | memory | collectives by axis | hidden | exposed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row, _, _, _, p in results:
        parts = p["parts"]
        axes = ", ".join(f"{axis} {seconds:.3f}" for axis, seconds in sorted(p["collectives_by_axis"].items())
                         if seconds >= 5e-4)
        lines.append(f"| {row['row']} | {parts['matmul']:.3f} | {parts['attention']:.3f} | {parts['memory']:.3f} "
                     f"| {axes} | {parts['collectives_hidden']:.3f} | {parts['collectives_exposed']:.3f} |")
    return "\n".join(lines)
