"""On-policy distillation (objective=distill_on_policy): the student samples, the frozen teacher scores every token.

    step = on_policy.Step(run, train_step, inputs)     # what loop.train calls for each prompt batch
    state, metrics = step(state, prompt_batch)

A step, for a batch of B / G prompts (B = global_batch_size completions, G = num_generations):

1. Rollout. G completions of every prompt sampled from the current student, exactly as GRPO samples them
   (training/grpo.py: models/sampling.sample_completions with the KV cache, the decode_sampling_* settings,
   max_target_length - max_prefill_predict_length new tokens, cut after the first stop token; the key is
   fold_in(the run's rollout key, step), so a resumed run samples what the uninterrupted run did).
2. Update. One optimizer step of losses.distill_on_policy on rows prompt + completion, loss weight 1 on the
   completion's tokens: per token the reverse KL(student || teacher) over the whole vocabulary, both models'
   softmax(logits / T) at the sampler's temperature T. No rewards, no advantages, no pi_old: the teacher's
   distribution at every sampled prefix is the signal.

The formulation is TRL 1.16's DistillationTrainer with beta=1 (its generalized JSD at beta=1 is
F.kl_div(teacher_log_probs, student_log_probs, log_target=True) = KL(student || teacher), per completion token,
summed and divided by the batch's completion tokens), which is GKDTrainer.generalized_jsd_loss at beta=1 on
fully on-policy data (lmbda=1). Thinking Machines' "On-Policy Distillation" (2025) uses the same per-token reverse
KL, estimated from the sampled token alone (log q(x) - log p(x) as a negative advantage); the exact sum over the
vocabulary has that estimate's expectation and none of its variance, at the cost of the teacher's full logits
(which distillation computes anyway). tests/training/test_on_policy_distill.py checks the loss and its gradients
against TRL's on the same samples.

Both parts are timed and logged (learning/distill_rollout_seconds, learning/distill_update_seconds), with the
completions' mean length and stopped fraction. Held-out prompts (grain_eval_files) are answered greedily every
eval_interval steps (`HeldOut`): eval/distill_reverse_kl, the teacher's view of the student's own answers.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from maxtrain.data import pipeline
from maxtrain.models import sampling
from maxtrain.training import grpo, loop


def update_batch(prompt_ids: list, tokens: np.ndarray, kept: np.ndarray, length: int, shape: tuple[int, int]) -> dict:
    """The update's batch [A, b, T] (grpo.assemble's rows, without GRPO's advantages and pi_old)."""
    n = tokens.shape[0]
    batch = grpo.assemble(prompt_ids, tokens, np.zeros(tokens.shape, np.float32), kept, np.zeros(n, np.float32),
                          length, shape)
    return {k: v for k, v in batch.items() if k not in ("advantages", "old_log_probs")}


class Step:
    """One on-policy distillation step: rollout, update (see the module's docstring); loop.train calls it."""

    def __init__(self, run, train_step, inputs):
        self.run, self.train_step, self.inputs = run, train_step, inputs
        config = run.config
        self.sample = jax.jit(lambda params, prompt, first, key: sampling.sample_completions(
            params, prompt, first, key, model=run.model, rt=run.rt, max_new_tokens=grpo.completion_length(config),
            **sampling.sampling_settings(config))[0])

    def rollout(self, state, batch: dict, step: int):
        """(update batch [A, b, T] on the host, host metrics) for one prompt batch."""
        config = self.run.config
        g = config.num_generations
        prompt = np.repeat(batch["prompt"], g, axis=0)
        first = np.repeat(batch["first"], g, axis=0)
        tokens = jax.device_get(self.sample(self.run.model_params(state), prompt, first,
                                            grpo.rollout_key(config, step)))
        kept, stopped = grpo.cut(tokens, self.inputs.prompts.stop_ids)
        prompt_ids = [row[f:] for row, f in zip(prompt, first)]
        update = update_batch(prompt_ids, tokens, kept, config.max_target_length,
                              (config.gradient_accumulation_steps, config.micro_batch_size))
        return update, {"aux/distill_completion_length": float(kept.mean()),
                        "aux/distill_stopped_fraction": float(stopped.mean())}

    def __call__(self, state, batch: dict):
        started = time.perf_counter()
        step = int(jax.device_get(state["step"]))
        update, host = self.rollout(state, batch, step)
        rolled = time.perf_counter()
        global_batch = pipeline.to_global(update, self.run.mesh, self.run.config.logical_axis_rules)
        state, metrics = self.train_step(state, global_batch)
        metrics = jax.block_until_ready(metrics)
        host["aux/distill_rollout_seconds"] = rolled - started
        host["aux/distill_update_seconds"] = time.perf_counter() - rolled
        return state, {**metrics, **host}


class HeldOut(loop.Evaluation):
    """The reverse KL of the student's greedy answers to the held-out prompts, under the teacher: at step 0 of a
    fresh run, every eval_interval steps and at the end (eval/distill_reverse_kl, a mean per answer token)."""

    def __init__(self, run, inputs, writer, log):
        self.built, self.inputs, self.writer, self.log = run, inputs, writer, log
        self.config = config = run.config
        self.losses, self.metrics = {}, {}
        self.greedy = jax.jit(lambda params, prompt, first: sampling.sample_completions(
            params, prompt, first, jax.random.key(0), model=run.model, rt=run.rt,
            max_new_tokens=grpo.completion_length(config), temperature=0.0, top_k=0, top_p=1.0)[0])

    def reverse_kl(self, state) -> float:
        """The mean per-token reverse KL of greedy answers to the held-out prompts (the last batch padded with
        copies of its last prompt, weighing 0)."""
        run, held_out = self.built, self.inputs.eval_batches
        config, rows = run.config, run.config.global_batch_size
        total, tokens = 0.0, 0.0
        for start in range(0, len(held_out), rows):
            chunk = held_out[start:start + rows]
            padded = chunk + [chunk[-1]] * (rows - len(chunk))
            prompt, first = grpo.left_padded(padded, config.max_prefill_predict_length)
            answers = jax.device_get(self.greedy(run.model_params(state), prompt, first))
            kept, _ = grpo.cut(answers, self.inputs.prompts.stop_ids)
            kept[len(chunk):] = 0  # the copies: no completion tokens, weight 0
            batch = update_batch([p.ids for p in padded], answers, kept, config.max_target_length, (rows,))
            batch = pipeline.to_global(batch, run.mesh, config.logical_axis_rules, pipeline.EVAL_BATCH_AXES)
            loss, weight, _ = run.eval_step(state, batch)
            total, tokens = total + float(loss), tokens + float(weight)
        return total / max(tokens, 1.0)

    def evaluate(self, done: int, state) -> None:
        kl = self.reverse_kl(state)
        self.losses[done] = kl
        self.metrics[done] = {"distill_reverse_kl": kl}
        self.log(f"eval at step {done}: held-out greedy answers ({len(self.inputs.eval_batches)} prompts): "
                 f"distill_reverse_kl {kl:.4f}")
        self.writer.write(done, {"eval/distill_reverse_kl": kl}, print_line=False)
