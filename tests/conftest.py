"""Every test sees 8 simulated CPU devices (set before JAX is imported anywhere)."""

import atexit
import os
import shutil
import tempfile
import time

# Compile at a low XLA optimization level: the tiny test models are compile-bound (8.6 s -> 3.5 s a run).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache for the whole session, shared with the subprocesses the tests start
# (they inherit the environment): the suite compiles the same tiny programs again and again, and a cache hit
# loads the executable XLA compiled earlier for the same HLO, options and flags (all part of the key), so what
# runs is unchanged. A fresh directory each session (removed at exit) unless JAX_COMPILATION_CACHE_DIR is set.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _XLA_CACHE = tempfile.mkdtemp(prefix="maxtrain-tests-xla-cache-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")  # JAX's default (1 s) misses most

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_YML = os.path.join(REPO, "configs", "base.yml")

# A model small enough that compiling and running a few steps takes seconds on 2 cores.
TINY = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "vocab_size=512", "max_target_length=32", "per_device_batch_size=1",
        "dtype=float32", "remat_policy=none", "enable_tensorboard=false", "max_new_tokens=0"]


@pytest.fixture
def tiny_args(tmp_path):
    """argv for maxtrain.train.main with the tiny model writing under tmp_path."""
    return [BASE_YML, *TINY, f"base_output_directory={tmp_path}", "run_name=test"]


