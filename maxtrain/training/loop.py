"""The training loop: dispatch step n+1, then report step n; periodic work as a list of hooks.

    result = loop.train(run, step_fn, state, batches, hooks, reporter, preemption)

Every step is dispatched before the previous step's metrics are read, so the host reports while the
device computes. Periodic work is a `Hook`: the loop asks each hook after every step whether it is
due, and before any hook that pauses training (`flushes`: an evaluation, a heatmap, a profile being
written) it writes the pending step's metrics once (`Reporter.flush`) and restarts the step clock
afterwards, so that no step's time includes the hook's. Saving a checkpoint is a hook too: it runs
asynchronously and does not pause training.

A SIGTERM (preemption) makes the next step the last: the checkpoint hook saves it and the loop stops;
re-running the same command resumes there.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.errors import UserError
from maxtrain.observability import heatmap, metrics, profiler
from maxtrain.training import host_memory


class TrainingError(UserError, RuntimeError):
    """The run cannot continue; the message says why and what to try."""


@dataclasses.dataclass
class RunResult:
    """What a training run returns (train.main)."""
    config: Any
    state: Any = None                     # the final train state (None when there was nothing to train)
    eval_losses: dict = dataclasses.field(default_factory=dict)    # {step: eval loss}
    eval_metrics: dict = dataclasses.field(default_factory=dict)   # {step: {metric: value}}
    sample: str | None = None             # the greedy sample after training
    preempted: bool = False               # stopped by SIGTERM after saving; re-run to resume
    nothing_to_train: bool = False        # resumed at or past `steps`


def check_finite(step: int, m: dict, loss_scaled: bool, loss_scale_min: float = 1.0) -> None:
    """Stops a diverged run. With float16 loss scaling a non-finite step was skipped (nothing was
    updated) and the scale halved; the run stops only once the scale is at its floor."""
    loss = m["learning/loss"]
    if math.isfinite(loss) or (loss_scaled and m["learning/loss_scale"] > loss_scale_min):
        return
    raise TrainingError(
        f"the loss became {loss} at step {step} (grad norm {m['learning/grad_norm']}). Nothing after the last "
        "checkpoint was saved. Try a lower learning_rate, a longer warmup (warmup_steps_fraction), "
        "gradient_clipping_threshold=1.0, or dtype=float32 / bfloat16 instead of float16.")


class Reporter:
    """Holds the metrics of the step dispatched last; writes them once they are on the host."""

    def __init__(self, config, writer, flops: float, peak: float | None, loss_scaled: bool):
        self.config, self.writer, self.peak, self.loss_scaled = config, writer, peak, loss_scaled
        self.flops = flops  # the model's training FLOPs per token (metrics.flops_per_token)
        self.pending = None  # (step, device metrics)
        self.last_done = time.time()

    def dispatched(self, step: int, step_metrics) -> None:
        """Step `step` was dispatched: the one before it is written (its metrics are ready by now)."""
        self.flush()
        self.pending = (step, step_metrics)

    def flush(self) -> None:
        """Waits for the pending step's metrics and writes them (the step's time ends when they arrive)."""
        if self.pending is None:
            return
        step, device_metrics = self.pending
        self.pending = None
        raw = jax.device_get(device_metrics)
        now = time.time()
        m = metrics.step_metrics(raw, now - self.last_done, self.config, self.flops, self.peak)
        self.last_done = now
        check_finite(step + 1, m, self.loss_scaled, self.config.loss_scale_min)
        self.writer.write(step + 1, m, print_line=(step + 1) % self.config.log_period == 0 or step == 0)

    def restart_clock(self) -> None:
        """The next step's time starts now (after work that is not a training step)."""
        self.last_done = time.time()


@dataclasses.dataclass(frozen=True)
class Moment:
    """Where the loop is when it asks the hooks: after step `done` (1-based) was dispatched."""
    done: int               # steps finished
    last: bool = False      # the run's final step
    stopping: bool = False  # a preemption makes this step the last


