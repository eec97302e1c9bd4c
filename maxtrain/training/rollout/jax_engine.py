"""maxtrain's own sampler behind the Engine contract (rollout/engine.py): the program grpo.Step samples with when
colocated (models/sampling.sample_completions, the decode_sampling_* settings), on this process's devices, laid out
as the trainer lays out its params.

A request's seed is a packed PRNG key (`seed_of`); the requests that share one are sampled as one batch, in their
order, left-padded to max_prefill_predict_length (or their longest), with that key: a prompt batch's G x B/G rows,
sent with the step's rollout key, come out bitwise as the colocated sampler draws them.
"""

from __future__ import annotations

import jax
import numpy as np

from maxtrain.models import sampling
from maxtrain.training import builder
from maxtrain.training.rollout.engine import Completion, Request, cut


def seed_of(key) -> int:
    """A PRNG key (threefry: two uint32) packed into one int, a Request's seed."""
    data = np.asarray(jax.random.key_data(key), np.uint32).reshape(-1)
    if data.shape != (2,):
        raise ValueError(f"the JAX engine packs two-word PRNG keys (threefry), not keys of {data.shape[0]} words")
    return (int(data[0]) << 32) | int(data[1])


def key_of(seed: int):
    return jax.random.wrap_key_data(np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


class JaxEngine:
    name = "jax"

    def __init__(self, config, stop_ids):
        self.config, self.stops = config, tuple(stop_ids)
        run = builder.build(config)  # the trainer's mesh, model, runtime and param shardings on this process's devices
        self.model, self.rt, self.shardings = run.model, run.rt, run.shardings["params"]
        self.settings = sampling.sampling_settings(config)
        self.programs: dict = {}
        self.params, self.version = None, -1

    def program(self, new_tokens: int):
        if new_tokens not in self.programs:  # as grpo.Step's own (the same jitted function of the same constants)
            model, rt, settings = self.model, self.rt, self.settings
            self.programs[new_tokens] = jax.jit(lambda params, prompt, first, key: sampling.sample_completions(
                params, prompt, first, key, model=model, rt=rt, max_new_tokens=new_tokens, **settings))
        return self.programs[new_tokens]

    def set_weights(self, version: int, params: dict) -> None:
        self.params, self.version = jax.device_put(params, self.shardings), version

    def generate(self, requests: list[Request]) -> list[Completion]:
        if self.params is None:
            raise RuntimeError("the JAX engine was asked to generate before any set_weights")
        groups: dict = {}
        for r in requests:
            groups.setdefault((r.seed, r.max_new_tokens), []).append(r)
        out = {}
        for (seed, new_tokens), group in groups.items():
            width = max(self.config.max_prefill_predict_length, max(len(r.prompt_ids) for r in group))
            prompt = np.zeros((len(group), width), np.int32)
            first = np.zeros(len(group), np.int32)
            for i, r in enumerate(group):
                first[i] = width - len(r.prompt_ids)
                prompt[i, first[i]:] = r.prompt_ids
            tokens, log_probs = jax.device_get(self.program(new_tokens)(self.params, prompt, first, key_of(seed)))
            for i, r in enumerate(group):
                n, stopped = cut(tokens[i], self.stops)
                out[r.id] = Completion(r.id, tokens[i, :n].astype(np.int32), log_probs[i, :n].astype(np.float32),
                                       np.full(n, self.version, np.int32), stopped)
        return [out[r.id] for r in requests]

    def close(self) -> None:
        self.params, self.programs = None, {}


def check_config(config) -> None:
    """Nothing to refuse: maxtrain's own sampler serves every family the trainer runs (engine.check's)."""
    del config


def make(config, stop_ids) -> JaxEngine:
    return JaxEngine(config, stop_ids)
