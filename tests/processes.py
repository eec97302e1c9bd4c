"""Starting JAX processes for the multi-process tests (tests/parallel/test_multiprocess.py,
tests/checkpointing/test_elastic_resume.py): a free port, the environment of a process with its CPU devices,
and waiting for them."""

from __future__ import annotations

import os
import socket
import subprocess
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
