"""grpo.Step's rollouts on workers (grpo_rollout_workers > 0): which prompt batch goes out when, under which weight
version, and what the update learns of it.

    rollouts = Rollouts(config, iterator, stop_ids, rollout_key)   # iterator: a position.Position; rollout_key: grpo's
    batch = rollouts.begin(step, params)        # version `step` published; prompt batches of steps .. step + k out
    rollouts.trained(step + 1)                  # after the update: the checkpoint's data position moves past it
    tokens, log_probs = rollouts.sample(prompt, first, key, step)     # grpo.Step.draw's, from a worker
    metrics = rollouts.correct(updates, recompute)   # pi_old the trainer's; TIS weights; mismatch
    metrics = rollouts.step_metrics()           # staleness, sync, per-phase time

Version v is the weights after v updates (the state's step). With k = grpo_off_policy_steps the prompt batch of step
t goes out once version t - k is published, so the update at step t trains on completions whose oldest token came
from a version >= t - k (checked when they come back). k = 0: a step's rollout waits for the previous update; with
the JAX engine it samples as the colocated run does (the same program, key and batch): the same completions, losses
and pi_old (the sampler's). k > 0: batches of the next k steps are generated while this one trains; a checkpoint
saves the data position of the first batch it has not trained on (position.py), so a resumed run issues those again
(from the restored version: its first step's completions are on policy, where the uninterrupted run's were k stale).
"""

from __future__ import annotations

import time

import numpy as np

from maxtrain import config as config_lib
from maxtrain.training.rollout import correction, multihost
from maxtrain.training.rollout.controller import Controller
from maxtrain.training.rollout.engine import Request
from maxtrain.training.rollout.jax_engine import seed_of


class StalenessError(RuntimeError):
    pass


