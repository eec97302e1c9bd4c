"""maxtrain/training/host_memory.py: the trainer re-executes itself with glibc's malloc madvising huge pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BASE_YML, REPO, TINY
from maxtrain.training import host_memory

CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "host_memory_child.py")
GLIBC = (2, 36)
SUPPORTED = (sys.platform == "linux" and (host_memory.glibc_version() or (0, 0)) >= (2, 35)
             and host_memory.thp_mode() == "madvise")
needs_madvise = pytest.mark.skipif(not SUPPORTED, reason="needs Linux, glibc >= 2.35 and transparent huge pages "
                                   f"in madvise mode (here: {host_memory.glibc_version()}, {host_memory.thp_mode()})")


def test_environment_adds_the_tunable_and_keeps_the_users():
    env = host_memory.hugepage_environment({"PATH": "/bin"}, "linux", GLIBC, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = host_memory.hugepage_environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1024"}, "linux", GLIBC,
                                           "madvise")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.trim_threshold=1024:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("environ, platform, glibc, thp", [
    ({"MAXTRAIN_HOST_HUGEPAGES": "0"}, "linux", GLIBC, "madvise"),  # turned off
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", GLIBC, "madvise"),  # the user's own setting wins
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "linux", GLIBC, "madvise"),  # already re-executed
    ({}, "linux", (2, 31), "madvise"),  # glibc without the tunable
    ({}, "linux", None, "madvise"),  # musl
    ({}, "darwin", None, None),
    ({}, "linux", GLIBC, "always"),  # the kernel gives every large mapping huge pages already
    ({}, "linux", GLIBC, "never"),
    ({}, "linux", GLIBC, None),  # no transparent huge pages in this kernel
])
def test_no_reexecution_where_it_would_change_nothing(environ, platform, glibc, thp):
    assert host_memory.hugepage_environment(environ, platform, glibc, thp) is None


@needs_madvise
def test_the_summary_line_says_why_without_huge_pages(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(host_memory.OPT_OUT, raising=False)
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 before Python starts" in host_memory.describe()  # this process
    monkeypatch.setenv(host_memory.OPT_OUT, "0")
    assert host_memory.describe().startswith("host memory: 4 KiB pages (MAXTRAIN_HOST_HUGEPAGES=0); ")


def environ_without_settings(**env) -> dict:
    """This process' environment without the settings under test (this suite's runner may have either), plus env."""
    unset = ("GLIBC_TUNABLES", host_memory.OPT_OUT, host_memory.REUSE_OPT_OUT, "JAX_PLATFORMS")
    return {**{k: v for k, v in os.environ.items() if k not in unset}, **env}


def run_child(*args, **env):
    process = subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, text=True,
                               env=environ_without_settings(**env))
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    (line,) = out.splitlines()
    return process.pid, json.loads(line)


@needs_madvise
def test_reexecutes_in_place_and_large_buffers_get_huge_pages():
    pid, child = run_child("a", "b c", "--flag=1")
    assert child["pid"] == pid  # the same process: launchers and schedulers that watch the pid see no change
    assert child["argv"] == ["a", "b c", "--flag=1"]
    assert child["tunables"] == "glibc.malloc.hugetlb=1"
    assert child["anon_huge_kib"] >= 32 * 1024, child  # most of the 64 MiB buffer is on 2 MiB pages
    assert "glibc.malloc.hugetlb=1" in child["describe"]


@needs_madvise
def test_turned_off_or_set_by_the_user():
    _, child = run_child(MAXTRAIN_HOST_HUGEPAGES="0")
    assert child["tunables"] is None
    assert child["anon_huge_kib"] < 32 * 1024, child
    assert child["describe"].startswith("host memory: 4 KiB pages (MAXTRAIN_HOST_HUGEPAGES=0); ")
    _, child = run_child(GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert child["tunables"] == "glibc.malloc.hugetlb=0"
    assert child["anon_huge_kib"] < 32 * 1024, child


@needs_madvise
def test_the_trainer_runs_with_huge_pages(tmp_path):
    result = subprocess.run([sys.executable, "-m", "maxtrain.train", BASE_YML, *TINY, "dataset_type=synthetic",
                             "steps=1", "enable_checkpointing=false", f"base_output_directory={tmp_path}"],
                            capture_output=True, text=True, cwd=REPO, timeout=300, env=environ_without_settings())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "host memory: glibc malloc with glibc.malloc.hugetlb=1" in result.stdout
    assert "step buffers kept between steps" in result.stdout  # a small CPU run: the default
    assert result.stdout.count("model: ") == 1


REUSE_CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "buffer_reuse_child.py")
SMALL = 2**20


@pytest.mark.parametrize("environ, platform, glibc, platforms, accelerator, step_bytes, entry, why", [
    ({}, "linux", GLIBC, "", False, SMALL, True, None),  # a CPU-only install, a small model
    ({}, "linux", GLIBC, "cpu", True, SMALL, True, None),  # accelerators installed, the CPU asked for
    ({"MAXTRAIN_HOST_BUFFER_REUSE": "0"}, "linux", GLIBC, "", False, SMALL, True, "MAXTRAIN_HOST_BUFFER_REUSE=0"),
    ({}, "linux", GLIBC, "", False, SMALL, False, "not started as python -m maxtrain.train"),
    ({}, "darwin", None, "", False, SMALL, True, "not glibc"),
    ({}, "linux", None, "", False, SMALL, True, "not glibc"),  # musl
    ({}, "linux", GLIBC, "", True, SMALL, True, "an accelerator may run the step"),
    ({}, "linux", GLIBC, "tpu", False, SMALL, True, "an accelerator may run the step"),
    ({}, "linux", GLIBC, "cuda,cpu", False, SMALL, True, "an accelerator may run the step"),
    ({}, "linux", GLIBC, "", False, 3 * 2**30, True, "a step of ~3.0 GiB of temporaries, over 1 GiB"),
])
def test_buffer_reuse_only_for_a_small_cpu_step(environ, platform, glibc, platforms, accelerator, step_bytes,
                                                entry, why):
    assert host_memory.reuse_refusal(environ, platform, glibc, platforms, accelerator, step_bytes, entry) == why


def test_step_buffer_estimate_counts_activations_and_logits():
    from maxtrain.config import load_config, with_overrides
    ref = load_config([BASE_YML, *with_overrides(
        TINY, "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=1024",
        "base_num_decoder_layers=4", "head_dim=64", "vocab_size=32000", "max_target_length=256",
        "per_device_batch_size=4")])
    assert 0.8 * 471e6 <= host_memory.step_buffer_bytes(ref) <= 1.2 * 471e6  # its compiled temporaries: 471 MB


def run_reuse_child(**env) -> dict:
    result = subprocess.run([sys.executable, REUSE_CHILD], capture_output=True, text=True, timeout=300,
                            env=environ_without_settings(JAX_PLATFORMS="cpu", **env))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or host_memory.glibc_version() is None, reason="needs glibc")
def test_a_threads_large_buffer_is_reused_not_mapped_afresh():
    """What XLA does each step, from a worker thread: malloc 256 MiB, touch it, free it, again. Kept, the
    second pass faults in no new pages; with the settings off, every page of it is faulted in again."""
    kept = run_reuse_child()
    assert kept["reuse"].endswith("step buffers kept between steps (MAXTRAIN_HOST_BUFFER_REUSE=0 turns it off)")
    assert kept["second_pass_faults"] < 16, kept
    fresh = run_reuse_child(MAXTRAIN_HOST_BUFFER_REUSE="0")
    assert fresh["reuse"].endswith("step buffers mapped afresh each step (MAXTRAIN_HOST_BUFFER_REUSE=0)")
    assert fresh["second_pass_faults"] >= 100, fresh  # 128 pages of 2 MiB, or 65,536 of 4 KiB
