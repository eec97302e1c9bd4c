"""The rollout engine's contract: what a rollout worker asks an engine for, and what it gets back.

    engine = make(config, stop_ids)                  # grpo_rollout_engine's (jax | vllm)
    engine.set_weights(version, params)              # maxtrain's nested param dict of host numpy arrays
    completions = engine.generate([Request(id, prompt_ids, max_new_tokens, seed), ...])
    engine.close()

An engine converts maxtrain's params to its own layout inside set_weights (vLLM through checkpointing/convert.to_hf
by Hugging Face names, in memory). Its completions depend on (seed, request) only: the same requests with the same
seeds under the same weights give the same tokens (the JAX engine samples the requests that share a seed as one
batch, in their order, so that a prompt batch's rows come out as grpo.Step's colocated sampler draws them).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Protocol

import numpy as np

ENGINES = {"jax": "maxtrain.training.rollout.jax_engine",     # grpo_rollout_engine -> the module whose make() builds it
           "vllm": "maxtrain.training.rollout.vllm_engine"}


@dataclasses.dataclass(frozen=True)
class Request:
    id: int                    # the caller's; a Completion answers it by the same id
    prompt_ids: np.ndarray     # int32 [P]: the prompt (and, resuming a partial rollout, the tokens so far)
    max_new_tokens: int
    seed: int                  # the sampling seed (the JAX engine: a packed PRNG key, jax_engine.seed_of)


@dataclasses.dataclass
class Completion:
    id: int
    tokens: np.ndarray         # int32 [n <= max_new_tokens], cut after the stop token (which is kept)
    log_probs: np.ndarray      # float32 [n]: the engine's log p of each token at the sampling temperature
    versions: np.ndarray       # int32 [n]: the weight version that produced each token
    stopped: bool              # ended on a stop token (else cut by max_new_tokens)


class Engine(Protocol):
    name: str

    def set_weights(self, version: int, params: dict) -> None: ...

    def generate(self, requests: list[Request]) -> list[Completion]: ...

    def close(self) -> None: ...


def check(config) -> None:
    """Refuses (one line with the fix) what grpo_rollout_engine's engine cannot do for this run: the engine not
    installed, a model family it cannot serve. Called in the trainer before any work (grpo.with_rewards), not left
    to the workers, each of which would fail on its own after Ray started it."""
    importlib.import_module(ENGINES[config.grpo_rollout_engine]).check_config(config)


def make(config, stop_ids) -> Engine:
    """grpo_rollout_engine's engine for `config` (the trainer's, its devices' values in), cutting at `stop_ids`."""
    return importlib.import_module(ENGINES[config.grpo_rollout_engine]).make(config, stop_ids)


def cut(tokens: np.ndarray, stops) -> tuple[int, bool]:
    """(tokens kept, the stop included; whether it stopped) of one row of tokens."""
    hits = np.flatnonzero(np.isin(tokens, np.asarray(list(stops), np.int64)))
    return (int(hits[0]) + 1, True) if len(hits) else (len(tokens), False)
