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
import shlex
import subprocess
import sys
import time

# maxtrain's error handling and compiler check (the standard library alone, no JAX): this runs in MaxText's venv
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from maxtrain.errors import ToolError, run_cli  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.compile.targets import compiler_missing  # noqa: E402  pylint: disable=wrong-import-position

# (row, chip, MaxText script, compile_topology, slices, published TFLOP/s/chip, source of the figure)
V5P, V5E = "configs/tpu/v5p/README.md", "configs/tpu/v5e/README.md"
A3 = "configs/gpu/a3/llama_2_7b/README.md"
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
    # MaxText's A3 rows (2026-11-28): compile_topology a3 with one slice per host, as MaxText's GPU train_compile
    # counts hosts (mock_num_gpu_processes); held out from the GPU calibration, which maxtrain's own steps fixed.
    ("h100-7b-1x", "h100", "configs/gpu/a3/llama_2_7b/1vm.sh", "a3", 1, 492, A3),
    ("h100-7b-2x", "h100", "configs/gpu/a3/llama_2_7b/2vm.sh", "a3", 2, 422, A3),
    ("h100-7b-4x", "h100", "configs/gpu/a3/llama_2_7b/4vm.sh", "a3", 4, 407, A3),
    ("h100-7b-8x", "h100", "configs/gpu/a3/llama_2_7b/8vm.sh", "a3", 8, 409, A3),
    ("h100-7b-16x", "h100", "configs/gpu/a3/llama_2_7b/16vm.sh", "a3", 16, 375, A3),
]
# MaxText's v6e (Trillium) rows (2026-11-28): the Gold rows of MaxText's docs/reference/models/tiering.md, which
# publishes MFU and approximate tokens/s per device (not TFLOP/s per chip), each with a recipe naming a config of
# MaxText's benchmarks/maxtext_trillium_model_configs.py. The config (its tuning_params and its xla_flags, the
# xla_flags_library pieces expanded) is written out below as it stands at the commit the recipe pins; "script" names
# it. Held out: TPU_CALIBRATION was fitted on v5p and v5e rows before these were compiled.
TIERING = "docs/reference/models/tiering.md (Trillium, Gold)"
ROWS += [
    ("v6e-llama2-70b", "v6e", "trillium:llama2_70b_4096_sc", "v6e-256", 1, 900, TIERING),
    ("v6e-llama3.1-8b", "v6e", "trillium:llama3_1_8b_8192", "v6e-256", 1, 7207, TIERING),
    ("v6e-llama3.1-70b", "v6e", "trillium:llama3_1_70b_8192", "v6e-256", 1, 960, TIERING),
]
_VMEM = "--xla_tpu_scoped_vmem_limit_kib=98304"  # xla_flags_library.DENSE_VMEM_LIMIT_FLAG
_CF_AG = ("--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
          "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
          "--xla_enable_async_all_gather=true")  # CF_FOR_ALL_GATHER
_SC_AR = ("--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
          "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
          "--xla_tpu_enable_all_reduce_offload_tracing=true "
          "--xla_tpu_use_tc_device_shape_on_sc=true --xla_sc_enable_instruction_fusion=false "
          "--xla_sc_disjoint_spmem=false --xla_sc_disable_megacore_partitioning=true "
          "--2a886c8_chip_config_name=megachip_tccontrol")  # ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE
_LAYOUT = ("--xla_tpu_use_minor_sharding_for_major_trivial_input=true "
           "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
           "--xla_tpu_assign_all_reduce_scatter_layout=true")  # LAYOUT_FOR_ALL_REDUCE_SCATTER
_DP = ("--xla_tpu_enable_data_parallel_all_reduce_opt=true "
       "--xla_tpu_data_parallel_opt_different_sized_ops=true")  # DATA_PARALLEL_OVERLAP
_HOST = ("--xla_tpu_enable_all_experimental_scheduler_features=true "
         "--xla_tpu_enable_scheduler_memory_pressure_tracking=true --xla_tpu_host_transfer_overlap_limit=24 "
         "--xla_tpu_aggressive_opt_barrier_removal=ENABLED --xla_lhs_prioritize_async_depth_over_stall=ENABLED "
         "--xla_tpu_enable_ag_backward_pipelining=true --xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
         "--xla_should_add_loop_invariant_op_in_chain=ENABLED --xla_max_concurrent_host_send_recv=100 "
         "--xla_tpu_scheduler_percent_shared_memory_limit=100 --xla_latency_hiding_scheduler_rerun=2")  # HOST_OFFLOAD
_SA_2048 = [f"sa_{k}=2048" for k in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                                     "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")]
_SA_2048.append("sa_use_fused_bwd_kernel=true")
_OFFLOAD = ["remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload", "key_proj=offload",
            "value_proj=offload"]
