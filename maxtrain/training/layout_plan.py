"""scripts/plan.py's logic: the fastest layout for a target, from a small grid compiled ahead of time
(training/ahead_of_time.py) and sorted by the predicted tokens/s of the cells that fit (compile/predict.py); the
cache of compiled cells that a new prediction or calibration re-predicts without compiling. The script's
docstring says how to use it."""


from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import sys
import time

import jax

import maxtrain
from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.compile import libtpu, predict, report, targets
from maxtrain.errors import ConfigError, ToolError
from maxtrain.training import ahead_of_time, builder

GIB = 2**30
DESCRIPTION = 'The fastest layout for a target: compile a small grid ahead of time and sort what fits by predicted tokens/s.'


def ints(text: str, flag: str) -> list[int]:
    """The choices of a grid option: comma-separated whole numbers >= 1 (a split or a batch of 0 has no cell)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ToolError(f"{flag} {text!r} must be comma-separated whole numbers >= 1, e.g. {flag} 1,4")
    return values


def batches(text: str) -> list[int | float]:
    """--batch's choices: numbers > 0, a whole one as an int, a fraction (0.125: fewer sequences than devices) kept."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise ToolError(f"--batch {text!r} must be comma-separated numbers > 0, e.g. --batch 0.5,1,2")
    return [int(v) if v.is_integer() else v for v in values]


def grid(config, target: targets.Target, args) -> list[dict]:
    """The cells: {key: value} overrides, the splits only where they divide the devices and the model."""
    devices = target.num_devices // target.num_slices
    moe = config.num_experts > 1
    heads = math.gcd(config.base_num_query_heads, config.base_num_kv_heads or config.base_num_query_heads)
    cells = []
    for tensor, expert, batch, remat, attention in itertools.product(
            args.tensor, args.expert if moe else [1], args.batch, args.remat.split(","),
            args.attention.split(",")):
        if devices % (tensor * expert) or heads % tensor or (moe and config.num_experts % expert):
            continue
        cells.append({"ici_tensor_parallelism": tensor, "ici_expert_parallelism": expert,
                      "ici_fsdp_parallelism": devices // (tensor * expert), "per_device_batch_size": batch,
                      "remat_policy": remat, "attention": attention})
    return cells


def compile_cell(argv: list[str], cell: dict, target: targets.Target, cache: str | None = None) -> dict:
    """One train_compile of the config with the cell's settings: its report, or why it failed. With `cache`, a cell
    compiled before (same settings, target, jax and libtpu) is re-predicted from its kept HLO instead."""
    overrides = [f"{k}={v}" for k, v in cell.items()]
    row = {"cell": cell, "overrides": overrides}
    path = os.path.join(cache, cell_key(argv, overrides, target)) if cache else None
    if path and os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            kept = json.load(f)
        if "inputs" in kept:
            with open(path + ".hlo") as f:
                kept["prediction"] = predict.from_hlo(f.read(), kept.pop("inputs"))
        return {**kept, "cached": True}
    try:
        config = builder.load_config(config_lib.with_overrides(argv, *overrides), log=lambda *a: None)
        run, _, compiled, seconds = ahead_of_time.compile_for_target(config, target)
    except ConfigError as e:
        return {**row, "error": str(e).splitlines()[0]}
    except jax.errors.JaxRuntimeError as e:
        refused = libtpu.out_of_memory(e)
        if refused is None:
            return {**row, "error": str(e).splitlines()[0][:200]}
        return keep(path, {**row, "fits": False, "memory_gib": refused[0], "chip_gib": refused[1]})
    rep = report.report(run, compiled, target, seconds)
    inputs, hlo = predict.step_inputs(run, target), compiled.as_text()
    jax.clear_caches()
    return keep(path, {**row, "fits": report.fits(rep), "memory_gib": rep["memory"]["total"] / GIB,
                       "chip_gib": (rep["memory"]["chip"] or 0) / GIB, "prediction": rep["prediction"],
                       "compile_seconds": seconds}, inputs, hlo)


# The prediction's own code and figures: a change to them re-predicts a cached cell; any other change to maxtrain
# (the model, the step, the sharding) makes a new program, so the cell compiles again.
PREDICTION_FILES = ("compile/predict.py", "compile/hlo_kernels.py", "compile/hlo_stats.py", "config/chips.py")


def cell_key(argv: list[str], overrides: list[str], target: targets.Target) -> str:
    """The cache's name for a cell: its settings, the target, the compiler, and maxtrain's code but the prediction's."""
    root = os.path.dirname(os.path.abspath(maxtrain.__file__))
    code = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            if os.path.relpath(path, root) not in PREDICTION_FILES:
                with open(path, "rb") as f:
                    code.update(f.read())
    compiler = [jax.__version__, libtpu.version() if target.platform == "tpu" else None]
    key = [argv, overrides, target.describe(), compiler, code.hexdigest()]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]


