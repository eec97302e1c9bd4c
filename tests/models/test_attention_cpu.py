"""The CPU formulations of dot-product attention (maxtrain/models/attention/): heads-major layout and causal
query chunks give the values and gradients of the plain [B, T, G, R, H] reference, and attention()
uses them on CPU only."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, slow_params
from maxtrain.models import attention


def _qkv(b, t, n, g, h, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, t, g, h), dtype)
    v = jax.random.normal(keys[2], (b, t, g, h), dtype)
    cotangent = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
    return q, k, v, cotangent


def _packed_segments(b, t):
    """Two sequences per row, split at different places, and a padded tail (segment 0) in row 0."""
    segments = np.ones((b, t), np.int32)
    for i in range(b):
        segments[i, (t // 3) + 5 * i:] = 2
    segments[0, t - 4:] = 0
    return jnp.asarray(segments)


def _values_and_grads(fn, q, k, v, cotangent):
    """One jitted program for the values and the gradients: op-by-op dispatch compiles every op alone, which
    took most of these tests' time."""
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)
    return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)


def _assert_close(got, want, rtol):
    (out, grads), (want_out, want_grads) = got, want
    for a, e in zip((out, *grads), (want_out, *want_grads)):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.max(np.abs(a - e)) <= rtol * np.max(np.abs(e)), np.max(np.abs(a - e)) / np.max(np.abs(e))


