"""MaxText's published training rows, each compiled ahead of time by MaxText's own train_compile (its program).

Run with a Python 3.12 virtualenv holding MaxText 0.2.5 and its TPU compiler (not maxtrain's environment):

    python3.12 -m venv /work/venv-maxtext
    /work/venv-maxtext/bin/pip install 'maxtext[tpu]==0.2.5'          # jax 0.12.0.1, libtpu 0.0.52
    /work/venv-maxtext/bin/python scripts/maxtext_rows.py --out /tmp/maxtext-rows [--rows v5p-32b]

Each row of ROWS is one published figure (TFLOP/s per chip, from the README named in `source`) with the script that
produced it (`script`, in MaxText's configs/). Its flags and LIBTPU_INIT_ARGS are read from that script, the
run-only ones dropped (steps, output paths, metrics uploads, checkpointing), and the row's target given as
compile_topology (and compile_topology_num_slices for a multi-slice row). Each row compiles in a process of its
own (libtpu reads LIBTPU_INIT_ARGS once; on v5p with V5P_LIBTPU_FIX) that calls MaxText's train_compile.main,
keeping the compiled step it builds (the published rows on H100s are not here: see docs/scale.md).
Written per row into OUT/ROW/: step.hlo (the optimized HLO, `compiled.as_text()`) and row.json: MaxText's TFLOPs per
device per step (calculate_tflops_training_per_device, what its train loop divides by the step time to report
TFLOP/s/chip), the global tokens per step, the chip kind, the number of chips, the mesh (axis names and sizes) with
each device's slice_index and process_index in mesh order (partition id i is the i-th), the compile seconds and
libtpu's cost analysis. scripts/predict_maxtext.py OUT predicts each row's step from these.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

# maxtrain's error handling only (maxtrain/errors.py needs the standard library alone): this runs in MaxText's venv
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from maxtrain.errors import ToolError, run_cli  # noqa: E402  pylint: disable=wrong-import-position

# (row, chip, MaxText script, compile_topology, slices, published TFLOP/s/chip, source of the figure)
V5P, V5E = "configs/tpu/v5p/README.md", "configs/tpu/v5e/README.md"
ROWS = [
    ("v5p-32b", "v5p", "configs/tpu/v5p/32b.sh", "v5p-128", 1, 328, V5P),
    ("v5p-64b", "v5p", "configs/tpu/v5p/64b.sh", "v5p-128", 1, 323, V5P),
    ("v5p-32b-2x", "v5p", "configs/tpu/v5p/32b.sh", "v5p-128", 2, 319, V5P),
    ("v5p-64b-2x", "v5p", "configs/tpu/v5p/64b.sh", "v5p-128", 2, 309, V5P),
    ("v5p-128b", "v5p", "configs/tpu/v5p/128b.sh", "v5p-256", 1, 315, V5P),
    ("v5p-128b-512", "v5p", "configs/tpu/v5p/128b.sh", "v5p-512", 1, 316, V5P),
    ("v5p-256b", "v5p", "configs/tpu/v5p/256b.sh", "v5p-1024", 1, 308, V5P),
    ("v5p-512b", "v5p", "configs/tpu/v5p/512b.sh", "v5p-1024", 1, 294, V5P),
    ("v5e-16b", "v5e", "configs/tpu/v5e/16b.sh", "v5e-256", 1, 120, V5E),
    ("v5e-32b", "v5e", "configs/tpu/v5e/32b.sh", "v5e-256", 1, 132, V5E),
    ("v5e-64b", "v5e", "configs/tpu/v5e/64b.sh", "v5e-256", 1, 118, V5E),
    ("v5e-128b", "v5e", "configs/tpu/v5e/128b.sh", "v5e-256", 1, 110, V5E),
    ("v5e-16b-2x", "v5e", "configs/tpu/v5e/16b.sh", "v5e-256", 2, 117, V5E),
    ("v5e-32b-2x", "v5e", "configs/tpu/v5e/32b.sh", "v5e-256", 2, 128, V5E),
    ("v5e-64b-2x", "v5e", "configs/tpu/v5e/64b.sh", "v5e-256", 2, 112, V5E),
    ("v5e-128b-2x", "v5e", "configs/tpu/v5e/128b.sh", "v5e-256", 2, 110, V5E),
    ("v5p-128b-2x", "v5p", "configs/tpu/v5p/128b.sh", "v5p-256", 2, 305, V5P),
    ("v5e-16b-4x", "v5e", "configs/tpu/v5e/16b.sh", "v5e-256", 4, 117, V5E),
    # Rows added on 2026-11-28 after TPU_CALIBRATION's memory and link were fixed (commit "predict: TPU memory and
    # link fixed"): compiled after that change, so they are the rows that change was never seen against.
    ("v5p-1024b", "v5p", "configs/tpu/v5p/1024b.sh", "v5p-2048", 1, 254, V5P),
    ("v5p-1024b-4096", "v5p", "configs/tpu/v5p/1024b.sh", "v5p-4096", 1, 297, V5P),
    ("v5p-128b-512-2x", "v5p", "configs/tpu/v5p/128b.sh", "v5p-512", 2, 274, V5P),
    ("v5p-256b-2x", "v5p", "configs/tpu/v5p/256b.sh", "v5p-1024", 2, 289, V5P),
    ("v5p-512b-2x", "v5p", "configs/tpu/v5p/512b.sh", "v5p-1024", 2, 282, V5P),
    ("v5e-32b-4x", "v5e", "configs/tpu/v5e/32b.sh", "v5e-256", 4, 126, V5E),
    ("v5e-64b-4x", "v5e", "configs/tpu/v5e/64b.sh", "v5e-256", 4, 110, V5E),
    ("v5e-128b-4x", "v5e", "configs/tpu/v5e/128b.sh", "v5e-256", 4, 108, V5E),
    ("v5e-16b-8x", "v5e", "configs/tpu/v5e/16b.sh", "v5e-256", 8, 115, V5E),
    ("v5e-32b-8x", "v5e", "configs/tpu/v5e/32b.sh", "v5e-256", 8, 125, V5E),
    ("v5e-64b-8x", "v5e", "configs/tpu/v5e/64b.sh", "v5e-256", 8, 108, V5E),
    ("v5e-128b-8x", "v5e", "configs/tpu/v5e/128b.sh", "v5e-256", 8, 104, V5E),
]
# libtpu 0.0.52 refuses all-gather continuation fusion on v5p ("not supported/recommended on platforms other than
# TPU v5e"): the v5p scripts other than 32b.sh (which already ends with it) get this appended, as 32b.sh does.
V5P_LIBTPU_FIX = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false"
# Flags of the scripts that only matter to a run (or name its outputs), not to the compiled step.
RUN_ONLY = {"steps", "base_output_directory", "run_name", "gcs_metrics", "enable_checkpointing", "reuse_example_batch",
            "dataset_path", "metrics_file", "profiler", "upload_all_profiler_results", "skip_first_n_steps_for_profiler"}


def script_settings(maxtext_dir: str, script: str) -> tuple[list[str], str]:
    """The key=value flags of the script's train command and its LIBTPU_INIT_ARGS."""
    with open(os.path.join(maxtext_dir, script)) as f:
        text = f.read()
    libtpu = re.search(r'export LIBTPU_INIT_ARGS="([^"]*)"', text)
    command = re.search(r"python3 -m maxtext\.trainers\.pre_train\.\S+\s+\S*base\.yml\s*\\?\n(.*?)(?:\n\s*\n|\Z)",
                        text, re.S)
    if not command:
        raise ToolError(f"no train command found in {script}")
    flags = []
    for token in shlex.split(command.group(1).replace("\\\n", " ")):
        key, _, value = token.partition("=")
        if key in RUN_ONLY or "$" in value or not _:
            continue
        flags.append(f"{key}={value}")
    return flags, libtpu.group(1) if libtpu else ""