def keep(path: str | None, row: dict, inputs: dict | None = None, hlo: str | None = None) -> dict:
    """Write a compiled cell to the cache (its figures; its HLO and the prediction's inputs when it has them)."""
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        kept = {k: v for k, v in row.items() if k != "prediction"}
        if inputs and hlo and row.get("prediction"):
            with open(path + ".hlo", "w") as f:
                f.write(hlo)
            kept["inputs"] = inputs
        else:
            kept["prediction"] = row.get("prediction")
        with open(path + ".json", "w") as f:
            json.dump(kept, f, default=str)
    return row


def format_rows(rows: list[dict]) -> list[str]:
    lines = ["| rank | tokens/s per chip | step ms | MFU | GiB per chip | settings |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i, row in enumerate(rows, 1):
        p = row["prediction"]
        lines.append(f"| {i} | {p['tokens_per_second_per_chip']:,.0f} | {p['step_seconds'] * 1e3:,.1f} | "
                     f"{p['mfu']:.1%} | {row['memory_gib']:.1f} | {' '.join(row['overrides'])} |")
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION, prog="plan.py", usage="%(prog)s CONFIG key=value ...")
    parser.add_argument("settings", nargs="+", help="a config file, then key=value overrides (compile_topology=...)")
    parser.add_argument("--tensor", default="1,4", help="ici_tensor_parallelism choices (default 1,4)")
    parser.add_argument("--expert", default="1,8", help="ici_expert_parallelism choices, MoE models (default 1,8)")
    parser.add_argument("--batch", default="1,2,4", help="per_device_batch_size choices (default 1,2,4)")
    parser.add_argument("--remat", default="full,minimal", help="remat_policy choices (default full,minimal)")
    parser.add_argument("--attention", default="autoselected", help="attention choices (default autoselected)")
    parser.add_argument("--json", help="also write every cell's figures here")
    parser.add_argument("--cache", help="a directory keeping each compiled cell, to re-predict without compiling")
    args = parser.parse_args(argv)
    args.tensor, args.expert, args.batch = (ints(args.tensor, "--tensor"), ints(args.expert, "--expert"),
                                            batches(args.batch))
    if args.json:
        storage.check_output(args.json, True, f"--json {args.json}")
    if args.cache:
        try:
            os.makedirs(args.cache, exist_ok=True)
        except OSError as e:
            raise ToolError(f"--cache {args.cache}: cannot make that directory ({e.strerror}); name a directory "
                            "this user can write") from e
    config = builder.load_config(args.settings, log=lambda *a: None)
    if not config.compile_topology:
        raise ToolError("plan.py needs a target: add compile_topology=v5p-128 (or h100-64, ...) to the settings")
    target = targets.parse(config.compile_topology, config.compile_topology_num_slices)
    jax.config.update("jax_platforms", "cpu")  # compiling for another target needs no accelerator here
    cells = grid(config, target, args)
    if not cells:
        raise ToolError(f"no cell of the grid divides {target.describe()} and the model's heads and experts: "
                        "choose --tensor and --expert values that do")
    print(f"planning {config.model_name} on {target.describe()}: {len(cells)} cells", flush=True)
    rows = []
    for cell in cells:
        t = time.time()
        row = compile_cell(args.settings, cell, target, args.cache)
        rows.append(row)
        verdict = row.get("error") or (
            f"{row['prediction']['tokens_per_second_per_chip']:,.0f} tokens/s per chip, {row['memory_gib']:.1f} GiB"
            if row.get("fits") else f"does not fit: {row['memory_gib']:.1f} GiB of {row['chip_gib']:.1f}")
        took = "from the cache" if row.get("cached") else f"{time.time() - t:.0f} s"
        print(f"  {' '.join(row['overrides'])}: {verdict} ({took})", flush=True)
    if args.json:
        storage.write_text(args.json, json.dumps(rows, indent=1, default=str))
    fitting = sorted((r for r in rows if r.get("fits") and r.get("prediction")),
                     key=lambda r: -r["prediction"]["tokens_per_second_per_chip"])
    if not fitting:
        sized = [r for r in rows if "memory_gib" in r]
        if not sized:
            raise ToolError(f"no cell of the grid compiled for {target.name}: {rows[0].get('error')}")
        least = min(sized, key=lambda r: r["memory_gib"])
        raise ToolError(f"no cell of the grid fits {target.name}: the smallest needs {least['memory_gib']:.1f} GiB per "
                        f"chip ({' '.join(least['overrides'])}), the chip has {least['chip_gib']:.1f}; try a smaller "
                        "--batch, --remat full, more chips (compile_topology) or a shorter max_target_length")
    print("\n".join(["", *format_rows(fitting), ""]))
    best = " ".join(fitting[0]["overrides"])
    settings = " ".join(a for a in args.settings if not a.startswith("compile_topology"))  # train.py's devices
    print(f"train the best, on {target.name}: python -m maxtrain.train {settings} {best}")
    sys.stdout.flush()
