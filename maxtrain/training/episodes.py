"""GRPO's multi-turn rollouts: episodes of the policy with an environment (grpo_environment), one row each.

    played = episodes.Episodes(config, prompts, source).play(sample, params, prompt, first, texts, answers, key)

An episode (environments.py has the environment's contract) starts from the record's prompt, or from
what the environment's reset returned. Then, turn by turn:

1. The model samples its turn (the sampler of single-turn GRPO, models/sampling.sample_completions with
   the KV cache; the whole context so far is prefilled again each turn) until its first stop token or
   the episode's remaining token budget; the stop token is kept, as single-turn GRPO keeps it.
2. The environment's step gets the turn's text (cut before the stop token) and answers (observation,
   reward, done).
3. Unless the episode ends, the observation is appended as the chat template renders a "tool" message
   after the assistant's turn, with the template's generation prompt for the next assistant turn
   (chatml: `\\n<|im_start|>tool\\n<result>46</result><|im_end|>\\n<|im_start|>assistant\\n`).

The episode ends when step says done, after grpo_max_turns model turns (-1: no limit but the
tokens), when a turn runs to the budget without a stop token, or when an observation leaves no room for
another model token. Every model turn is stepped, the last one too, so its reward counts; an observation
that is not followed by a model turn is dropped.

Budget. The episode (the model's turns and the observations) gets the tokens a single-turn completion
gets, max_target_length - max_prefill_predict_length, as TRL's max_completion_length bounds a
multi-turn completion tool results included: the update's row stays prompt + episode in
max_target_length tokens. An observation longer than that whole budget is the environment's mistake
(`BadEnvironment`); one that overflows what remains of it ends the episode there (TRL drops tool results
that would overflow too). A prompt that reset returns must fit max_prefill_predict_length.

The update. Each episode is one row, prompt + episode, as single-turn GRPO's: the model's tokens carry
loss weight 1 and their sampler log-probabilities as pi_old; the observations' tokens carry weight 0
(and log-probability 0, never read): they are context, not actions (TRL's tool_mask). The episode's
reward is the sum of what step returned, plus the configured reward functions (grpo_reward_functions,
[] allowed with an environment) scored on the episode's last model message.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from maxtrain.data import chat
from maxtrain.data.errors import DataError
from maxtrain.training import environments

ROLE = "tool"  # the role of the environment's messages (TRL appends tool results as role "tool")
MARKER = "\x1fMODEL\x1f"
OBSERVATION = "\x1fOBSERVATION\x1f"


@dataclasses.dataclass
class Played:
    """N episodes; the token arrays hold each episode's tokens after its prompt, padded to the budget E."""
    prompt_ids: list          # int32 [n_i] each episode's prompt
    tokens: np.ndarray        # int32 [N, E] model turns and observations
    log_probs: np.ndarray     # float32 [N, E] the sampler's log p of each model token; 0 on observations
    model: np.ndarray         # float32 [N, E] 1 on the model's tokens, 0 on the environment's (and padding)
    kept: np.ndarray          # int32 [N] the episode's tokens
    final: list               # str: each episode's last model message, cut before its stop token
    reward: np.ndarray        # float32 [N] the environment's rewards, summed over the episode
    turns: np.ndarray         # int32 [N] model turns
    done: np.ndarray          # bool [N] whether the environment ended it (not a budget)


class Renderer:
    """The tokens of an observation after a model turn, and of a prompt reset returned, under the template."""

    def __init__(self, template: chat.Template):
        self.template, self.tok = template, template.tokenizer
        history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARKER}]
        try:
            through = template.render(history)
            after = template.render(history + [{"role": ROLE, "content": OBSERVATION}], add_generation_prompt=True)
        except DataError as e:
            raise DataError(f"grpo_environment: the chat template {template.describe()} cannot render the "
                            f"environment's observations as {ROLE!r} messages ({e}); use a template that has a "
                            f"{ROLE} role (chat_template=chatml)") from None
        if MARKER not in through or not after.startswith(through) or OBSERVATION not in after[len(through):]:
            raise DataError(f"grpo_environment: the chat template {template.describe()} does not render a {ROLE!r} "
                            "message after an assistant turn as text appended to it, so the observations' tokens "
                            "cannot be told from the model's; use chat_template=chatml (or llama3)")
        self.tail = through[through.index(MARKER) + len(MARKER):]  # what the template writes after a reply
        self.before, self.after = after[len(through):].split(OBSERVATION, 1)

    def observation(self, text: str, stop: int | None) -> np.ndarray:
        """Tokens after a model turn that ended with token `stop` (None: it did not stop) up to the next turn,
        cut as chat.parts cuts a conversation (so as SFT's data has them): what the template writes after the
        reply's stop token (chatml: "\\n") tokenized with that stop token, then the observation's message and the
        generation prompt as one part."""
        said = self.tok.decode([stop]) if stop is not None else ""
        rest = self.tail[len(said):] if said and self.tail.startswith(said) else self.tail
        ids = []
        if rest and rest != self.tail:  # the model wrote the end of its turn: the rest as the reply's part has it
            whole, alone = self.tok.encode(said + rest), self.tok.encode(said)
            ids = whole[len(alone):] if whole[:len(alone)] == alone else self.tok.encode(rest)
        elif rest:
            ids = self.tok.encode(rest)
        return np.asarray(list(ids) + list(self.tok.encode(self.before + text + self.after)), np.int32)

    def prompt(self, messages: list[dict]) -> np.ndarray:
        return chat.encode_parts(self.template, [(self.template.render(messages, add_generation_prompt=True),
                                                  False)])[0]