class Rollouts:
    def __init__(self, config, iterator, stop_ids, rollout_key, log=print):
        self.config, self.k = config, config.grpo_off_policy_steps
        self.iterator = multihost.prompts(iterator)  # several trainer processes: the prompt batch of all of them
        self.rollout_key = rollout_key
        self.group = config.num_generations
        self.controller, self.log = Controller(config, stop_ids, log), log
        self.corrects = config_lib.objectives.grpo_corrects(config)
        self.version, self.issued_to, self.ahead, self.next_id = -1, None, {}, 0
        self.mark = time.perf_counter()
        self.stats = self.fresh()

    @staticmethod
    def fresh() -> dict:
        return {"wait": 0.0, "busy": 0.0, "generate": 0.0, "assemble": 0.0, "lags": [], "sync": {}}

    def begin(self, step: int, params) -> dict:
        """The prompt batch of `step` (issued now or k steps ago); version `step` published first (a resumed run's
        restored weights, the first time)."""
        if step > self.version:
            if self.version < 0:
                self.log(f"GRPO rollouts: weights version {step} (the state's{', restored' if step else ''}) "
                         f"published to the {len(self.controller.workers)} workers")
            self.stats["sync"] = self.controller.publish(step, params)
            self.version = step
        if self.issued_to is None:
            self.issued_to = step - 1
        while self.issued_to < min(step + self.k, self.config.steps - 1):  # none past the run's last step
            t = self.issued_to + 1
            batch = self.iterator.read(t)
            self.ahead[t] = batch
            self.submit((t, seed_of(self.rollout_key(self.config, t))), *self.rows(batch))
            self.issued_to = t
        self.iterator.step = step  # the step's further prompt batches (dynamic sampling) are its own
        return self.ahead.pop(step)

    def trained(self, done: int) -> None:
        """The updates of steps < done are in the state: a checkpoint's data position is past their prompt batches
        (rollout/position.py), before those of the steps still out."""
        self.iterator.trained(done)

    def rows(self, batch) -> tuple[np.ndarray, np.ndarray]:
        return np.repeat(batch["prompt"], self.group, axis=0), np.repeat(batch["first"], self.group, axis=0)

    def submit(self, tag, prompt: np.ndarray, first: np.ndarray) -> None:
        length = self.config.max_target_length - self.config.max_prefill_predict_length
        requests = [Request(self.next_id + i, np.asarray(row[f:], np.int32), length, tag[1])
                    for i, (row, f) in enumerate(zip(prompt, first))]
        self.next_id += len(requests)
        if self.controller.index == 0:  # the Ray driver (rollout/multihost.py): the others only publish weights
            self.controller.submit(tag, requests)

    def sample(self, prompt: np.ndarray, first: np.ndarray, key, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [N, C], the engine's log-probabilities [N, C]) of prompt rows [N, P], as grpo.Step's sampler gives
        them: the batch issued ahead for this step, or sent now (dynamic sampling's further draws)."""
        tag = (step, seed_of(key))
        if tag not in self.controller.flight:
            self.submit(tag, prompt, first)
        started = time.perf_counter()
        length = self.config.max_target_length - self.config.max_prefill_predict_length
        got = {"tokens": np.zeros((len(prompt), length), np.int32),
               "log_probs": np.zeros((len(prompt), length), np.float32), "oldest": np.full(len(prompt), step, np.int32)}
        if self.controller.index == 0:
            completions, stats = self.controller.collect(tag)
            self.stats["busy"] += stats["generate_seconds"] + stats["swap_seconds"]
            self.stats["generate"] += stats["generate_seconds"]
            self.stats["assemble"] += stats["assemble_seconds"]
            for i, c in enumerate(completions):
                got["tokens"][i, :len(c.tokens)], got["log_probs"][i, :len(c.tokens)] = c.tokens, c.log_probs
                got["oldest"][i] = int(c.versions.min()) if len(c.versions) else step
        got = multihost.from_zero(got)  # the completions process 0 collected, on every trainer process
        self.stats["wait"] += time.perf_counter() - started
        tokens, log_probs = got["tokens"], got["log_probs"]
        for oldest in got["oldest"].tolist():
            if oldest < step - self.k:
                raise StalenessError(f"a completion for step {step} has tokens of version {oldest}, older than "
                                     f"grpo_off_policy_steps={self.k} allows")
            self.stats["lags"].append(step - oldest)
        return tokens, log_probs

    def correct(self, updates: list, recompute) -> dict:
        """pi_old of the update batches: recompute() writes the trainer's own log-probabilities into them. When the
        run corrects (config/objectives.grpo_corrects) they stay pi_old and `tis_weights` is added; otherwise (the JAX
        engine on policy) the sampler's stay pi_old for a rollout batch of one step, as the colocated run has them. The
        mismatch is measured either way."""
        multihost.agree(updates, self.version)
        engine = [u["old_log_probs"].copy() for u in updates]
        recompute()
        parts = []
        for u, e in zip(updates, engine):
            if self.corrects:
                u["tis_weights"], m = correction.tis_weights(u["old_log_probs"], e, u["loss_weights"],
                                                             self.config.grpo_tis_cap)
            else:
                m = correction.mismatch(u["old_log_probs"], e, u["loss_weights"])
                if len(updates) * self.config.grpo_num_iterations == 1:
                    u["old_log_probs"] = e
            parts.append(m)
        return {k: (max if k.endswith("_max") else np.mean)([p[k] for p in parts]) for k in parts[0]}

    def step_metrics(self) -> dict:
        """The step's staleness, weight sync and phases (seconds, and idle % of the wall time since the last)."""
        now = time.perf_counter()
        wall, s = max(now - self.mark, 1e-9), self.stats
        lags = np.asarray(s["lags"] or [0], np.float64)
        out = {**s["sync"], "aux/grpo_staleness_mean": float(lags.mean()), "aux/grpo_staleness_max": float(lags.max()),
               "aux/grpo_generation_seconds": s["generate"], "aux/grpo_wait_seconds": s["wait"],
               "aux/grpo_trainer_idle_percent": 100.0 * s["wait"] / wall,
               "aux/grpo_worker_idle_percent": 100.0 * max(0.0, 1.0 - s["busy"] / (wall * len(
                   self.controller.workers))),
               "aux/grpo_reissued_batches": float(self.controller.reissued),
               "aux/grpo_worker_assemble_seconds": s["assemble"]}
        out.setdefault("aux/grpo_sync_bytes", 0.0)
        out.setdefault("aux/grpo_sync_seconds", 0.0)
        self.mark, self.stats = now, self.fresh()
        return out

    def close(self) -> None:
        """The other trainer processes leave Ray before process 0 stops the workers (and a Ray it started)."""
        if self.controller.index:
            self.controller.close()
        multihost.barrier("grpo rollouts closed")
        if self.controller.index == 0 and self.controller.workers:
            self.controller.close()