class Hook:
    """Periodic work, asked after every step whether it is `due`. A hook that `flushes` pauses training:
    the pending metrics are written before it runs, and its time is not a step's."""
    flushes = True

    def start(self, step: int, state) -> None:
        """Before the first step of this process (`step`: where the run starts or resumes)."""

    def before_step(self, step: int, state) -> None:
        """Before step `step` (0-based) is dispatched; `state` is the latest dispatched state."""

    def due(self, at: Moment) -> bool:
        return False

    def run(self, at: Moment, state) -> None:
        """The work, on the state after step `at.done`."""

    def close(self, state) -> None:
        """After the loop (also after a preemption)."""


def evaluate(eval_step, state, eval_batches) -> tuple[float, dict]:
    """(weighted mean loss, weighted mean of each metric) of the objective over the eval batches
    (padding has weight 0)."""
    total, weight, sums = 0.0, 0.0, {}
    for batch in eval_batches:
        loss_sum, weight_sum, step_metrics = eval_step(state, batch)
        total, weight = total + loss_sum, weight + weight_sum
        sums = {k: sums.get(k, 0.0) + v * weight_sum for k, v in step_metrics.items()}
    denom = jnp.maximum(weight, 1.0)
    return float(total / denom), {k: float(v / denom) for k, v in sums.items()}


class Evaluation(Hook):
    """An evaluation at step 0 of a fresh run, every eval_interval steps and at the end; a subclass sets
    `self.config` and writes `evaluate(done, state)` (EvalLoss; GRPO's and on-policy distillation's `HeldOut`)."""
    config = None

    def start(self, step, state):
        if step == 0:
            self.evaluate(0, state)

    def due(self, at):
        interval = self.config.eval_interval
        return not at.stopping and interval > 0 and (at.done % interval == 0 or at.last)

    def run(self, at, state):
        self.evaluate(at.done, state)

    def evaluate(self, done: int, state) -> None:
        raise NotImplementedError


class EvalLoss(Evaluation):
    """The objective on the eval batches: at step 0 of a fresh run, every eval_interval steps and at the end."""

    def __init__(self, config, eval_step, eval_batches, writer, log):
        self.config, self.eval_step, self.eval_batches, self.writer, self.log = config, eval_step, eval_batches, writer, log
        self.losses, self.metrics = {}, {}

    def evaluate(self, done, state):
        loss, extra = evaluate(self.eval_step, state, self.eval_batches())
        self.losses[done], self.metrics[done] = loss, extra
        self.log(f"eval at step {done}: loss {loss:.4f}" + "".join(f"  {k} {v:.4f}" for k, v in extra.items()))
        self.writer.write(done, {"eval/avg_loss": loss, **{f"eval/{k}": v for k, v in extra.items()}},
                          print_line=False)


class TaskEval(Hook):
    """Downstream tasks (eval_tasks): at step 0 of a fresh run when eval_tasks_interval > 0, then as it says."""

    def __init__(self, evaluator, model_params, writer):
        self.evaluator, self.model_params, self.writer = evaluator, model_params, writer

    def start(self, step, state):
        if step == 0 and self.evaluator.config.eval_tasks_interval > 0:
            self.run(Moment(0), state)

    def due(self, at):
        return not at.stopping and self.evaluator.due(at.done, at.last)

    def run(self, at, state):
        self.evaluator.run(self.model_params(state), at.done, self.writer)


class Heatmap(Hook):
    """The per-token log-probability heatmap of the first eval batch, every viz_period steps."""

    def __init__(self, config, model, rt, batch, tokenizer, model_params, writer, log):
        self.config, self.model, self.rt, self.batch, self.tokenizer = config, model, rt, batch, tokenizer
        self.model_params, self.writer, self.log = model_params, writer, log

    def due(self, at):
        return not at.stopping and at.done % self.config.viz_period == 0

    def run(self, at, state):
        done = at.done
        path = heatmap.write_heatmap(done, self.model_params(state), self.batch, self.model, self.rt,
                                     self.tokenizer, self.writer)
        self.log(f"token heatmap at step {done}: {path}")


