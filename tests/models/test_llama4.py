"""Llama 4's pieces on their own: chunked attention in every implementation, the topk_sigmoid router, decoding.

Chunked attention is computed by refining the segment ids (models/attention/); each implementation is
checked against the direct mask (same document, same chunk of positions, causal), forward and gradients,
on packed rows whose positions restart in each document. The router against a direct per-token sum of
expert(w x). Decoding a tiny llama4_text with the KV cache against its full forward pass (chunks, NoPE
layers with attention temperature). Parity with transformers: tests/models/test_families.py; each feature's
negative control: the slow test below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import load_config
from maxtrain.models import attention, layers, moe
from maxtrain.models.attention import kernel_check

CHUNK = 8


def packed_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 where the segment id changes (as maxtrain's packing makes them)."""
    out = np.zeros_like(segment_ids)
    for row in range(segment_ids.shape[0]):
        for t in range(1, segment_ids.shape[1]):
            same = segment_ids[row, t] == segment_ids[row, t - 1]
            out[row, t] = out[row, t - 1] + 1 if same else 0
    return out


@pytest.mark.parametrize("implementation, platform", [("dot_product", "cpu"), ("dot_product", "gpu"),
                                                      pytest.param("flash", "cpu", marks=pytest.mark.slow)])
def test_chunked_attention_matches_the_direct_mask(implementation, platform):
    b, t, n, g, h = 2, 48, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(k, (b, t, n, h), jnp.float32) for k in keys[:2])
    k, v = (jax.random.normal(key, (b, t, g, h), jnp.float32) for key in keys[2:])
    seg = kernel_check.packed_segment_ids(b, t, seed=3)
    pos = jnp.asarray(packed_positions(seg))
    seg = jnp.asarray(seg)
    mask = attention.make_attention_mask(seg, seg, chunk=CHUNK, q_positions=pos, kv_positions=pos)
    # the direct mask hides keys a plain causal mask shows: the chunks are exercised
    assert int(mask.sum()) < int(attention.make_attention_mask(seg, seg).sum())

    def reference(q, k, v):
        return attention.dot_product_attention(q, k, v, mask)

    def chunked(q, k, v):
        return attention.attention(q, k, v, seg, implementation=implementation, platform=platform, chunk=CHUNK,
                                   positions=pos, block_q=16, block_kv=16)

    with jax.default_matmul_precision("highest"):
        expected = kernel_check.fwd_bwd(lambda q, k, v, s: reference(q, k, v))(q, k, v, seg, do)
        actual = kernel_check.fwd_bwd(lambda q, k, v, s: chunked(q, k, v))(q, k, v, seg, do)
    for name, error in kernel_check.relative_errors(actual, expected).items():
        assert error < 1e-5, (name, error)


def test_chunked_attention_is_causal_only():
    q = jnp.zeros((1, 8, 2, 4))
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="chunked attention is causal"):
        attention.attention(q, q, q, seg, causal=False, chunk=4, positions=jnp.arange(8)[None])


@pytest.mark.parametrize("length, chunk", [(64, 16), (64, 64), (50, 16), (7, 3)])
def test_flops_count_the_keys_a_chunked_layer_attends(length, chunk):
    seg = jnp.ones((1, length), jnp.int32)
    mask = attention.make_attention_mask(seg, seg, chunk=chunk)
    chunked = layers.LayerType(attention="chunked", window=chunk)
    assert layers.attended_keys(length, chunked) * length == pytest.approx(float(np.sum(mask)))


def tiny(*extra):
    return load_config([BASE_YML, "decoder_block=llama4_text", "base_emb_dim=32", "base_num_query_heads=4",
                        "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=48", "base_num_decoder_layers=4",
                        "vocab_size=512", "max_target_length=32", "num_experts=4", "base_moe_mlp_dim=24",
                        "shared_experts=1", "decoder_sparse_step=2", "nope_layer_interval=2",
                        "chunk_attn_window_size=4", "use_qk_norm=true", "temperature_tuning=true",
                        "temperature_tuning_floor_scale=4", "temperature_tuning_scale=0.5", "dtype=float32",
                        "attention=dot_product", *extra])