def compile_one(row: tuple, out: str) -> None:
    """In this process: MaxText's train_compile.main for the row, keeping the compiled step and its mesh."""
    import jax  # deferred: this process's libtpu reads the row's LIBTPU_INIT_ARGS (set by the parent)
    import maxtext
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils

    name, chip, script, topology, slices, published, source = row
    maxtext_dir = os.path.dirname(maxtext.__file__)
    flags, _ = script_settings(maxtext_dir, script)
    kept = {}
    original = train_compile.jit_and_compile

    def keep(func, args, kwargs, mesh, *rest):
        t = time.time()
        compiled = original(func, args, kwargs, mesh, *rest)
        kept.update(compiled=compiled, mesh=mesh, config=rest[-2], seconds=time.time() - t)
        return compiled

    train_compile.jit_and_compile = keep
    argv = ["train_compile", os.path.join(maxtext_dir, "configs", "base.yml"), *flags,
            f"compile_topology={topology}", f"compile_topology_num_slices={slices}", "run_name=maxtext_rows"]
    train_compile.main(argv)
    compiled, mesh, config = kept["compiled"], kept["mesh"], kept["config"]
    total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        cost = {k: float(v) for k, v in (cost or {}).items()
                if k in ("flops", "bytes accessed", "transcendentals", "optimal_seconds")}
    except Exception:  # pylint: disable=broad-except  # a backend without one
        cost = None
    os.makedirs(os.path.join(out, name), exist_ok=True)
    with open(os.path.join(out, name, "step.hlo"), "w") as f:
        f.write(compiled.as_text())
    devices = list(mesh.devices.flat)
    record = {
        "row": name, "chip": chip, "script": script, "compile_topology": topology, "slices": slices,
        "flags": flags, "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""), "published_tflops_per_chip": published, "published_source": source,
        "maxtext_tflops_per_device": total, "maxtext_tflops_weights": weights,
        "maxtext_tflops_attention": attention,
        "tokens_per_step": int(config.global_batch_size_to_train_on * config.max_target_length),
        "num_chips": len(devices), "mesh_axes": list(mesh.axis_names), "mesh_shape": [int(n) for n in mesh.devices.shape],
        "devices": [{"slice_index": int(getattr(d, "slice_index", 0) or 0), "process_index": int(d.process_index),
                     "platform": d.platform} for d in devices],
        "device_kind": devices[0].device_kind, "compile_seconds": kept["seconds"], "libtpu_cost_analysis": cost,
        "jax": jax.__version__, "maxtext": maxtext.version.__version__ if hasattr(maxtext, "version") else "0.2.5",
    }
    with open(os.path.join(out, name, "row.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"maxtext_rows: {name}: compiled in {kept['seconds']:.0f} s, {total:.1f} TFLOPs per device per step",
          flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", required=True, help="a directory for each row's step.hlo and row.json")
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's row
    args = parser.parse_args(argv)
    by_name = {r[0]: r for r in ROWS}
    if args.one:
        compile_one(by_name[args.one], args.out)
        return
    names = [n for n in args.rows.split(",") if n] or list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ToolError(f"unknown rows {unknown}; choose from {', '.join(by_name)}")
    try:
        import maxtext  # deferred: the parent only needs MaxText's directory, to read the scripts
    except ImportError as e:
        raise ToolError("MaxText is not installed in this Python; run this script with a Python 3.12 virtualenv "
                        "holding it: pip install 'maxtext[tpu]==0.2.5' (the module docstring)") from e
    maxtext_dir = os.path.dirname(maxtext.__file__)
    for name in names:
        if os.path.exists(os.path.join(args.out, name, "row.json")):
            print(f"maxtext_rows: {name}: already in {args.out}", flush=True)
            continue
        _, libtpu = script_settings(maxtext_dir, by_name[name][2])
        if by_name[name][1] == "v5p" and not libtpu.rstrip().endswith(V5P_LIBTPU_FIX):
            libtpu = f"{libtpu} {V5P_LIBTPU_FIX}"
        # another compile may hold libtpu (no chips are touched): allow a second process to load it
        env = {**os.environ, "LIBTPU_INIT_ARGS": libtpu, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        t = time.time()
        result = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name], env=env, check=False)
        print(f"maxtext_rows: {name}: exit {result.returncode} after {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    run_cli("maxtext_rows", main)