@pytest.mark.parametrize("n,g", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("mask_batch", [2, 1])
def test_heads_major_matches_the_reference(n, g, cap, mask_batch):
    b, t, h = 2, 48, 16
    q, k, v, cotangent = _qkv(b, t, n, g, h)
    segments = _packed_segments(b, t)[:mask_batch]
    mask = attention.make_attention_mask(segments, segments, sliding_window=20)
    fn = lambda hm: (lambda q, k, v: attention.dot_product_attention(q, k, v, mask, scale=0.3, logits_soft_cap=cap,
                                                                     heads_major=hm))
    _assert_close(_values_and_grads(fn(True), q, k, v, cotangent),
                  _values_and_grads(fn(False), q, k, v, cotangent), rtol=1e-5)


def test_heads_major_with_compact_16_bit_scores():
    b, t, n, g, h = 2, 32, 4, 2, 16
    q, k, v, cotangent = _qkv(b, t, n, g, h, dtype=jnp.bfloat16)
    mask = attention.make_attention_mask(*(2 * (_packed_segments(b, t),)))
    fn = lambda hm: (lambda q, k, v: attention.dot_product_attention(q, k, v, mask, compact_scores=True,
                                                                     heads_major=hm))
    _assert_close(_values_and_grads(fn(True), q, k, v, cotangent),
                  _values_and_grads(fn(False), q, k, v, cotangent), rtol=2e-2)


_CHUNK_CASES = [  # each length and window once, the two head layouts alternating
    (64, 0, 4, 2, 0.0), (100, 0, 2, 2, 3.0), (100, 7, 4, 2, 0.0), (100, 30, 2, 2, 3.0), (100, 500, 4, 2, 0.0),
    (13, 0, 2, 2, 3.0)]


@pytest.mark.parametrize("t,window,n,g,cap", slow_params(
    _CHUNK_CASES, {"100-0-2-2-3.0", "100-500-4-2-0.0", "100-30-2-2-3.0", "64-0-4-2-0.0"}, ids=["-".join(map(str, c)) for c in _CHUNK_CASES]))
def test_causal_chunks_match_one_masked_call(t, window, n, g, cap):
    b, h = 2, 16
    q, k, v, cotangent = _qkv(b, t, n, g, h, seed=t + window)
    segments = _packed_segments(b, t)
    mask = attention.make_attention_mask(segments, segments, sliding_window=window)
    whole = lambda q, k, v: attention.dot_product_attention(q, k, v, mask, logits_soft_cap=cap)
    chunked = lambda q, k, v: attention.causal_chunks(q, k, v, segments, sliding_window=window, logits_soft_cap=cap,
                                                      max_chunks=4, min_chunk=8)
    _assert_close(_values_and_grads(chunked, q, k, v, cotangent), _values_and_grads(whole, q, k, v, cotangent),
                  rtol=1e-5)


@pytest.mark.parametrize("window,cap,with_sinks", [(0, 0.0, False), (30, 3.0, True)])
def test_long_causal_chunks_recompute_each_chunk_exactly(window, cap, with_sinks):
    """Past long_from tokens: each chunk a scan of checkpointed sub-chunks of long_chunk queries
    (the last one padded), same values and gradients as one masked call (with gpt-oss's sinks too)."""
    b, t, n, g, h = 2, 100, 4, 2, 16
    q, k, v, cotangent = _qkv(b, t, n, g, h, seed=7 + window)
    sinks = jnp.linspace(-1.0, 1.0, n) if with_sinks else None
    segments = _packed_segments(b, t)
    mask = attention.make_attention_mask(segments, segments, sliding_window=window)
    whole = lambda q, k, v: attention.dot_product_attention(q, k, v, mask, logits_soft_cap=cap, sinks=sinks)
    chunked = lambda q, k, v: attention.causal_chunks(q, k, v, segments, sliding_window=window, logits_soft_cap=cap,
                                                      max_chunks=2, long_from=64, long_chunk=16, sinks=sinks)
    _assert_close(_values_and_grads(chunked, q, k, v, cotangent), _values_and_grads(whole, q, k, v, cotangent),
                  rtol=1e-5)
    scans = [e for e in jax.make_jaxpr(chunked)(q, k, v).jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [4, 3]  # 7 sub-chunks of 16 (112 >= 100) in 2 chunks


def test_long_causal_chunks_keep_one_chunk_of_scores_for_the_backward():
    """The point of the long mode: the compiled backward's temporaries grow as T x long_chunk, not T^2 / 2."""
    t = 4096
    q, k, v, _ = _qkv(1, t, 4, 4, 16)
    segments = jnp.ones((1, t), jnp.int32)

    def temp_bytes(long_from):
        loss = lambda q, k, v: jnp.sum(attention.causal_chunks(q, k, v, segments, long_from=long_from,
                                                               long_chunk=128) ** 2)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    kept = temp_bytes(long_from=t)     # 8 chunks, every chunk's probabilities kept for the backward
    one = temp_bytes(long_from=t - 1)  # 8 chunks, each a scan of 4 checkpointed sub-chunks of 128 queries
    assert one * 4 < kept, (one, kept)  # 68 MB and 372 MB with jax 0.10.2


def _score_shapes(fn, *args):
    """The shapes of the q.k products (the dot_generals that contract H) in fn's jaxpr."""
    h = args[0].shape[-1]

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contracted, _), _ = eqn.params["dimension_numbers"]
                if [eqn.invars[0].aval.shape[d] for d in contracted] == [h]:
                    yield tuple(eqn.outvars[0].aval.shape)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from walk(inner)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("t,window,want", [
    (64, 0, [(2, 2, 16, 16), (2, 2, 16, 32), (2, 2, 16, 48), (2, 2, 16, 64)]),    # 10/16 of 64 x 64
    (64, 10, [(2, 2, 16, 16), (2, 2, 16, 25), (2, 2, 16, 25), (2, 2, 16, 25)]),   # keys [start - 9, end)
    (20, 0, [(2, 2, 20, 20)]),                                                     # too short to cut
])
def test_causal_chunks_skip_the_masked_keys(t, window, want):
    q, k, v, _ = _qkv(2, t, 2, 2, 8)
    segments = jnp.ones((2, t), jnp.int32)
    fn = lambda q, k, v: attention.causal_chunks(q, k, v, segments, sliding_window=window, max_chunks=4, min_chunk=16)
    assert _score_shapes(fn, q, k, v) == want


def test_attention_on_cpu_uses_the_chunks_and_elsewhere_one_call():
    """attention(): causal dot_product on CPU in chunks of at least 128 queries (2 at T = 256); for
    another platform, or not causal, one [B, G, R, T, S] product as before."""
    t = 256
    q, k, v, cotangent = _qkv(1, t, 2, 1, 8)
    segments = _packed_segments(1, t)

    def run(platform, causal=True):
        return lambda q, k, v: attention.attention(q, k, v, segments, implementation="dot_product",
                                                   platform=platform, causal=causal)

    assert _score_shapes(run("cpu"), q, k, v) == [(1, 1, 2 * 128, 128), (1, 1, 2 * 128, 256)]  # 3/4 of 2 x T x T
    assert _score_shapes(run("cpu", causal=False), q, k, v) == [(1, 1, 2 * t, t)]
    for platform in ("gpu", "tpu"):
        [shape] = _score_shapes(run(platform), q, k, v)
        assert sorted(shape) == [1, 1, 2, t, t], shape
    _assert_close(_values_and_grads(run("cpu"), q, k, v, cotangent),
                  _values_and_grads(run("gpu"), q, k, v, cotangent), rtol=1e-5)


def test_benchmark_attention_times_both_formulations():
    """scripts/benchmark_attention.py --impl dot_product dot_product_cpu: one timed row for each."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "benchmark_attention.py"),
                           "--impl", "dot_product", "dot_product_cpu", "--dtype", "float32", "--seq", "64", "--tokens",
                           "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("dot_product")]
    assert [row[:3] for row in rows] == [["dot_product", "64", "2"], ["dot_product_cpu", "64", "2"]], rows
    assert all(float(row[3]) > 0 for row in rows), rows