# name: (MaxText flags, LIBTPU_INIT_ARGS, published MFU, where the config is (commit, recipe)); the run-only
# tuning_params (dataset_path, enable_checkpointing, profiler*, gcs_metrics) are left out as RUN_ONLY leaves them.
TRILLIUM = {
    "llama2_70b_4096_sc": (
        ["model_name=llama2-70b", "per_device_batch_size=2", "ici_fsdp_parallelism=1",
         "ici_fsdp_transpose_parallelism=-1", "ici_tensor_parallelism=1", "remat_policy=qkv_proj_offloaded",
         "max_target_length=4096", "attention=flash", "use_iota_embed=true", "dataset_type=synthetic",
         "sa_block_q=1024", "sa_block_q_dkv=2048", "sa_block_q_dq=2048"],
        f"{_VMEM} {_CF_AG} {_SC_AR}", 0.438,
        "maxtext@140addcb benchmarks/maxtext_trillium_model_configs.py:414, the config of the run the recipe "
        "(tpu-recipes training/trillium/Llama2-70B-MaxText) logs: 905 tokens/s/device, 8,192 tokens a device, "
        "so per-device batch 2; its tag tpu-recipes-v0.1.2 has batch 3 (maxtext 93392c54, the same config else)"),
    "llama3_1_8b_8192": (
        ["model_name=llama3.1-8b", "per_device_batch_size=4", "ici_fsdp_parallelism=-1", *_OFFLOAD, "out_proj=offload",
         "max_target_length=8192", "attention=flash", "use_iota_embed=true", "dataset_type=synthetic", *_SA_2048],
        f"{_VMEM} {_LAYOUT} {_DP} {_CF_AG} {_SC_AR} {_HOST}", 0.4546,
        "maxtext@tpu-recipes-v0.1.4 (9f1820b4) benchmarks/maxtext_trillium_model_configs.py:812, recipe "
        "tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-256"),
    "llama3_1_70b_8192": (
        ["model_name=llama3.1-70b", "per_device_batch_size=5", "ici_fsdp_parallelism=-1", *_OFFLOAD,
         "max_target_length=8192", "attention=flash", "use_iota_embed=true", "dataset_type=synthetic", *_SA_2048],
        f"{_VMEM} {_LAYOUT} {_DP} {_CF_AG} {_HOST}", 0.5033,
        "maxtext@92e59fdf benchmarks/maxtext_trillium_model_configs.py:959 (tiering.md's link)"),
}
# libtpu 0.0.52 does not know this flag of the SparseCore all-reduce offload ("Unknown command line flag
# '2a886c8_chip_config_name'"), so it is dropped; MaxText's own configs drop it for Pathways runs too
# (pathways_xla_flag_options REMOVE). What it selected on the measured run's libtpu is not published: a deviation.
TRILLIUM_DROPPED = "--2a886c8_chip_config_name=megachip_tccontrol"
GPU_CHIPS = {"h100"}
# Transformer Engine (cudnn_flash_te, the scripts' attention) publishes no binary wheel for jax (its jax library is a
# source build against a CUDA toolkit), so the GPU rows compile with JAX's own cuDNN fused attention, the cuDNN
# flash kernels TE calls too: the one change made to their program (a GPU-less compile also skips autotuning, so
# cuBLAS and cuDNN may pick other algorithms than on the GPUs: docs/scale.md).
GPU_DEVIATION = {"attention": "cudnn_flash_jax"}
# libtpu 0.0.52 refuses all-gather continuation fusion on v5p ("not supported/recommended on platforms other than
# TPU v5e"): the v5p scripts other than 32b.sh (which already ends with it) get this appended, as 32b.sh does.
V5P_LIBTPU_FIX = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false"
# v6e too ("enabled on platform ghostlite ... not supported/recommended on platforms other than TPU v5e"): the v6e
# configs ask for it (CF_FOR_ALL_GATHER), so their rows are compiled with it off, a deviation their row.json records.
LIBTPU_FIX_CHIPS = {"v5p", "v6e"}
# Flags of the scripts that only matter to a run (or name its outputs), not to the compiled step.
RUN_ONLY = {"steps", "base_output_directory", "run_name", "gcs_metrics", "enable_checkpointing", "reuse_example_batch",
            "dataset_path", "metrics_file", "profiler", "upload_all_profiler_results", "skip_first_n_steps_for_profiler"}


def script_settings(maxtext_dir: str, script: str) -> tuple[list[str], str, str]:
    """The key=value flags of the script's train command, its LIBTPU_INIT_ARGS (TPU) or XLA_FLAGS (GPU, less the
    dump flag naming an output), and its config file (base.yml, or the GPU scripts' model config)."""
    with open(os.path.join(maxtext_dir, script)) as f:
        text = f.read()
    libtpu = re.search(r'export LIBTPU_INIT_ARGS="([^"]*)"', text)
    xla = re.search(r'export XLA_FLAGS="([^"]*)"', text)
    command = re.search(r'python3 -m maxtext\.trainers\.pre_train\.\S+\s+\S*configs\}"/+(\S+?\.yml)\\?\s*'
                        r'(.*?)(?:\n\s*\n|\Z)', text, re.S)
    if not command:
        raise ToolError(f"no train command found in {script}")
    # the GPU scripts name MaxText's repository layout (configs/models/gpu/X.yml); the wheel has configs/gpu/models
    config = command.group(1).replace("models/gpu/", "gpu/models/")
    env = libtpu.group(1) if libtpu else ""
    if xla:
        env = " ".join(f for f in xla.group(1).split() if not f.startswith("--xla_dump_to"))
    flags = []
    for token in shlex.split(command.group(2).replace("\\\n", " ")):
        key, _, value = token.partition("=")
        if key in RUN_ONLY or "$" in value or not _:
            continue
        flags.append(f"{key}={value}")
    return flags, env, config


def row_settings(maxtext_dir: str, script: str) -> tuple[list[str], str, str]:
    """script_settings for a script of MaxText's configs/, or a Trillium config of TRILLIUM ("trillium:NAME")."""
    if script.startswith("trillium:"):
        flags, libtpu, _, _ = TRILLIUM[script.split(":", 1)[1]]
        return list(flags), " ".join(f for f in libtpu.split() if f != TRILLIUM_DROPPED), "base.yml"
    return script_settings(maxtext_dir, script)


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
