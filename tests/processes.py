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


def _cpu_ticks(pid: int) -> int:
    """Process `pid`'s CPU time so far (user + system, in clock ticks), all its threads together."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime and stime: stat's fields 14 and 15


def _rollout_workers() -> dict[int, bytes]:
    """Our Ray rollout workers (pid -> the title Ray gave its process) once built (not in Worker.__init__)."""
    titles = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].strip()
            if (title == b"ray::Worker" or title.startswith(b"ray::Worker.")) and title != b"ray::Worker.__init__" \
                    and _descends_from_us(int(entry)):
                titles[int(entry)] = title
        except (OSError, ValueError):
            continue
    return titles


class _Generating:
    """Which rollout workers are in the middle of a batch. Ray titles a worker's process with the task it runs
    ("ray::Worker.generate"), but a worker runs `offer` in a second thread, and when that ends Ray sets the idle
    title ("ray::Worker") while generate goes on. So a worker also counts as generating when it kept over a quarter
    of a core busy (an idle actor uses next to none) through the last BUSY_POLLS polls."""

    BUSY_POLLS = 3

    def __init__(self, poll_seconds: float):
        self.poll_ticks = poll_seconds * os.sysconf("SC_CLK_TCK")
        self.ticks: dict[int, int] = {}   # pid -> its CPU ticks at the last poll
        self.busy: dict[int, int] = {}    # pid -> how many polls in a row it was busy

    def __call__(self) -> list[int]:
        pids = []
        for pid, title in _rollout_workers().items():
            try:
                ticks = _cpu_ticks(pid)
            except (OSError, ValueError):
                continue
            busy = pid in self.ticks and ticks - self.ticks[pid] >= 0.25 * self.poll_ticks
            self.ticks[pid], self.busy[pid] = ticks, self.busy.get(pid, 0) + 1 if busy else 0
            if title == b"ray::Worker.generate" or self.busy[pid] >= self.BUSY_POLLS:
                pids.append(pid)
        return pids


def kill_a_generating_worker(killed: list, seconds: float = 900) -> threading.Thread:
    """A thread that SIGKILLs the first rollout worker (GRPO's, under this process) seen generating, and appends its
    pid to `killed`."""
    def watch():
        deadline, generating = time.time() + seconds, _Generating(poll_seconds=0.1)
        while time.time() < deadline and not killed:
            time.sleep(0.1)
            for pid in generating()[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
