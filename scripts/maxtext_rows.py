"""MaxText's published training rows, each compiled ahead of time by MaxText's own train_compile (its program).

Run with a Python 3.12 virtualenv holding MaxText 0.2.5 and its TPU compiler (not maxtrain's environment):

    python3.12 -m venv /work/venv-maxtext
    /work/venv-maxtext/bin/pip install 'maxtext[tpu]==0.2.5'          # jax 0.12.0.1, libtpu 0.0.52
    /work/venv-maxtext/bin/python scripts/maxtext_rows.py --out /tmp/maxtext-rows [--rows v5p-32b]

Each row of ROWS is one published figure (TFLOP/s per chip, from the README named in `source`) with the script that
produced it (`script`, in MaxText's configs/); a v6e row's figure is tokens/s per device and MFU (MaxText's
tiering.md) and its settings a Trillium benchmark config written out in TRILLIUM. Its flags and LIBTPU_INIT_ARGS
are read from that script, the run-only ones dropped (steps, output paths, metrics uploads, checkpointing), and the
row's target given as
compile_topology (and compile_topology_num_slices for a multi-slice row). Each row compiles in a process of its
own (libtpu reads LIBTPU_INIT_ARGS once; on v5p and v6e with V5P_LIBTPU_FIX) that calls MaxText's train_compile.main,
keeping the compiled step it builds.
GPU rows (MaxText's A3 rows: Llama 2 7B on 1-16 hosts of 8 H100s, configs/gpu/a3/llama_2_7b/) take the script's model
config and XLA_FLAGS (less --xla_dump_to) and need the CUDA plugin for MaxText's jax on PYTHONPATH (installed
with pip install --target DIR 'jax-cuda12-plugin[with-cuda]==0.12.0.1'; here DIR is /work/extra-maxtext-cuda):

    PYTHONPATH=/work/extra-maxtext-cuda /work/venv-maxtext/bin/python scripts/maxtext_rows.py \
        --out /tmp/maxtext-gpu-rows --rows h100-7b-1x

MaxText's GPU train_compile takes its devices from jax.devices() under mock_num_gpu_processes, which needs a CUDA
driver; the child gives it the H100 topology's devices instead (gpu_topology_mesh below). Its attention,
Transformer Engine's cudnn_flash_te, is replaced by JAX's cuDNN attention (GPU_DEVIATION): TE has no jax wheel.
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
import subprocess
import sys
import time

# maxtrain's error handling, compiler check and rows (the standard library alone, no JAX): this runs in MaxText's venv
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from maxtrain.errors import ToolError, run_cli  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.compile.targets import compiler_missing  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.compile.maxtext_rows import (  # noqa: E402  pylint: disable=wrong-import-position
    GPU_CHIPS, GPU_DEVIATION, ROWS, TRILLIUM, TRILLIUM_DROPPED, V5P_LIBTPU_FIX, row_settings)


# libtpu 0.0.52 refuses all-gather continuation fusion on v5p (V5P_LIBTPU_FIX); on v6e too ("enabled on platform
# ghostlite ... not supported/recommended on platforms other than TPU v5e"): the v6e configs ask for it
# (CF_FOR_ALL_GATHER), so their rows are compiled with it off, a deviation their row.json records.
LIBTPU_FIX_CHIPS = {"v5p", "v6e"}


def gpu_topology_mesh(original, chip: str, hosts: int):
    """MaxText's get_topology_mesh with the GPU devices taken from the chip's topology rather than jax.devices().

    MaxText's GPU train_compile sets mock_num_gpu_processes to the number of hosts and builds its mesh from
    jax.devices(), which needs a CUDA driver (cuInit fails without a GPU). This changes where the devices come
    from, not the program: jax.experimental.topologies gives the same 8-per-host H100 devices (one process per host,
    as the mock does) from the GPU description maxtrain compiles for (maxtrain/compile/gpu_targets/), and
    get_topology_mesh runs unchanged on them. On several hosts MaxText splits dcn_* axes over the hosts with
    create_hybrid_device_mesh, which groups devices by slice_index: XLA gives each real A3 host a slice_index of its
    own, but the topology's devices tell hosts apart by process_index alone (slice_index 0), so the hybrid mesh is
    told to group by process (process_is_granule), the same grouping."""
    import jax  # deferred: the child process's, after the parent set XLA_FLAGS
    from jax.experimental import mesh_utils, topologies

    from maxtrain.compile.targets import GPUS_PER_HOST, gpu_target_config  # deferred: jax is this process's

    devices = topologies.get_topology_desc(platform="cuda", topology_name=chip, target_config=gpu_target_config(chip),
                                           topology=f"1x{hosts}x{GPUS_PER_HOST}").devices

    def topology_mesh(config):
        real, hybrid = jax.devices, mesh_utils.create_hybrid_device_mesh
        jax.devices = lambda *a, **k: list(devices)
        mesh_utils.create_hybrid_device_mesh = lambda *a, **k: hybrid(*a, **{**k, "process_is_granule": True})
        try:
            return original(config)
        finally:
            jax.devices, mesh_utils.create_hybrid_device_mesh = real, hybrid
    return topology_mesh


def compile_one(row: tuple, out: str) -> None:
    """In this process: MaxText's train_compile.main for the row, keeping the compiled step and its mesh."""
    import jax  # deferred: this process's libtpu reads the row's LIBTPU_INIT_ARGS (set by the parent)
    import maxtext
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils

    name, chip, script, topology, slices, published, source = row
    maxtext_dir = os.path.dirname(maxtext.__file__)
    flags, _, config_file = row_settings(maxtext_dir, script)
    deviation = {}
    if chip in GPU_CHIPS:
        train_compile.get_topology_mesh = gpu_topology_mesh(train_compile.get_topology_mesh, chip, slices)
        with open(os.path.join(maxtext_dir, "configs", config_file)) as f:
            measured = dict(re.findall(r'^(\w+):\s*"?([^"\n#]*)"?', f.read(), re.M))
        measured.update(f.split("=", 1) for f in flags)
        deviation = {k: f"compiled with {k}={v}; the measured run used {k}={measured.get(k, '?')}"
                     for k, v in GPU_DEVIATION.items()}
        flags = [f for f in flags if f.split("=", 1)[0] not in GPU_DEVIATION]
        flags += [f"{k}={v}" for k, v in GPU_DEVIATION.items()]
    if script.startswith("trillium:") and TRILLIUM_DROPPED in TRILLIUM[script.split(":", 1)[1]][1]:
        deviation["libtpu_init_args"] = (f"compiled without {TRILLIUM_DROPPED}, which the measured run had (libtpu "
                                         "0.0.52 does not know it)")
    if script.startswith("trillium:") and "fuse_all_gather=true" in TRILLIUM[script.split(":", 1)[1]][1]:
        deviation["all_gather_fusion"] = (f"compiled with {V5P_LIBTPU_FIX} appended (libtpu 0.0.52 refuses all-gather "
                                          "continuation fusion on v6e); the measured run asked for it")
    kept = {}
    original = train_compile.jit_and_compile

    def keep(func, args, kwargs, mesh, *rest):
        t = time.time()
        compiled = original(func, args, kwargs, mesh, *rest)
        kept.update(compiled=compiled, mesh=mesh, config=rest[-2], seconds=time.time() - t)
        return compiled

    train_compile.jit_and_compile = keep
    argv = ["train_compile", os.path.join(maxtext_dir, "configs", config_file), *flags,
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
    trillium = TRILLIUM[script.split(":", 1)[1]] if script.startswith("trillium:") else None
    record = {
        "row": name, "chip": chip, "script": script, "compile_topology": topology, "slices": slices,
        "flags": flags, "config_file": config_file, "deviation": deviation,
        **({"xla_flags": os.environ.get("XLA_FLAGS", "")} if chip in GPU_CHIPS else
           {"libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "")}),
        **({"published_tflops_per_chip": None, "published_tokens_per_s_per_device": published,
            "published_mfu": trillium[2], "config_source": trillium[3]}
           if trillium else {"published_tflops_per_chip": published}),
        "published_source": source,
        "maxtext_tflops_per_device": total, "maxtext_tflops_weights": weights,
        "maxtext_tflops_attention": attention,
        "tokens_per_step": int(config.global_batch_size_to_train_on * config.max_target_length),
        "num_chips": len(devices), "mesh_axes": list(mesh.axis_names),
        "mesh_shape": [int(n) for n in mesh.devices.shape],
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
    if any(by_name[n][1] in GPU_CHIPS for n in names) and compiler_missing("gpu"):
        raise ToolError("the GPU rows need JAX's CUDA 12 plugin for MaxText's jax: pip install --target DIR "
                        "'jax-cuda12-plugin[with-cuda]==0.12.0.1' and put DIR on PYTHONPATH (the module docstring)")
    for name in names:
        if os.path.exists(os.path.join(args.out, name, "row.json")):
            print(f"maxtext_rows: {name}: already in {args.out}", flush=True)
            continue
        _, settings, _ = row_settings(maxtext_dir, by_name[name][2])
        if by_name[name][1] in GPU_CHIPS:  # the script's XLA_FLAGS, read by the child's XLA
            env = {**os.environ, "XLA_FLAGS": settings, "JAX_PLATFORMS": "cpu"}
        else:
            if by_name[name][1] in LIBTPU_FIX_CHIPS and not settings.rstrip().endswith(V5P_LIBTPU_FIX):
                settings = f"{settings} {V5P_LIBTPU_FIX}"
            # another compile may hold libtpu (no chips are touched): allow a second process to load it
            env = {**os.environ, "LIBTPU_INIT_ARGS": settings, "JAX_PLATFORMS": "cpu",
                   "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        t = time.time()
        result = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name], env=env, check=False)
        print(f"maxtext_rows: {name}: exit {result.returncode} after {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    run_cli("maxtext_rows", main)
