"""Profiling a few training steps with jax.profiler, under MaxText's keys.

    profiler=xplane skip_first_n_steps_for_profiler=1 profiler_steps=5

traces the `profiler_steps` steps that follow the first `skip_first_n_steps_for_profiler` steps of
this run (counted from where it started or resumed; the first steps pay for warm-up) into

    <run>/tensorboard/plugins/profile/<date>/<host>.xplane.pb

which TensorBoard's profile plugin, xprof, opens: `xprof --logdir <run>/tensorboard` (pip install
'maxtrain[profile]'), or `tensorboard --logdir <run>/tensorboard` with the plugin installed. Only
process 0 traces. A gs:// run directory gets the trace after it is written locally (the profiler
writes local files), uploaded as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax

from maxtrain import storage




class Profiler:
    """Starts the trace before step `first` is dispatched; stops it once step `last - 1` has finished."""

    def __init__(self, config, start_step: int, log=print):
        self.enabled = config.profiler == "xplane" and jax.process_index() == 0
        self.first = start_step + config.skip_first_n_steps_for_profiler
        self.last = min(self.first + config.profiler_steps, config.steps)
        self.directory = config.tensorboard_dir
        self.log = log
        self.active = False
        self._local = None
        if self.enabled and self.first >= config.steps:
            log(f"profiler: nothing to trace: the run ends at step {config.steps}, before step {self.first + 1} "
                f"(skip_first_n_steps_for_profiler={config.skip_first_n_steps_for_profiler} after step {start_step})")
            self.enabled = False

    def step(self, step: int, state) -> None:
        """Call before dispatching step `step` (0-based); `state` is the latest dispatched train state."""
        if not self.enabled:
            return
        if self.active and step == self.last:
            self.stop(state)
        if step == self.first and not self.active:
            self._local = tempfile.mkdtemp(prefix="maxtrain-profile-") if storage.is_remote(self.directory) else None
            jax.profiler.start_trace(self._local or self.directory)
            self.active = True

    def stop(self, state) -> None:
        """Waits for the traced steps to finish and writes the trace (also called at the end of the run)."""
        if not self.active:
            return
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        if self._local:
            for root, _, names in os.walk(self._local):
                for name in names:
                    local = os.path.join(root, name)
                    storage.upload(local, storage.join(self.directory, os.path.relpath(local, self._local)))
            shutil.rmtree(self._local, ignore_errors=True)
        self.log(f"profiler: traced steps {self.first + 1}-{self.last} -> {self.directory}/plugins/profile "
                 f"(view: xprof --logdir {self.directory})")
