"""deepseek_v4 decoding through maxtrain's shared decoder and cache (models/decoder.forward_with_cache, the family's
layer_cache and layer over deepseek_v4/cache.py): deepseek4-tiny (HCA every 16 tokens, CSA every 4 keeping 8, a
32-token window, a hash-routed first layer), a 7-token prompt (no multiple of 4 or 16) prefilled at once, then one
token a step to 48, past CSA boundaries 8..48, HCA's 16, 32 and 48 and the window's reach: the logits are the full
forward's at every position and greedy decoding (models/sampling.generate) picks its argmax at every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import load_config
from maxtrain.models import sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime

PROMPT, LENGTH = 7, 48


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _build(*overrides):
    cfg = load_config([BASE_YML, "model_name=deepseek4-tiny", f"max_target_length={LENGTH}", "dtype=float32",
                       "remat_policy=none", "per_device_batch_size=1", "max_new_tokens=8", *overrides])
    m, rt = Model.bind(cfg), Runtime.from_config(cfg)
    params = m.init_params(jax.random.key(0))
    full = jax.jit(lambda p, ids: m.forward(p, ids, jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape),
                                            jnp.ones_like(ids), rt)[0])
    return cfg, m, rt, params, full


@pytest.fixture(scope="module")
def tiny():
    return _build()


@pytest.fixture(scope="module")
def tiny3():
    """The slow tests' model: one layer of each kind (the preset's 4th is a second CSA), a quarter less to compile."""
    return _build("base_num_decoder_layers=3",
                  "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention,sliding_attention]")


def test_the_cache_holds_each_kinds_buffers_in_whole_windows(tiny):
    cfg, m, rt, _, _ = tiny
    cache = m.init_cache(2, 45, rt.dtype)          # 45 slots asked: 48, whole windows of 16 and 4
    assert {k: v.shape for k, v in cache.items()} == {
        "kv": (4, 2, 48, 32), "hca_kv": (1, 2, 48, 32), "hca_gate": (1, 2, 48, 32), "csa_kv": (2, 2, 48, 64),
        "csa_gate": (2, 2, 48, 64), "idx_kv": (2, 2, 48, 64), "idx_gate": (2, 2, 48, 64)}


def test_prefill_then_steps_give_the_full_forwards_logits(tiny):
    cfg, m, rt, params, full = tiny
    tokens = jnp.asarray(np.random.default_rng(5).integers(4, cfg.vocab_size, (2, LENGTH)), jnp.int32)
    step = jax.jit(lambda p, t, pos, c, i: m.forward_with_cache(p, t, pos, c, i, rt))
    cache, pieces, index = m.init_cache(2, LENGTH, rt.dtype), [], 0
    for length in (PROMPT,) + (1,) * (LENGTH - PROMPT):
        positions = jnp.broadcast_to(jnp.arange(index, index + length), (2, length))
        logits, cache = step(params, tokens[:, index:index + length], positions, cache, index)
        pieces.append(logits)
        index += length
    want = full(params, tokens)
    got = np.concatenate(pieces, axis=1)
    print(f"deepseek_v4 cached decode vs full forward: relative logits difference {rel(got, want):.2e}")
    assert rel(got, want) < 1e-5
    # the control: the next step with the prompt's compressor buffers emptied (the window's keys kept) differs:
    # the entry the prompt closed (CSA's first, slots 0-3) is pooled from them
    cache = m.init_cache(2, LENGTH, rt.dtype)
    _, cache = step(params, tokens[:, :PROMPT], jnp.broadcast_to(jnp.arange(PROMPT), (2, PROMPT)), cache, 0)
    blank = {k: (v if k == "kv" else jnp.zeros_like(v)) for k, v in cache.items()}
    logits, _ = step(params, tokens[:, PROMPT:PROMPT + 1], jnp.full((2, 1), PROMPT), blank, PROMPT)
    assert rel(logits[:, 0], want[:, PROMPT]) > 1e-3


@pytest.mark.slow  # ~30 s on 2 shared cores (2026-12-02): the whole generate loop compiles
def test_greedy_decoding_picks_the_full_forwards_argmax(tiny3):
    cfg, m, rt, params, full = tiny3
    prompt = [int(t) for t in np.random.default_rng(6).integers(4, cfg.vocab_size, PROMPT)]
    new = sampling.generate(params, prompt, m, rt, max_new_tokens=LENGTH - PROMPT)
    assert len(new) == LENGTH - PROMPT
    logits = full(params, jnp.asarray([prompt + new], jnp.int32))[0]
    assert new == np.asarray(jnp.argmax(logits[PROMPT - 1:-1], axis=-1)).tolist()


@pytest.mark.slow  # ~30 s on 2 shared cores (2026-12-02)
def test_a_left_padded_row_gives_its_unpadded_logits(tiny3):
    """Row 1 holds 5 slots of garbage, then tokens[1, :43] (first = 5): its windows are pooled from slot 5 on, its
    window never reads the padding, and its logits are the unpadded full forward's; row 0 (first = 0) is unchanged.
    The control: the same row read from slot 0 (first = 0) differs."""
    cfg, m, rt, params, full = tiny3
    tokens = jnp.asarray(np.random.default_rng(7).integers(4, cfg.vocab_size, (2, LENGTH)), jnp.int32)
    padded = tokens.at[1, 5:].set(tokens[1, :LENGTH - 5])
    step = jax.jit(lambda p, t, pos, c, i, first: m.forward_with_cache(p, t, pos, c, i, rt, first))

    def run(first):
        cache, pieces = m.init_cache(2, LENGTH, rt.dtype), []
        for index, length in ((0, 13), (13, 1), (14, 1), (15, 1), (16, 16), (32, 16)):
            slots = jnp.arange(index, index + length)[None, :]
            logits, cache = step(params, padded[:, index:index + length], jnp.maximum(slots - first[:, None], 0),
                                 cache, index, first)
            pieces.append(logits)
        return np.concatenate(pieces, axis=1)

    want = np.asarray(full(params, tokens))
    got = run(jnp.asarray([0, 5]))
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1, 5:], want[1, :LENGTH - 5]) < 1e-5
    assert rel(run(jnp.asarray([0, 0]))[1, 5:], want[1, :LENGTH - 5]) > 1e-3
