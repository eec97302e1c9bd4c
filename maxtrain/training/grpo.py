"""GRPO (Shao et al. 2024; DeepSeek-R1): rollouts and one policy update on every step.

    inputs = grpo.with_rewards(config, data.make_inputs(config), functions)  # checked before any work
    step = grpo.Step(run, train_step, inputs)    # what loop.train calls for each step
    batches = step.batches()                     # its prompt batches (None inside a rollout batch)
    state, metrics = step(state, prompt_batch)

A step, for a batch of B / G prompts (B = global_batch_size completions, G = num_generations):

1. Rollout. G completions of every prompt, sampled from the current policy (the LoRA adapters
   merged in) with the KV cache (models/sampling.sample_completions: the prompts left-padded,
   decode_sampling_temperature and decode_sampling_nucleus_p, or top-k), max_target_length -
   max_prefill_predict_length tokens each, cut after the first stop token (data/prompts.stop_ids).
   The sampling key is fold_in(the run's rollout key, step): rollouts depend on the seed and the
   step alone, so a resumed run samples what the uninterrupted run did.
2. Rewards (training/rewards.py) on the host, DAPO's overlong shaping added (grpo_overlong_buffer_length), and
   advantages (training/advantages.py); by default A = (r - mean of its group) / (std of its group + 1e-4), the
   population std: a group whose completions all scored alike has A = 0 and teaches nothing. With
   grpo_dynamic_sampling such groups are dropped and more prompt batches drawn from the train iterator (keys
   fold_in(the step's key, draw)) until the rollout batch is full, at most grpo_dynamic_sampling_max_batches.
3. Update. One optimizer step of losses.grpo on rows prompt + completion (loss on the
   completion's tokens only; none on a completion cut without a stop with grpo_mask_truncated_completions),
   with the sampler's log-probabilities as pi_old: the ratio is 1 in value, but its gradient is the policy
   gradient A grad log pi.

A rollout batch of grpo_steps_per_generation > 1 mini-batches, or grpo_num_iterations > 1 updates on each, is
that many steps (every optimizer update is a step, as TRL counts them): the first samples it, the others train on
its mini-batches held in memory (`Step.batches` hands loop.train no prompts for them), with pi_old the trainer's
own log-probabilities under the sampling weights, computed once before the first update. No checkpoint is saved
inside a rollout batch (config/objectives.py refuses such checkpoint_period and steps; `AtRolloutEnds` defers a
SIGTERM's stop to its end).

Routing replay (grpo_routing_replay=true, a mixture of experts): the sampler records the experts every MoE
layer chose for each token (prefill and decode steps), the update batch carries them as `routed_experts`
[A, b, T, L_moe, K] int32 beside `inputs`, and the update's forward runs on those experts, weighed by the
router's current logits (models/moe/replay.py; R3, Ma et al. 2025); learning/moe_routing_mismatch is the
fraction of tokens whose experts the trainer's router would have chosen otherwise.

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
from maxtrain.data import prompts as prompts_lib
from maxtrain.models import sampling
from maxtrain.training import (advantages as advantages_lib, environments, episodes, loop, losses,
                               policy_losses, rewards)
from maxtrain.training.rollout import (engine as rollout_engine, multihost, position as rollout_position,
                                       schedule as rollout_schedule)
from maxtrain.training.advantages import ADVANTAGE_EPS, advantages  # noqa: F401 (grpo.advantages: today's GRPO)

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
    if config.grpo_rollout_workers > 0:  # the engine installed and able to serve the model, before Ray starts workers
        rollout_engine.check(config)
    named = ", ".join(functions) or "the environment's"
    log(f"GRPO: {prompts_lib.per_step(config)} prompts x {config.num_generations} completions of at most "
        f"{completion_length(config)} tokens per step; rewards {named}; beta {config.grpo_beta:g}, "
        f"epsilon {config.grpo_epsilon:g}; sampling {describe_sampling(config)}")
    if policy_losses.sequence_level_note(config):
        log(policy_losses.sequence_level_note(config))
    if config.grpo_rollout_workers > 0:  # batches go out before their updates: the checkpoint's position says which
        inputs = dataclasses.replace(inputs, train_iterator=rollout_position.Position(inputs.train_iterator))
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


def assemble(prompt_ids: list, tokens: np.ndarray, log_probs: np.ndarray, kept: np.ndarray, adv: np.ndarray,
             length: int, shape: tuple[int, int], routing: list | None = None,
             model: np.ndarray | None = None) -> dict:
    """The update's batch [A, b, T]: each row prompt + its kept completion, loss weight 1 on the completion
    (with `model` [N, C]: that weight on each completion token, 0 on an environment's observations).
    routing (routing replay): per row the experts the sampler chose [slots from the prompt's first, L_moe, K],
    which become `routed_experts` [A, b, T, L_moe, K] aligned with `inputs`."""
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
    if routing is not None:
        batch["routed_experts"] = np.zeros((n, length) + routing[0].shape[1:], np.int32)
        for i in range(n):
            m = len(prompt_ids[i]) + int(kept[i]) - 1
            batch["routed_experts"][i, :m] = routing[i][:m]
    return {k: v.reshape(shape + v.shape[1:]) for k, v in batch.items()}


def mask_truncated(batch: dict, stopped: np.ndarray) -> dict:
    """TRL's mask_truncated_completions: the rows [A, b, T] of completions that were cut by the length limit without
    a stop token (`stopped` [A x b] false) get loss weight 0."""
    weights = batch["loss_weights"] * stopped.reshape(batch["loss_weights"].shape[:-1] + (1,))
    return {**batch, "loss_weights": weights.astype(np.float32)}


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


@dataclasses.dataclass
class Draw:
    """One prompt batch's completions on the host, scored: what the rollout keeps of each draw (whole groups)."""
    prompt_ids: list                  # each completion's prompt ids (unpadded) [N]
    tokens: np.ndarray                # [N, C]
    log_probs: np.ndarray             # the sampler's log pi(token) [N, C]
    kept: np.ndarray                  # tokens kept, the stop token included [N]
    stopped: np.ndarray               # [N] bool (multi-turn: the episode ended before its budget)
    total: np.ndarray                 # the summed (and shaped) reward [N]
    parts: dict                       # reward name -> [N]
    routing: list | None = None       # routing replay: each row's experts [slots, L_moe, K] (assemble)
    model: np.ndarray | None = None   # multi-turn: 1 on the model's tokens, 0 on the environment's [N, C]
    extra: dict = dataclasses.field(default_factory=dict)  # multi-turn: per-row figures for the metrics [N]

    def groups(self, keep: np.ndarray, group: int) -> "Draw":
        """The completions of the groups where `keep` [N / group] is true."""
        return _select(self, np.repeat(keep, group))


def _select(draw: Draw, rows: np.ndarray) -> Draw:
    def part(value):
        if value is None:
            return None
        if isinstance(value, dict):
            return {n: v[rows] for n, v in value.items()}
        if isinstance(value, list):
            return [v for v, k in zip(value, rows) if k]
        return value[rows]
    return Draw(**{f.name: part(getattr(draw, f.name)) for f in dataclasses.fields(Draw)})


def joined(draws: list) -> Draw:
    def part(values):
        if values[0] is None:
            return None
        if isinstance(values[0], dict):
            return {n: np.concatenate([v[n] for v in values]) for n in values[0]}
        if isinstance(values[0], list):
            return [x for v in values for x in v]
        return np.concatenate(values)
    return Draw(**{f.name: part([getattr(d, f.name) for d in draws]) for f in dataclasses.fields(Draw)})


def steps_per_rollout(config) -> int:
    """Optimizer steps on one rollout batch: its mini-batches, each updated on grpo_num_iterations times."""
    return config.grpo_steps_per_generation * config.grpo_num_iterations


class Step:
    """One GRPO step (see the module's docstring); loop.train calls it with `batches()`'s prompt batches."""

    def __init__(self, run, train_step, inputs: Inputs):
        self.run, self.train_step, self.inputs = run, train_step, inputs
        config = run.config
        self.group = config.num_generations
        self.iterator = inputs.train_iterator
        self.pending: list = []       # the rollout batch's update batches still to train on, in order
        self.host: dict = {}          # its rollout's metrics
        record = {"record_routing": True} if config.grpo_routing_replay else {}  # else the program it always was
        self.sample = jax.jit(lambda params, prompt, first, key: sampling.sample_completions(
            params, prompt, first, key, model=run.model, rt=run.rt, max_new_tokens=completion_length(config),
            **sampling.sampling_settings(config), **record))
        temperature = sampling.sampling_settings(config)["temperature"]
        self.log_probs = jax.jit(lambda params, batch: losses.target_log_probs(params, batch, run.model, run.rt,
                                                                              temperature)[0])
        self.episodes = episodes.Episodes(config, inputs.prompts, inputs.environment) if inputs.environment else None
        self.rollouts = None          # grpo_rollout_workers > 0: sampled by Ray workers (training/rollout/)
        if config.grpo_rollout_workers > 0:
            self.rollouts = rollout_schedule.Rollouts(config, self.iterator, inputs.prompts.stop_ids, rollout_key)
            self.iterator = self.rollouts.iterator  # several trainer processes: every host's prompt rows

    def batches(self):
        """The prompt batches loop.train hands each step: the train iterator's next at a rollout batch's first
        step, None on the steps that train on its later mini-batches and iterations."""
        while True:
            yield None if self.pending or self.rollouts is not None else next(self.iterator)  # workers: Rollouts'

    def draw(self, state, batch: dict, step: int, key) -> Draw:
        """The completions of one prompt batch, sampled with `key` and scored (overlong shaping added)."""
        if self.episodes is not None:  # grpo_environment: multi-turn episodes
            return self.multi_turn(state, batch, step, key)
        config, g = self.run.config, self.group
        prompt = np.repeat(batch["prompt"], g, axis=0)
        first = np.repeat(batch["first"], g, axis=0)
        if self.rollouts is not None:
            tokens, log_probs, routing = *self.rollouts.sample(prompt, first, key, step), None
        else:
            tokens, log_probs, *routing = jax.device_get(self.sample(self.run.model_params(state), prompt, first, key))
        routing = [r[f:] for r, f in zip(routing[0], first)] if routing else None  # rows from their first slot
        kept, stopped = cut(tokens, self.inputs.prompts.stop_ids)
        completions = decode(self.inputs.tokenizer, tokens, kept, stopped)
        texts = [t.decode() for t in np.repeat(batch["text"], g)]
        answers = [a.decode() for a in np.repeat(batch["answer"], g)]
        saved = (" (the checkpoints saved so far are kept; re-run the same command to resume from the latest)"
                 if config.enable_checkpointing else "")
        total, parts = rewards.score(self.inputs.functions, texts, completions, answers,
                                     context=f" at step {step + 1}{saved}")
        if config.grpo_overlong_buffer_length > 0:
            total = total + advantages_lib.overlong_penalty(kept, completion_length(config),
                                                            config.grpo_overlong_buffer_length,
                                                            config.grpo_overlong_penalty_factor)
        return Draw([row[f:] for row, f in zip(prompt, first)], tokens, log_probs, kept, stopped, total, parts, routing)

    def multi_turn(self, state, batch: dict, step: int, key) -> Draw:
        """draw's completions for episodes with the environment (training/episodes.py): the model's turns and the
        environment's observations in one completion, the observations at loss weight 0."""
        config, g = self.run.config, self.group
        texts = [t.decode() for t in np.repeat(batch["text"], g)]
        answers = [a.decode() for a in np.repeat(batch["answer"], g)]
        saved = (" (the checkpoints saved so far are kept; re-run the same command to resume from the latest)"
                 if config.enable_checkpointing else "")
        played = self.episodes.play(self.sample, self.run.model_params(state), np.repeat(batch["prompt"], g, axis=0),
                                    np.repeat(batch["first"], g, axis=0), texts, answers, key,
                                    context=f" at step {step + 1}{saved}")
        total, parts = rewards.score(self.inputs.functions, texts, played.final, answers,
                                     context=f" at step {step + 1}{saved}")
        total = total + played.reward
        if config.grpo_overlong_buffer_length > 0:
            total = total + advantages_lib.overlong_penalty(played.kept, completion_length(config),
                                                            config.grpo_overlong_buffer_length,
                                                            config.grpo_overlong_penalty_factor)
        extra = {"environment_reward": played.reward, "turns": played.turns,
                 "model_tokens": played.model.sum(axis=1)}
        return Draw(played.prompt_ids, played.tokens, played.log_probs, played.kept, played.done, total, parts,
                    model=played.model, extra=extra)

    def rollout(self, state, batch: dict, step: int):
        """(update batches [A, b, T] on the host, one per mini-batch; host metrics) for a rollout batch: `batch`
        and, for more mini-batches or dynamic sampling, the prompt batches drawn after it."""
        config, g = self.run.config, self.group
        minis = config.grpo_steps_per_generation
        needed = minis * config.global_batch_size // g          # groups in the rollout batch
        draws, groups, drawn, all_equal = [], 0, 0, 0
        while groups < needed:
            if drawn > 0:
                limit = config.grpo_dynamic_sampling_max_batches if config.grpo_dynamic_sampling else minis
                if drawn >= limit:
                    raise loop.TrainingError(
                        f"grpo_dynamic_sampling: at step {step + 1}, {all_equal} of the {drawn * batch['prompt'].shape[0]}"
                        f" groups in {drawn} prompt batches had all-equal rewards, leaving {groups} of the {needed} "
                        f"groups a step needs (grpo_dynamic_sampling_max_batches={limit}); raise "
                        "grpo_dynamic_sampling_max_batches, sample more completions per prompt (num_generations), "
                        "or use prompts and rewards whose completions score apart")
                batch = next(self.iterator)
            key = rollout_key(config, step) if drawn == 0 else jax.random.fold_in(rollout_key(config, step), drawn)
            draw = self.draw(state, batch, step, key)
            drawn += 1
            if config.grpo_dynamic_sampling:
                varied = advantages_lib.varied_groups(draw.total, g)
                all_equal += int((~varied).sum())
                varied &= np.cumsum(varied) <= needed - groups  # the groups past a full batch are not needed
                draw = draw.groups(varied, g)
            draws.append(draw)
            groups += len(draw.kept) // g
        done = draws[0] if len(draws) == 1 else joined(draws)
        adv = advantages_lib.advantages(done.total, g, config.grpo_advantage_estimator, config.grpo_scale_rewards,
                                        config.grpo_reward_std_ddof)
        a, b = config.gradient_accumulation_steps, config.micro_batch_size
        update = assemble(done.prompt_ids, done.tokens, done.log_probs, done.kept, adv, config.max_target_length,
                          (minis * a, b), done.routing, done.model)
        if config.grpo_mask_truncated_completions:
            update = mask_truncated(update, done.stopped)
        updates = [{k: v[i * a:(i + 1) * a] for k, v in update.items()} for i in range(minis)]
        total = done.total
        host = {"aux/grpo_reward": float(total.mean()),
                "aux/grpo_reward_std": float(total.reshape(-1, g).std(axis=1).mean()),
                "aux/grpo_completion_length": float(done.kept.mean()),
                "aux/grpo_stopped_fraction": float(done.stopped.mean())}
        if "exact_match" in done.parts:
            host["aux/grpo_accuracy"] = float(done.parts["exact_match"].mean())
        if done.extra:  # multi-turn episodes
            host["aux/grpo_environment_reward"] = float(done.extra["environment_reward"].mean())
            host["aux/grpo_turns"] = float(done.extra["turns"].mean())
            host["aux/grpo_multi_turn_fraction"] = float((done.extra["turns"] > 1).mean())
            host["aux/grpo_model_token_fraction"] = float(done.extra["model_tokens"].sum() / max(done.kept.sum(), 1))
        if config.grpo_dynamic_sampling:
            host["aux/grpo_groups_drawn"] = float(drawn * batch["prompt"].shape[0])
            host["aux/grpo_groups_dropped"] = float(drawn * batch["prompt"].shape[0] - needed)
        return updates, host

    def old_log_probs(self, state, updates: list) -> None:
        """pi_old of every mini-batch: the trainer's own log-probabilities under the weights that sampled them,
        computed once before the rollout batch's first update (the sampler's agree only to float rounding, and a
        ratio of 1 must be exact at that first update: tests/training/test_grpo_variants.py)."""
        params = self.run.model_params(state)
        for update in updates:
            for i in range(update["inputs"].shape[0]):
                micro = {k: update[k][i] for k in ("inputs", "targets", "positions", "segment_ids", "routed_experts")
                         if k in update}
                lp = np.asarray(multihost.fetch(self.log_probs(params, micro)), np.float32)
                update["old_log_probs"][i] = np.where(update["loss_weights"][i] > 0, lp, 0.0)

    def __call__(self, state, batch):
        started = time.perf_counter()
        step = int(jax.device_get(state["step"]))
        config = self.run.config
        if not self.pending:
            per_rollout = steps_per_rollout(config)
            if step % per_rollout:
                raise loop.TrainingError(
                    f"the run resumes at step {step}, inside a rollout batch of {per_rollout} steps "
                    f"(grpo_steps_per_generation={config.grpo_steps_per_generation} x grpo_num_iterations="
                    f"{config.grpo_num_iterations}), whose completions no checkpoint holds; resume from a checkpoint "
                    f"at a multiple of {per_rollout}, or with the settings that saved it")
            if self.rollouts is not None:
                batch = self.rollouts.begin(step, self.run.model_params(state))
            updates, self.host = self.rollout(state, batch, step)
            if self.rollouts is not None:
                self.host.update(self.rollouts.correct(updates, lambda: self.old_log_probs(state, updates)))
            elif per_rollout > 1:
                self.old_log_probs(state, updates)
            self.pending = [u for _ in range(config.grpo_num_iterations) for u in updates]
        else:
            started = None
        update = self.pending.pop(0)
        rolled = time.perf_counter()
        global_batch = multihost.to_global(update, self.run.mesh, config.logical_axis_rules)  # each host its rows
        state, metrics = self.train_step(state, global_batch)
        metrics = jax.block_until_ready(metrics)
        if self.rollouts is not None:
            self.rollouts.trained(step + 1)  # the checkpoint's data position: past this step's prompt batches
        host = dict(self.host)
        host["aux/grpo_rollout_seconds"] = 0.0 if started is None else rolled - started
        host["aux/grpo_update_seconds"] = time.perf_counter() - rolled
        if self.rollouts is not None and started is not None:
            host.update(self.rollouts.step_metrics())
        if self.rollouts is not None and step + 1 == config.steps:
            self.rollouts.close()  # the workers stopped (and a Ray this run started)
        return state, {**metrics, **host}



class AtRolloutEnds:
    """The run's Preemption, whose stop waits for the end of the rollout batch under way (its later mini-batches and
    iterations are in memory only, so a checkpoint is saved at rollout batches' ends: at most
    steps_per_rollout - 1 steps later)."""

    def __init__(self, preemption, per_rollout: int):
        self.preemption, self.per_rollout = preemption, per_rollout

    def reached(self, step: int) -> bool:
        return self.preemption.reached(step) and step % self.per_rollout == 0

    def close(self) -> None:
        self.preemption.close()


class HeldOut(loop.Evaluation):
    """Greedy answers to the held-out prompts: at step 0 of a fresh run, every eval_interval steps and at
    the end; eval/grpo_reward and (with exact_match) eval/grpo_accuracy."""

    def __init__(self, run, inputs: Inputs, writer, log):
        self.built, self.inputs, self.writer, self.log = run, inputs, writer, log
        self.config = config = run.config
        self.losses, self.metrics = {}, {}
        self.greedy = jax.jit(lambda params, prompt, first: sampling.sample_completions(
            params, prompt, first, jax.random.key(0), model=run.model, rt=run.rt,
            max_new_tokens=completion_length(config), temperature=0.0, top_k=0, top_p=1.0)[0])
        self.episodes = episodes.Episodes(config, inputs.prompts, inputs.environment) if inputs.environment else None
        self.greedy_turn = jax.jit(lambda params, prompt, first, key: sampling.sample_completions(
            params, prompt, first, key, model=run.model, rt=run.rt, max_new_tokens=completion_length(config),
            temperature=0.0, top_k=0, top_p=1.0))

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
                tokens = multihost.fetch(self.greedy(params, prompt, first))[:len(chunk)]
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

    def evaluate(self, done: int, state) -> None:
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
