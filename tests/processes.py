"""Starting JAX processes for the multi-process tests (tests/parallel/test_multiprocess.py,
tests/checkpointing/test_elastic_resume.py): a free port, the environment of a process with its CPU devices,
and waiting for them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with(devices: int, cache_dir: Path | None = None) -> dict:
    env = dict(os.environ)
    # Each process sees `devices` CPU devices; optimization level 0 makes XLA:CPU compile ~3x faster
    # (the same setting on both sides of every comparison).
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    return env


def finish(procs, timeout=240) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


def _descends_from_us(pid: int) -> bool:
    """Whether process `pid` runs under this one (a Ray this test started, not another run's)."""
    try:
        while pid > 1:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
            if pid == os.getpid():
                return True
    except (OSError, ValueError):
        pass
    return False


def _generating() -> list[int]:
    """Our Ray rollout workers in the middle of a batch: Ray titles a worker's process with the task it runs."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::Worker.generate") and _descends_from_us(int(entry)):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def kill_a_generating_worker(killed: list, seconds: float = 900) -> threading.Thread:
    """A thread that SIGKILLs the first rollout worker (GRPO's, under this process) seen generating, and appends its
    pid to `killed`."""
    def watch():
        deadline = time.time() + seconds
        while time.time() < deadline and not killed:
            time.sleep(0.05)
            for pid in _generating()[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
