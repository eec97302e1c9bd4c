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
