"""Preemption: a SIGTERM (the usual notice before a machine is taken away) asks the training loop to
save the current step and stop; re-running the same command resumes from that checkpoint.

One process: a signal handler sets a flag, which the loop reads after each step. Several processes:
JAX's preemption service (started by jax.distributed.initialize; it catches SIGTERM itself)
agrees on one step at which every process saves, so no Python handler is installed.
"""

from __future__ import annotations

import signal
import threading

import jax


class Preemption:
    """`reached(step)` is True once a SIGTERM has arrived (on every process at the same step)."""

    def __init__(self):
        self.multi = jax.process_count() > 1
        self.received = False
        self._previous = None
        if not self.multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):  # pylint: disable=unused-argument
        self.received = True

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

            return multihost_utils.reached_preemption_sync_point(step)
        return self.received

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