def budget(config) -> int:
    """The episode's tokens: a single-turn completion's."""
    return config.max_target_length - config.max_prefill_predict_length


class Episodes:
    """Plays the episodes of a step (the module's docstring)."""

    def __init__(self, config, prompts, source: environments.Source):
        self.config, self.source, self.stops = config, source, tuple(prompts.stop_ids)
        self.renderer = Renderer(prompts.template)
        self.tok = prompts.tokenizer

    def observation(self, text: str, stop: int | None, message: str, context: str) -> np.ndarray:
        ids = self.renderer.observation(text, stop)
        if len(ids) > budget(self.config):
            raise environments.BadEnvironment(
                f"{self.source.where()} step returned an observation of {len(ids)} tokens ({environments.short(text)}) "
                f"for the message {environments.short(message)}{context}, more than an episode's whole budget of "
                f"{budget(self.config)} tokens (max_target_length - max_prefill_predict_length); make the "
                "environment's observations shorter, or raise max_target_length")
        return ids

    def start(self, texts: list, answers: list, context: str) -> tuple[list, list]:
        """(one environment per episode, reset; the prompts reset returned, None where it returned None)."""
        envs, prompts = [], []
        length = self.config.max_prefill_predict_length
        for text, answer in zip(texts, answers):
            env = environments.new(self.source, context)
            messages = environments.reset(self.source, env, {"prompt": text, "answer": answer}, context)
            ids = None
            if messages is not None:
                ids = self.renderer.prompt(messages)
                if len(ids) > length:
                    raise environments.BadEnvironment(
                        f"{self.source.where()} reset returned a prompt of {len(ids)} tokens"
                        f"{context}, more than max_prefill_predict_length={length}; return a shorter one, or raise "
                        "max_prefill_predict_length (and max_target_length with it)")
            envs.append(env)
            prompts.append(ids)
        return envs, prompts

    def play(self, sample, params, prompt: np.ndarray, first: np.ndarray, texts: list, answers: list, key,
             context: str = "") -> Played:
        """The episodes of N prompts (left-padded [N, P] with their first slots) by the jitted
        sample(params, ids [N, W], first [N], key) -> (tokens [N, E], log-probs [N, E])."""
        config, n = self.config, len(texts)
        e, width = budget(config), config.max_target_length
        envs, reset_prompts = self.start(texts, answers, context)
        prompt_ids = [own if own is not None else row[f:] for own, row, f in zip(reset_prompts, prompt, first)]
        episode = [[] for _ in range(n)]                    # (token, log p, model?) per episode
        final, reward = [""] * n, np.zeros(n, np.float64)
        turns, done = np.zeros(n, np.int32), np.zeros(n, bool)
        active = np.ones(n, bool)
        turn = 0
        while active.any() and (config.grpo_max_turns < 0 or turn < config.grpo_max_turns):
            ids, firsts = np.zeros((n, width), np.int32), np.full(n, width - 1, np.int32)
            for i in np.flatnonzero(active):
                seq = np.concatenate([prompt_ids[i], np.asarray([t for t, _, _ in episode[i]], np.int32)])
                ids[i, width - len(seq):], firsts[i] = seq, width - len(seq)
            tokens, log_probs = jax.device_get(sample(params, ids, firsts, jax.random.fold_in(key, turn)))
            last_turn = config.grpo_max_turns >= 0 and turn + 1 >= config.grpo_max_turns
            for i in np.flatnonzero(active):
                room = e - len(episode[i])
                row = tokens[i, :room]
                stop_at = np.flatnonzero(np.isin(row, self.stops))
                stopped = stop_at.size > 0
                kept = int(stop_at[0]) + 1 if stopped else room
                episode[i] += [(int(t), float(lp), 1.0) for t, lp in zip(row[:kept], log_probs[i, :kept])]
                message = self.tok.decode([int(t) for t in row[:kept - int(stopped)]])
                final[i], turns[i] = message, turns[i] + 1
                at = f"{context} (turn {turns[i]} of an episode)"
                observation, r, ended = environments.step(self.source, envs[i], message, at)
                reward[i] += r
                if ended or not stopped or last_turn:
                    active[i], done[i] = False, ended
                    continue
                obs = self.observation(observation, int(row[kept - 1]), message, at)
                if len(episode[i]) + len(obs) >= e:  # no room left for a model token: the episode ends here
                    active[i] = False
                    continue
                episode[i] += [(int(t), 0.0, 0.0) for t in obs]
            turn += 1
        out = {k: np.zeros((n, e), dtype) for k, dtype in (("tokens", np.int32), ("log_probs", np.float32),
                                                            ("model", np.float32))}
        for i, steps in enumerate(episode):
            if steps:
                t, lp, m = zip(*steps)
                out["tokens"][i, :len(t)], out["log_probs"][i, :len(t)], out["model"][i, :len(t)] = t, lp, m
        kept = np.asarray([len(s) for s in episode], np.int32)
        return Played(prompt_ids, out["tokens"], out["log_probs"], out["model"], kept, final,
                      reward.astype(np.float32), turns, done)


def check(config, prompts, source: environments.Source, records: list) -> None:
    """Before compiling: for the first record of every training file, an environment made, reset, and stepped
    once with the record's answer as the model's message; what each returns is checked (environments.py),
    and the observation against the budget."""
    played = Episodes(config, prompts, source)
    context = " (the first record of a training file, before compiling)"
    envs, _ = played.start([r.text for r in records], [r.answer for r in records], context)
    for env, record in zip(envs, records):
        observation, _, ended = environments.step(source, env, record.answer, context)
        if not ended:
            played.observation(observation, prompts.stop_ids[-1] if prompts.stop_ids else None, record.answer,
                               context)
