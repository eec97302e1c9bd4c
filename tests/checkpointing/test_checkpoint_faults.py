"""Faults, with real training processes: SIGTERM (preemption) saves and exits; a save that fails
mid-run (the file-size limit of the process, set from outside with prlimit: writes fail with
EFBIG as they would with ENOSPC on a full disk) stops the run with a clear error, and the earlier
checkpoints stay intact and resumable. The SIGKILL-at-random-moments test is
end_to_end/cpu/kill_resume.py.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time

import pytest

from ckpt_helpers import assert_bitwise_equal, cache_dir, logged, train_subprocess  # noqa: F401
from maxtrain.checkpointing import files as checkpoint_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses Linux prlimit and signals")


class Output:
    """Collects a process' output in a thread; wait_for(text) blocks until it appears."""

    def __init__(self, process):
        self.process, self.lines = process, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while text not in self.text():
            assert self.process.poll() is None or text in self.text(), f"exited before {text!r}:\n{self.text()}"
            assert time.time() < deadline, f"no {text!r} after {timeout}s:\n{self.text()}"
            time.sleep(0.01)

    def finish(self, timeout: float = 240) -> int:
        code = self.process.wait(timeout=timeout)
        self.thread.join(timeout=10)
        return code


def wait_until(condition, process, timeout=240):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, "the run ended too early"
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.slow
def test_sigterm_saves_then_a_failing_save_stops_the_run_and_keeps_earlier_checkpoints(tmp_path, cache_dir):  # noqa: F811
    ckpts = tmp_path / "r" / "checkpoints"
    run = ["steps=5000", "checkpoint_period=50", "max_num_checkpoints_to_keep=1", f"metrics_file={tmp_path}/m.jsonl"]

    # 1. SIGTERM while training: the current step is saved, the process exits with 143.
    first = train_subprocess(tmp_path, "r", cache_dir, *run)
    out = Output(first)
    wait_until(lambda: (ckpts / "50").is_dir(), first)
    first.send_signal(signal.SIGTERM)
    assert out.finish() == 143, out.text()
    saved = checkpoint_files.complete_steps(str(ckpts))
    last_logged = max(logged(tmp_path / "m.jsonl"))
    assert saved[-1] == last_logged > 50, (saved, last_logged, out.text())
    assert f"SIGTERM (preemption): saving step {saved[-1]} and stopping" in out.text()
    sigterm_step = saved[-1]
    params_before = checkpoint_files.read_params(str(ckpts / str(sigterm_step)))

    # 2. The same command resumes from that step; then its writes start to fail (as on a full disk).
    # (Without the metrics file, which is already larger than the limit set below.)
    second = train_subprocess(tmp_path, "r", cache_dir, *run[:-1])
    out = Output(second)
    out.wait_for(f"Resuming from {ckpts}/{sigterm_step}")
    second.send_signal(signal.SIGSTOP)
    resource.prlimit(second.pid, resource.RLIMIT_FSIZE, (4096, 4096))
    second.send_signal(signal.SIGCONT)
    assert out.finish() == 2, out.text()
    failed_step = (sigterm_step // 50 + 1) * 50
    error = out.text().strip().splitlines()[-1]
    assert error.startswith(
        f"maxtrain: error: saving checkpoint {failed_step} to {ckpts} failed: File too large. Training stopped. "
        f"Complete checkpoints on disk: [{sigterm_step}]. Free disk space or fix the directory's permissions, then "
        f"re-run the same command to resume from step {sigterm_step}. ("), out.text()[-3000:]
    assert checkpoint_files.complete_steps(str(ckpts)) == [sigterm_step], os.listdir(ckpts)
    assert_bitwise_equal(checkpoint_files.read_params(str(ckpts / str(sigterm_step))), params_before,
                         "the earlier checkpoint after the failed save")