class Profile(Hook):
    """profiler=xplane: traces a few steps (observability/profiler.py)."""
    flushes = False

    def __init__(self, config, log):
        self.config, self.log, self.profiler = config, log, None

    def start(self, step, state):
        self.profiler = profiler.Profiler(self.config, step, self.log)

    def before_step(self, step, state):
        self.profiler.step(step, state)

    def close(self, state):
        self.profiler.stop(state)


class Checkpoint(Hook):
    """Saves every checkpoint_period steps, at the end and on preemption; otherwise polls the background save."""
    flushes = False

    def __init__(self, config, checkpointer, data_iterator, metadata: dict):
        self.config, self.checkpointer, self.data_iterator, self.metadata = config, checkpointer, data_iterator, metadata
        self.failed = False  # a save failed: nothing more is asked of the checkpointer

    def due(self, at):
        return True  # after every step: it saves when it is time, else surfaces a failed background save

    def run(self, at, state):
        try:
            if at.done % self.config.checkpoint_period == 0 or at.last or at.stopping:
                self.checkpointer.save(at.done, state, self.data_iterator, self.metadata)
            else:
                self.checkpointer.poll()
        except Exception:
            self.failed = True
            raise

    def close(self, state):
        self.checkpointer.close()


def finish_saves(hooks: list[Hook], log) -> None:
    """After the training loop failed: the checkpoint saves under way are finished (and their checksums
    written), so that the run stops with every step it saved usable; a save that fails now is reported, not
    raised over the loop's own error."""
    for hook in hooks:
        if isinstance(hook, Checkpoint) and not hook.failed:  # a save that failed has said so itself
            try:
                hook.checkpointer.close()
            except Exception as error:  # pylint: disable=broad-except  (the loop's error is the one to raise)
                log(f"warning: the checkpoint save under way failed too: {error}")


def train(step_fn, state, batches, start_step: int, steps: int, hooks: list[Hook], reporter: Reporter,
          preemption, log) -> tuple[Any, bool]:
    """Runs steps [start_step, steps); returns (the final state, whether a preemption stopped it). When anything
    fails on the way (a step, a GRPO reward, an evaluation, the data), the checkpoint saves under way are
    finished before the error goes on."""
    for hook in hooks:
        hook.start(start_step, state)
    reporter.restart_clock()
    try:
        state, preempted = _steps(step_fn, state, batches, start_step, steps, hooks, reporter, preemption, log)
        preemption.close()
        reporter.flush()
    except Exception:
        finish_saves(hooks, log)
        raise
    for hook in hooks:
        hook.close(state)
    return state, preempted


def _steps(step_fn, state, batches, start_step: int, steps: int, hooks: list[Hook], reporter: Reporter,
           preemption, log) -> tuple[Any, bool]:
    preempted = False
    for step in range(start_step, steps):
        batch = next(batches)
        for hook in hooks:
            hook.before_step(step, state)
        state, step_metrics = step_fn(state, batch)  # dispatched; runs while the previous step is reported
        first_report = reporter.pending is not None and reporter.pending[0] == start_step
        reporter.dispatched(step, step_metrics)
        if first_report:  # one step done (and the first evaluation compiled): what compiling left goes back
            host_memory.release_unused()
        done = step + 1
        preempted = preemption.reached(done) and done != steps
        if preempted:
            saving = any(isinstance(h, Checkpoint) for h in hooks)
            log(f"SIGTERM (preemption): {'saving step ' + str(done) if saving else 'checkpointing is off, nothing saved'}"
                " and stopping; re-run the same command to resume")
        at = Moment(done, last=done == steps, stopping=preempted)
        due = [h for h in hooks if h.due(at)]
        pauses = any(h.flushes for h in due)
        if pauses:
            reporter.flush()
        for hook in due:
            hook.run(at, state)
        if pauses:
            reporter.restart_clock()  # the hooks' time is not a train step's
        if preempted:
            break
    return state, preempted
