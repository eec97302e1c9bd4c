"""MaxText's published training rows (scripts/maxtext_rows.py compiles each with MaxText's own train_compile;
compile/maxtext_steps.py predicts their steps): each row's figure and source, the MaxText script or Trillium config
that produced it, and the flags and LIBTPU_INIT_ARGS read from it, less the run-only ones. The standard library
alone (no JAX): the script imports this in MaxText's virtualenv."""

from __future__ import annotations

import os
import re
import shlex

from maxtrain.errors import ToolError

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
