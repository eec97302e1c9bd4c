"""Sampling from a model with its KV cache: greedy, temperature, top-k and top-p (nucleus).

    new_ids = sampling.generate(params, prompt_ids, model, rt, max_new_tokens=48, eos_id=tokenizer.eos_ids)

`generate_tokens` is the jitted loop on a batch of prompts [B, P]: one forward over the prompt fills
the cache, then one token per step (`sample_token`). `sample_completions` does the same for prompts
of different lengths (left-padded) and returns each sampled token's log-probability (GRPO's rollouts). decode_sampling_strategy picks the sampler
(greedy | weighted | topk | nucleus, as in MaxText; `sampling_settings`).
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp

from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime


def sample_token(logits, key, *, temperature: float, top_k: int, top_p: float):
    """Next token [B] from logits [B, V]; temperature 0 is greedy.

    Otherwise the logits are divided by `temperature`, then (top_k > 0) all but the k largest are
    dropped, then (top_p < 1) all but the fewest largest whose probabilities sum to >= top_p, and a
    token is drawn from the softmax of what is left.
    """
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # The smallest set of tokens whose probability reaches top_p (always at least one): the
        # cut-off is the first sorted token at which the running sum reaches top_p.
        cutoff_index = jnp.minimum(jnp.sum(cumulative < top_p, axis=-1, keepdims=True), logits.shape[-1] - 1)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sampling_settings(config) -> dict:
    """(temperature, top_k, top_p) for generate() from the decode_sampling_* keys."""
    strategy, temperature = config.decode_sampling_strategy, config.decode_sampling_temperature
    if strategy == "greedy":
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    if strategy == "weighted":
        return {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    if strategy == "topk":
        return {"temperature": temperature, "top_k": config.decode_sampling_top_k, "top_p": 1.0}
    return {"temperature": temperature, "top_k": 0, "top_p": config.decode_sampling_nucleus_p}


@functools.partial(jax.jit, static_argnames=("model", "rt", "max_new_tokens", "temperature", "top_k", "top_p"))
def generate_tokens(params, prompt, key, *, model, rt, max_new_tokens, temperature, top_k, top_p, images=None,
                    positions=None):
    """New tokens [B, max_new_tokens] after prompts [B, P] (every row as long; no end-of-sequence stop). With
    images (the prompt's image inputs, contract.Vision.inputs) the tower runs once, in the prefill, at
    `positions` (M-RoPE's [3, B, P]); the tokens after it take the prompt's largest position + 1 on, in every
    stream (transformers' rope_deltas)."""
    batch, prompt_len = prompt.shape
    if max_new_tokens == 0:  # the loop's body would index an empty array
        return jnp.zeros((batch, 0), jnp.int32)
    cache = model.init_cache(batch, prompt_len + max_new_tokens, rt.dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(prompt_len), prompt.shape)
    logits, cache = model.forward_with_cache(params, prompt, positions, cache, 0, rt, images=images)
    after = jnp.max(positions.reshape(-1, batch, prompt_len), axis=(0, 2)) + 1  # [B]: the first new token's

    def step(i, carry):
        cache, last_logits, out, key = carry
        key, sub = jax.random.split(key)
        token = sample_token(last_logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
        out = out.at[:, i].set(token)
        logits, cache = model.forward_with_cache(params, token[:, None], (after + i)[:, None], cache, prompt_len + i,
                                                 rt)
        return cache, logits[:, -1], out, key

    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    _, _, out, _ = jax.lax.fori_loop(0, max_new_tokens, step, (cache, logits[:, -1], out, key))
    return out


@functools.partial(jax.jit, static_argnames=("model", "rt", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "record_routing"))
def sample_completions(params, prompt, first, key, *, model, rt, max_new_tokens, temperature, top_k, top_p,
                       record_routing=False):
    """Completions of left-padded prompts: prompt [B, P] holds row b's prompt in slots [first[b], P).

    Returns (tokens [B, max_new_tokens], log-probabilities [B, max_new_tokens] float32 of each sampled
    token under the distribution it was drawn from, softmax(logits / temperature) (softmax(logits) when
    greedy; before any top-k / top-p cut, as TRL scores them): what GRPO's training forward pass
    recomputes, objectives.target_log_probs at the same temperature). No end-of-sequence stop: the
    caller cuts each row at its first stop token.

    With record_routing (a mixture of experts; GRPO's routing replay) a third output: the experts each MoE
    layer chose for every slot, routing [B, P + max_new_tokens, L_moe, K] int32 (the prompt's slots from
    the prefill, slot P + i from the step that fed completion token i), so that the training row of
    prompt + completion, starting at slot first[b], reads its tokens' experts from routing[b, first[b]:].
    """
    scale = 1.0 / temperature if temperature > 0 else 1.0
    batch, prompt_len = prompt.shape
    if max_new_tokens == 0:  # the loop's body would index an empty array
        empty = jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0), jnp.float32)
        if record_routing:
            return *empty, jnp.zeros((batch, prompt_len, model.num_moe_layers, model.config.num_experts_per_tok),
                                     jnp.int32)
        return empty

    def run(tokens, positions, cache, index):  # (logits, cache, the chosen experts or None)
        if record_routing:
            return model.forward_with_cache(params, tokens, positions, cache, index, rt, first, record_routing=True)
        return (*model.forward_with_cache(params, tokens, positions, cache, index, rt, first), None)

    cache = model.init_cache(batch, prompt_len + max_new_tokens, rt.dtype)
    positions = jnp.maximum(jnp.arange(prompt_len)[None, :] - first[:, None], 0)
    logits, cache, routing = run(prompt, positions, cache, 0)
    if record_routing:
        routing = jnp.pad(routing, ((0, 0), (0, max_new_tokens), (0, 0), (0, 0)))
    rows = jnp.arange(batch)

    def step(i, carry):
        cache, last_logits, out, log_probs, key, routing = carry
        key, sub = jax.random.split(key)
        token = sample_token(last_logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
        log_p = jax.nn.log_softmax(last_logits.astype(jnp.float32) * scale, axis=-1)[rows, token]
        out, log_probs = out.at[:, i].set(token), log_probs.at[:, i].set(log_p)
        slot = prompt_len + i
        logits, cache, chosen = run(token[:, None], (slot - first)[:, None], cache, slot)
        if record_routing:
            routing = jax.lax.dynamic_update_slice_in_dim(routing, chosen, slot, axis=1)
        return cache, logits[:, -1], out, log_probs, key, routing

    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    log_probs = jnp.zeros((batch, max_new_tokens), jnp.float32)
    _, _, out, log_probs, _, routing = jax.lax.fori_loop(0, max_new_tokens, step,
                                                         (cache, logits[:, -1], out, log_probs, key, routing))
    return (out, log_probs, routing) if record_routing else (out, log_probs)


def generate(params, prompt_ids: list[int], model: Model, rt: Runtime, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | Iterable[int] | None = None, images=None, positions=None) -> list[int]:
    """Continues `prompt_ids`; returns the new tokens, cut before the first end-of-sequence id when eos_id
    (one id, or several: a tokenizer's eos_ids) is given. images and positions ([3, 1, P] for M-RoPE, else [1, P]): a
    prompt with images (its placeholders expanded), as contract.Vision.inputs makes them."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token (a BOS at least) to start from")
    if max_new_tokens < 1:
        return []
    prompt = jnp.asarray([prompt_ids], jnp.int32)
    out = generate_tokens(params, prompt, jax.random.key(seed), model=model, rt=rt,
                          max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          images=images, positions=None if positions is None else jnp.asarray(positions, jnp.int32))
    tokens = [int(t) for t in jax.device_get(out)[0]]
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stops), tokens)


def trim_sample(text: str, max_blank_lines: int = 2) -> str:
    """A sample up to where it ends: before the first run of more than `max_blank_lines` blank
    lines (an undertrained model fills its remaining tokens with newlines), without trailing
    whitespace. Two blank lines are kept: Python separates top-level definitions with them."""
    lines = text.split("\n")
    blank = 0
    for i, line in enumerate(lines):
        blank = blank + 1 if not line.strip() else 0
        if blank > max_blank_lines:
            return "\n".join(lines[:i - blank + 1]).rstrip()
    return text.rstrip()