@pytest.fixture
def without_compilation_cache():
    """For a test that counts XLA compilations: a hit in the session's persistent cache (above) loads an
    executable instead of compiling it, so the cache is off while the test runs and back on after."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


# The tests this run skipped, kept in pytest's cache (.pytest_cache/v/maxtrain/skipped) when the run ends: .ci/run
# runs the README's `pytest` in a bare virtualenv, then installs the optional extras and reruns only these.
# Module-level skips are kept as the module's path. (Under xdist the controller sees every worker's reports.)
_SKIPPED: list[str] = []


# Each test's time (setup + call + teardown, in seconds) and the session's wall time, kept beside the skipped ids
# (.pytest_cache/v/maxtrain/durations and .../session): tests/suite_budget.py reads them to hold the default run to
# its budget (README, "Testing").
_DURATIONS: dict[str, float] = {}
_STARTED = time.monotonic()


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_collectreport(report):
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session):
    cache = getattr(session.config, "cache", None)
    if cache is not None and not hasattr(session.config, "workerinput"):
        cache.set("maxtrain/skipped", sorted(set(_SKIPPED)))
        cache.set("maxtrain/durations", {k: round(v, 3) for k, v in sorted(_DURATIONS.items())})
        cache.set("maxtrain/session", {"wall_s": round(time.monotonic() - _STARTED, 1),
                                       "markexpr": session.config.getoption("markexpr", ""),
                                       "keyword": session.config.getoption("keyword", ""),
                                       "args": [str(a) for a in session.config.args],
                                       "workers": getattr(session.config.option, "numprocesses", None)})


def slow_params(cases, slow_ids, ids=None):
    """`@pytest.mark.parametrize(names, slow_params(cases, {...}))`: the cases as pytest.param, those whose id is in
    slow_ids marked `slow` (measured over the default run's budget: tests/suite_budget.py). `cases` are values (one
    name) or tuples (several names); ids default to the cases themselves (a dict's keys). A slow id that names no
    case is an error, so that a renamed case cannot leave the default run by accident."""
    cases = list(cases)
    ids = list(ids) if ids is not None else [str(c) for c in cases]
    unknown = set(slow_ids) - set(ids)
    if unknown:
        raise ValueError(f"slow_params: {sorted(unknown)} name no case (ids: {ids})")
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), id=i,
                         marks=[pytest.mark.slow] if i in slow_ids else [])
            for c, i in zip(cases, ids)]

# Tests of the default run measured at 7.5 s or more on CI's 2 cores (2026-11-30: 569 s of its 1,315 s of test time,
# the run at 681 s of its 600 s budget on that day's slower machine), marked slow here by their ids (pyproject.toml's
# marker: "over ~8 s"); CI's later stage runs them (-m slow). A test of this list that is renamed or removed fails
# the collection (a stale id would silently return it to the default run).
SLOW_IN_THE_DEFAULT_RUN = frozenset({
    "tests/checkpointing/test_checkpoint.py::test_checkpoint_holds_state_data_and_metadata",
    "tests/checkpointing/test_checkpoint_resume.py::test_resume_is_bitwise_identical",
    "tests/compile/test_context_costs.py::test_the_flash_ring_holds_no_block_scores",
    "tests/compile/test_context_costs.py::test_the_memory_script_prints_a_row_per_run_and_the_reason_a_run_does_not_compile",
    "tests/compile/test_memory_layout.py::test_compact_16_bit_scores_match_float32_attention[0.0]",
    "tests/compile/test_train_compile.py::test_saved_step_trains_bitwise_like_the_jit_path",
    "tests/data/test_data_resume.py::test_resumed_run_sees_the_same_batches_as_an_uninterrupted_run",
    "tests/kernels/test_flash_attention.py::test_positions_skip_the_tiles_they_hide_exactly[0]",
    "tests/models/test_attention_cpu.py::test_attention_on_cpu_uses_the_chunks_and_elsewhere_one_call",
    "tests/models/test_attention_cpu.py::test_causal_chunks_match_one_masked_call[100-7-4-2-0.0]",
    "tests/models/test_attention_cpu.py::test_causal_chunks_match_one_masked_call[13-0-2-2-3.0]",
    "tests/models/test_attention_cpu.py::test_heads_major_matches_the_reference[2-0.0-4-2]",
    "tests/models/test_attention_cpu.py::test_heads_major_matches_the_reference[2-0.0-6-1]",
    "tests/models/test_attention_cpu.py::test_heads_major_with_compact_16_bit_scores",
    "tests/models/test_deepseek.py::test_expert_parallelism_computes_the_deepseek_block_like_one_device[dropless]",
    "tests/models/test_deepseek.py::test_sparse_attention_decoding_from_the_cache_equals_the_full_forward[deepseek-v3.2]",
    "tests/models/test_deepseek_indexer.py::test_the_kl_trains_the_indexer_alone_and_the_lm_loss_never_reaches_it[sparse]",
    "tests/models/test_gated_delta.py::test_chunked_equals_the_recurrence_in_float64[8]",
    "tests/models/test_gated_delta.py::test_float32_against_float64",
    "tests/models/test_model.py::test_mixed_layer_stacks_scan_like_unrolled[gemma2-5]",
    "tests/models/test_moe.py::test_capacity_drops_the_overflow_and_reports_it",
    "tests/models/test_moe.py::test_dropless_and_capacity_agree_when_nothing_is_dropped[mixtral]",
    "tests/models/test_moe.py::test_flops_count_active_parameters_and_match_xla",
    "tests/models/test_moe.py::test_greedy_decoding_with_the_kv_cache_matches_the_full_forward",
    "tests/models/test_moe.py::test_moe_metrics_reach_the_console_the_metrics_file_and_tensorboard",
    "tests/models/test_moe.py::test_the_balance_loss_drives_a_skewed_router_toward_even_load",
    "tests/models/test_moe.py::test_the_hidden_axis_in_chunks_computes_the_same_block[dropless]",
    "tests/models/test_mtp.py::test_the_mtp_loss_on_a_mesh_equals_one_device",
    "tests/models/test_qwen3_next.py::test_decoding_from_the_cache_computes_the_full_forward",
    "tests/models/test_routing_replay.py::test_replay_keeps_the_samplers_log_probs_after_the_router_moved",
    "tests/observability/test_observability.py::test_tensorboard_files_hold_every_scalar_the_config_and_the_heatmap",
    "tests/observability/test_viz.py::test_training_writes_heatmaps_every_viz_period",
    "tests/parallel/test_context_all_gather_splash.py::test_all_gather_with_splash_equals_attention_over_the_unsplit_sequence[cp4_causal_sinks]",
    "tests/parallel/test_context_ring.py::test_tiny_llama_with_the_strategy_gives_the_loss_and_gradients_of_all_gather_and_one_device[ring-dual_chunk_swap]",
    "tests/parallel/test_context_ring_flash.py::test_ring_with_the_flash_kernel_equals_attention_over_the_unsplit_sequence[4-causal_softcap_sinks]",
    "tests/parallel/test_multiprocess.py::test_a_process_alone_fails_clearly_within_the_timeout",
    "tests/parallel/test_parallelism.py::test_summary_prints_the_pipeline_schedule",
    "tests/parallel/test_parallelism.py::test_training_steps_match_one_device[cp2xfsdp2xtp2]",
    "tests/parallel/test_sharding.py::test_parallelism_matches_single_device[fsdp8]",
    "tests/training/test_benchmark.py::test_compare_runs_one_step_of_each_in_turn_reversing_the_order",
    "tests/training/test_finetune.py::test_an_imported_model_fine_tunes_with_its_own_tokenizer_and_exports_with_it",
    "tests/training/test_grpo.py::test_sampled_log_probs_equal_the_training_forward_pass[0.5]",
    "tests/training/test_grpo_environments.py::test_a_real_models_episodes_mask_the_environment_and_keep_the_samplers_log_probs[3]",
    "tests/training/test_muon.py::test_checkpoint_round_trip",
    "tests/training/test_muon.py::test_fsdp_tensor_and_expert_parallel_update_like_one_device",
    "tests/training/test_precision.py::test_bfloat16_weights_keep_their_state_types_step_after_step",
    "tests/training/test_precision.py::test_low_precision_training_has_no_nan[bfloat16]",
    "tests/training/test_qk_clip.py::test_train_step_reports_and_clips_with_muon",
    "tests/training/test_train.py::test_trains_evaluates_checkpoints_and_resumes",
})


@pytest.hookimpl(tryfirst=True)  # before -m 'not slow' deselects by the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_IN_THE_DEFAULT_RUN:
            item.add_marker(pytest.mark.slow)
    for nodeid in SLOW_IN_THE_DEFAULT_RUN:
        path, name = nodeid.split("::")
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            if f"def {name.split('[')[0]}(" not in f.read():
                raise pytest.UsageError(f"tests/conftest.py's SLOW_IN_THE_DEFAULT_RUN names {nodeid}, which is not a test "
                                        "of that file: update the list")
