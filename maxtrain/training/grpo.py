"""GRPO (Shao et al. 2024; DeepSeek-R1): rollouts and one policy update on every step.

    inputs = grpo.with_rewards(config, data.make_inputs(config), functions)  # checked before any work
    step = grpo.Step(run, train_step, inputs)    # what loop.train calls for each prompt batch
    state, metrics = step(state, prompt_batch)

A step, for a batch of B / G prompts (B = global_batch_size completions, G = num_generations):

1. Rollout. G completions of every prompt, sampled from the current policy (the LoRA adapters
   merged in) with the KV cache (models/sampling.sample_completions: the prompts left-padded,
   decode_sampling_temperature and decode_sampling_nucleus_p, or top-k), max_target_length -
   max_prefill_predict_length tokens each, cut after the first stop token (data/prompts.stop_ids).
   The sampling key is fold_in(the run's rollout key, step): rollouts depend on the seed and the
   step alone, so a resumed run samples what the uninterrupted run did.
2. Rewards (training/rewards.py) on the host, and group-normalized advantages
   A = (r - mean of its group) / (std of its group + 1e-4), the population std: a group whose
   completions all scored alike has A = 0 and teaches nothing.
3. Update. One optimizer step of losses.grpo on rows prompt + completion (loss on the
   completion's tokens only), with the sampler's log-probabilities as pi_old: the ratio is 1 in
   value, but its gradient is the policy gradient A grad log pi.

Each step is synchronous (the next rollout needs this update's weights); both parts are timed and
logged: learning/grpo_rollout_seconds (sampling + rewards) and learning/grpo_update_seconds.
Held-out prompts (grain_eval_files) are answered greedily every eval_interval steps (`HeldOut`):
eval/grpo_reward and, with exact_match, eval/grpo_accuracy.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from maxtrain import data as data_lib
from maxtrain.data import pipeline, prompts as prompts_lib
from maxtrain.models import sampling
from maxtrain.training import environments, episodes, loop, rewards

ADVANTAGE_EPS = 1e-4
ROLLOUT_SALT = 0x6C7A  # the rollout key: fold_in(key(seed), ROLLOUT_SALT), apart from the init key


@dataclasses.dataclass
class Inputs:
    """A GRPO run's inputs: data.make_inputs' (the prompts) with the reward functions; what train.py reads from
    any run's inputs, and GRPO's own."""
    data: data_lib.Inputs
    functions: dict                   # reward name -> function
    environment: environments.Source | None = None  # grpo_environment: multi-turn episodes (training/episodes.py)

    @property
    def prompts(self) -> prompts_lib.PromptInputs:
        return self.data.prompts

    @property
    def tokenizer(self):
        return self.data.tokenizer

    @property
    def train_iterator(self):
        return self.data.train_iterator

    @property
    def eval_batches(self):           # the held-out prompts (HeldOut answers them)
        return self.data.eval_batches

    def close(self) -> None:
        self.data.close()


def with_rewards(config, inputs: data_lib.Inputs, functions: dict, log=print) -> Inputs:
    """The prompts of data.make_inputs (whose first record of every file it checked) with the reward functions
    (rewards.load's), which are called on made-up completions of those records here: every mistake stops the
    run before any compilation."""
    first = inputs.prompts.first_records
    rewards.check(functions, [p.text for p in first], [p.answer for p in first])
    environment = environments.load(config.grpo_environment) if config.grpo_environment else None
    if environment is not None:  # made, reset and stepped on the first records now (training/episodes.py)
        episodes.check(config, inputs.prompts, environment, first)
        log(f"GRPO: multi-turn episodes with the environment {config.grpo_environment!r}, at most "
            f"{'any' if config.grpo_max_turns < 0 else config.grpo_max_turns} model turns and "
            f"{episodes.budget(config)} tokens each")
    named = ", ".join(functions) or "the environment's"
    log(f"GRPO: {prompts_lib.per_step(config)} prompts x {config.num_generations} completions of at most "
        f"{completion_length(config)} tokens per step; rewards {named}; beta {config.grpo_beta:g}, "
        f"epsilon {config.grpo_epsilon:g}; sampling {describe_sampling(config)}")
    return Inputs(inputs, functions, environment)


def completion_length(config) -> int:
    return config.max_target_length - config.max_prefill_predict_length


def describe_sampling(config) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sampling.sampling_settings(config).items())


def rollout_key(config, step: int):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), ROLLOUT_SALT), step)


def cut(tokens: np.ndarray, stops) -> tuple[np.ndarray, np.ndarray]:
    """(tokens kept per completion, its stop token included [N]; whether it stopped [N]) for tokens [N, C]."""
    is_stop = np.isin(tokens, np.asarray(list(stops), np.int64))
    stopped = is_stop.any(axis=1)
    first = np.where(stopped, is_stop.argmax(axis=1), tokens.shape[1] - 1)
    return (first + 1).astype(np.int32), stopped


def advantages(rewards_: np.ndarray, group: int) -> np.ndarray:
    """(r - group mean) / (group std + ADVANTAGE_EPS) for rewards [N] in consecutive groups of `group`."""
    r = rewards_.reshape(-1, group).astype(np.float64)
    a = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + ADVANTAGE_EPS)
    return a.reshape(-1).astype(np.float32)


def assemble(prompt_ids: list, tokens: np.ndarray, log_probs: np.ndarray, kept: np.ndarray, adv: np.ndarray,
             length: int, shape: tuple[int, int], model: np.ndarray | None = None) -> dict:
    """The update's batch [A, b, T]: each row prompt + its kept completion, loss weight 1 on the completion
    (with `model` [N, C]: that weight on each completion token, 0 on an environment's observations)."""
    n = tokens.shape[0]
    batch = {k: np.zeros((n, length), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    for k in ("loss_weights", "advantages", "old_log_probs"):
        batch[k] = np.zeros((n, length), np.float32)
    for i in range(n):
        p, c = len(prompt_ids[i]), int(kept[i])
        seq = np.concatenate([prompt_ids[i], tokens[i, :c]])
        m = len(seq) - 1
        batch["inputs"][i, :m], batch["targets"][i, :m] = seq[:-1], seq[1:]
        batch["positions"][i, :m], batch["segment_ids"][i, :m] = np.arange(m), 1
        batch["loss_weights"][i, p - 1:m] = 1.0 if model is None else model[i, :c]  # targets p-1 .. : the completion
        batch["old_log_probs"][i, p - 1:m] = log_probs[i, :c]
        batch["advantages"][i, :m] = adv[i]
    return {k: v.reshape(shape + (length,)) for k, v in batch.items()}


def left_padded(prompts: list, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids [N, P] left-padded, first slot [N]) of Prompts."""
    ids = np.zeros((len(prompts), length), np.int32)
    first = np.zeros(len(prompts), np.int32)
    for i, p in enumerate(prompts):
        first[i] = length - len(p.ids)
        ids[i, first[i]:] = p.ids
    return ids, first


def decode(tokenizer, tokens: np.ndarray, kept: np.ndarray, stopped: np.ndarray) -> list[str]:
    """Each completion's text, without its stop token."""
    return [tokenizer.decode([int(t) for t in row[:k - int(s)]]) for row, k, s in zip(tokens, kept, stopped)]


class Step:
    """One GRPO step: rollout, rewards, update (see the module's docstring); loop.train calls it."""

    def __init__(self, run, train_step, inputs: Inputs):
        self.run, self.train_step, self.inputs = run, train_step, inputs
        config = run.config
        self.group = config.num_generations
        self.sample = jax.jit(lambda params, prompt, first, key: sampling.sample_completions(
            params, prompt, first, key, model=run.model, rt=run.rt, max_new_tokens=completion_length(config),
            **sampling.sampling_settings(config)))
        self.episodes = episodes.Episodes(config, inputs.prompts, inputs.environment) if inputs.environment else None

    def rollout(self, state, batch: dict, step: int):
        """(update batch [A, b, T] on the host, host metrics) for one prompt batch."""
        if self.episodes is not None:  # grpo_environment: multi-turn episodes
            return self.multi_turn(state, batch, step)
        config, g = self.run.config, self.group
        prompt = np.repeat(batch["prompt"], g, axis=0)
        first = np.repeat(batch["first"], g, axis=0)
        tokens, log_probs = jax.device_get(self.sample(self.run.model_params(state), prompt, first,
                                                       rollout_key(config, step)))
        kept, stopped = cut(tokens, self.inputs.prompts.stop_ids)
        completions = decode(self.inputs.tokenizer, tokens, kept, stopped)
        texts = [t.decode() for t in np.repeat(batch["text"], g)]
        answers = [a.decode() for a in np.repeat(batch["answer"], g)]
        saved = (" (the checkpoints saved so far are kept; re-run the same command to resume from the latest)"
                 if config.enable_checkpointing else "")
        total, parts = rewards.score(self.inputs.functions, texts, completions, answers,
                                     context=f" at step {step + 1}{saved}")
        adv = advantages(total, g)
        prompt_ids = [row[f:] for row, f in zip(prompt, first)]
        update = assemble(prompt_ids, tokens, log_probs, kept, adv, config.max_target_length,
                          (config.gradient_accumulation_steps, config.micro_batch_size))
        host = {"aux/grpo_reward": float(total.mean()),
                "aux/grpo_reward_std": float(total.reshape(-1, g).std(axis=1).mean()),
                "aux/grpo_completion_length": float(kept.mean()),
                "aux/grpo_stopped_fraction": float(stopped.mean())}
        if "exact_match" in parts:
            host["aux/grpo_accuracy"] = float(parts["exact_match"].mean())
        return update, host

    def multi_turn(self, state, batch: dict, step: int):
        """rollout's (update batch, host metrics) of episodes with the environment (training/episodes.py)."""
        config, g = self.run.config, self.group
        texts = [t.decode() for t in np.repeat(batch["text"], g)]
        answers = [a.decode() for a in np.repeat(batch["answer"], g)]
        saved = (" (the checkpoints saved so far are kept; re-run the same command to resume from the latest)"
                 if config.enable_checkpointing else "")
        played = self.episodes.play(self.sample, self.run.model_params(state), np.repeat(batch["prompt"], g, axis=0),
                                    np.repeat(batch["first"], g, axis=0), texts, answers, rollout_key(config, step),
                                    context=f" at step {step + 1}{saved}")
        total, parts = rewards.score(self.inputs.functions, texts, played.final, answers,
                                     context=f" at step {step + 1}{saved}")
        total = total + played.reward
        update = assemble(played.prompt_ids, played.tokens, played.log_probs, played.kept, advantages(total, g),
                          config.max_target_length, (config.gradient_accumulation_steps, config.micro_batch_size),
                          played.model)
        host = {"aux/grpo_reward": float(total.mean()),
                "aux/grpo_reward_std": float(total.reshape(-1, g).std(axis=1).mean()),
                "aux/grpo_completion_length": float(played.kept.mean()),
                "aux/grpo_stopped_fraction": float(played.done.mean()),
                "aux/grpo_environment_reward": float(played.reward.mean()),
                "aux/grpo_turns": float(played.turns.mean()),
                "aux/grpo_multi_turn_fraction": float((played.turns > 1).mean()),
                "aux/grpo_model_token_fraction": float(played.model.sum() / max(played.kept.sum(), 1))}
        if "exact_match" in parts:
            host["aux/grpo_accuracy"] = float(parts["exact_match"].mean())
        return update, host

    def __call__(self, state, batch: dict):
        started = time.perf_counter()
        step = int(jax.device_get(state["step"]))
        update, host = self.rollout(state, batch, step)
        rolled = time.perf_counter()
        global_batch = pipeline.to_global(update, self.run.mesh, self.run.config.logical_axis_rules)
        state, metrics = self.train_step(state, global_batch)
        metrics = jax.block_until_ready(metrics)
        host["aux/grpo_rollout_seconds"] = rolled - started
        host["aux/grpo_update_seconds"] = time.perf_counter() - rolled
        return state, {**metrics, **host}


class HeldOut(loop.Hook):
    """Greedy answers to the held-out prompts: at step 0 of a fresh run, every eval_interval steps and at
    the end; eval/grpo_reward and (with exact_match) eval/grpo_accuracy."""

    def __init__(self, run, inputs: Inputs, writer, log):
        self.built, self.inputs, self.writer, self.log = run, inputs, writer, log
        config = run.config
        self.losses, self.metrics = {}, {}
        self.greedy = jax.jit(lambda params, prompt, first: sampling.sample_completions(
            params, prompt, first, jax.random.key(0), model=run.model, rt=run.rt,
            max_new_tokens=completion_length(config), temperature=0.0, top_k=0, top_p=1.0)[0])
        self.episodes = episodes.Episodes(config, inputs.prompts, inputs.environment) if inputs.environment else None
        self.greedy_turn = jax.jit(lambda params, prompt, first, key: sampling.sample_completions(
            params, prompt, first, key, model=run.model, rt=run.rt, max_new_tokens=completion_length(config),
            temperature=0.0, top_k=0, top_p=1.0))

    def start(self, step, state):
        if step == 0:
            self.run_eval(0, state)

    def due(self, at):
        interval = self.built.config.eval_interval
        return not at.stopping and interval > 0 and (at.done % interval == 0 or at.last)

    def run(self, at, state):
        self.run_eval(at.done, state)

    def scores(self, params, done: int = 0) -> tuple[float, dict]:
        """(mean summed reward, {name: mean}) of greedy answers to the held-out prompts."""
        config, held_out = self.built.config, self.inputs.eval_batches
        rows = config.global_batch_size
        texts, answers, completions, environment, turns = [], [], [], [], []
        for start in range(0, len(held_out), rows):
            chunk = held_out[start:start + rows]
            padded = chunk + [chunk[-1]] * (rows - len(chunk))  # the last batch filled with copies (not scored)
            prompt, first = left_padded(padded, config.max_prefill_predict_length)
            if self.episodes is not None:  # greedy episodes with the environment (training/episodes.py)
                played = self.episodes.play(self.greedy_turn, params, prompt, first, [p.text for p in padded],
                                            [p.answer for p in padded], jax.random.key(0),
                                            context=f" on the held-out prompts at step {done}")
                completions += played.final[:len(chunk)]
                environment += list(played.reward[:len(chunk)])
                turns += list(played.turns[:len(chunk)])
            else:
                tokens = jax.device_get(self.greedy(params, prompt, first))[:len(chunk)]
                kept, stopped = cut(tokens, self.inputs.prompts.stop_ids)
                completions += decode(self.inputs.tokenizer, tokens, kept, stopped)
            texts += [p.text for p in chunk]
            answers += [p.answer for p in chunk]
        total, parts = rewards.score(self.inputs.functions, texts, completions, answers,
                                     context=f" on the held-out prompts at step {done}")
        if self.episodes is not None:
            total = total + np.asarray(environment, np.float32)
            parts["environment"] = np.asarray(environment, np.float32)
            parts["multi_turn_fraction"] = (np.asarray(turns) > 1).astype(np.float32)
        return float(total.mean()), {name: float(v.mean()) for name, v in parts.items()}

    def run_eval(self, done: int, state) -> None:
        reward, parts = self.scores(self.built.model_params(state), done)
        out = {"grpo_reward": reward}
        if "exact_match" in parts:
            out["grpo_accuracy"] = parts["exact_match"]
        if self.episodes is not None:
            out["grpo_multi_turn_fraction"] = parts["multi_turn_fraction"]
        self.metrics[done] = out
        self.log(f"eval at step {done}: held-out greedy answers ({len(self.inputs.eval_batches)} prompts): "
                 + "  ".join(f"{k} {v:.4f}" for k, v in out.items()))
        self.writer.write(done, {f"eval/{k}": v for k, v in out.items()}, print_line=False)
