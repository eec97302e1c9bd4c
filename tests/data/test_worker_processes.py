"""A trainer killed outright (kill -9, the out-of-memory killer) takes its worker processes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the children live
REPO = os.path.dirname(HERE)


def _spawned_children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that are multiprocessing spawn workers (not its resource tracker)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if ppid == pid and "spawn_main" in cmdline:
            children.append(int(entry))
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)")
def test_worker_processes_end_when_their_parent_is_killed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), REPO) if p)}
    process = subprocess.Popen([sys.executable, os.path.join(HERE, "worker_processes_child.py")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        line = process.stdout.readline()
        assert line.strip() == "ready", line + process.stdout.read()
        workers = _spawned_children(process.pid)
        assert len(workers) == 2, workers  # the dataset cache's tokenizing worker and the Grain worker
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(map(_alive, workers)):
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
        assert not left, f"worker processes {left} outlived their killed parent"
        # Nothing holds the parent's stdout open any more: reading it ends.
        process.stdout.read()
    finally:  # leave no process behind when the test fails
        for pid in [process.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