@pytest.mark.parametrize("top_k", [1, 2])
def test_topk_sigmoid_router_weights_the_experts_inputs(top_k):
    config = tiny(f"num_experts_per_tok={top_k}")
    rt = Runtime.from_config(config)
    params = Model.bind(config).init_params(jax.random.key(1))
    p = jax.tree.map(lambda a: a[0], params["layers"]["moe"])
    x = jax.random.normal(jax.random.key(2), (2, 12, config.base_emb_dim), jnp.float32)
    seg = jnp.ones((2, 12), jnp.int32)
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    xs = np.asarray(x, np.float64)

    def swiglu(x, gate, up, down):
        a = x @ gate
        return (a / (1 + np.exp(-a)) * (x @ up)) @ down

    logits = xs @ w["router"]
    expected = swiglu(xs, w["shared_gate"], w["shared_up"], w["shared_down"])
    for index in np.ndindex(*xs.shape[:2]):
        for e in np.argsort(-logits[index])[:top_k]:
            weight = 1 / (1 + np.exp(-logits[index][e]))
            expected[index] += swiglu(weight * xs[index], w["w_gate"][e], w["w_up"][e], w["w_down"][e])
    with jax.default_matmul_precision("highest"):
        for settings in ({}, {"moe_dispatch": "capacity", "capacity_factor": 8.0}):
            block = jax.jit(lambda x, c=config.replace(**settings): moe.block(x, p, seg, c, rt, router="topk_sigmoid",
                                                                               num_moe_layers=1)[0])
            np.testing.assert_allclose(np.asarray(block(x)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_cached_decoding_matches_the_full_forward():
    config = tiny()
    rt = Runtime.from_config(config)
    params = Model.bind(config).init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 4, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(24), tokens.shape)
    with jax.default_matmul_precision("highest"):
        full = jax.jit(lambda p: Model.bind(config).forward(p, tokens, positions, jnp.ones_like(tokens), rt)[0])(params)
        step = jax.jit(lambda p, t, pos, c, i: Model.bind(config).forward_with_cache(p, t, pos, c, i, rt))
        cache = Model.bind(config).init_cache(2, 24, rt.dtype)
        pieces, index = [], 0
        for length in (6, 1, 17):  # a prefill, a single token, then a piece across the chunks of 4
            logits, cache = step(params, tokens[:, index:index + length], positions[:, index:index + length], cache,
                                 index)
            pieces.append(logits)
            index += length
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_each_feature_is_needed_to_match_transformers(tmp_path):
    """The transformers case of tests/models/test_families.py, imported, matches; with each of qk-norm, attention
    temperature, the NoPE layers and the experts' input weighting (as output weights instead) undone, it does not."""
    pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
    # deferred: test_families imports torch and transformers at its top
    from test_families import CASES, COMMON, hf_logits, ids, make_hf_model, ours_with, relative_error
    from maxtrain.checkpointing import convert

    config_class, model_class, fields, _ = CASES["llama4_text-chunked-nope-l2norm-temperature-interleaved_moe"]
    hf = make_hf_model(config_class, model_class, fields)
    hf.save_pretrained(tmp_path / "hf")
    convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"), log=lambda *_: None)
    tokens = ids(COMMON["vocab_size"])
    theirs = hf_logits(hf, tokens)
    assert relative_error(ours_with(tmp_path / "out", tokens), theirs) <= 1e-5
    for off in ({"use_qk_norm": False}, {"temperature_tuning": False}, {"nope_layer_interval": -1}):
        assert relative_error(ours_with(tmp_path / "out", tokens, **off), theirs) > 1e-3, off
    with pytest.MonkeyPatch.context() as patch:  # the router's weights on the experts' outputs, as other routers
        patch.setattr(moe.topk_sigmoid, "weights_inputs", lambda s: False)
        assert relative_error(ours_with(tmp_path / "out", tokens), theirs) > 1e-3
