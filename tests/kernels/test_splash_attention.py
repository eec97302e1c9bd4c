"""TPU splash attention (JAX's Pallas kernel, run in Pallas' interpreter on CPU) against the plain-jnp reference.

jax 0.10.2 interprets the TPU kernels on CPU (`interpret=True`), so these compare numbers; that the
kernels also compile for real TPUs through Mosaic is tests/kernels/test_kernel_lowering.py's job.
Every case compares the output and the gradients w.r.t. q, k and v (pulled back from a random
cotangent). Tolerances: float32, |splash - ref| <= 1e-5 + 1e-5 * |ref|; bfloat16 (reference in
float32 on the same bf16 values), 2e-2 + 2e-2 * |ref|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import slow_params
from maxtrain.models import attention
from maxtrain.kernels.splash_attention import splash_attention

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# name: (batch, length, heads, kv_heads, head_dim, causal, sliding_window, soft_cap, scale, dtype)
CASES = {
    # GQA 4:2, packed rows with trailing padding, length 200 (padded to 256 inside).
    "gqa2_causal_packed_len200_f32": (2, 200, 4, 2, 32, True, 0, 0.0, None, jnp.float32),
    # Gemma-style: window 50 (block skipping: 128-blocks wholly outside the window), cap 5, scale 0.3, MQA.
    "mqa_window50_cap5_scale_len256_f32": (1, 256, 4, 1, 32, True, 50, 5.0, 0.3, jnp.float32),
    "mha_full_packed_bf16": (1, 128, 2, 2, 64, False, 0, 0.0, None, jnp.bfloat16),
}


def _segments(batch, length, seed):
    """Three documents per row, then padding (id 0)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length - 4), size=3, replace=False))
        for doc, (start, stop) in enumerate(zip([0, *cuts[:2]], cuts)):
            ids[row, start:stop] = doc + 1
    return jnp.asarray(ids)


def _inputs(batch, length, heads, kv_heads, head_dim, dtype, seed):
    kq, kk, kv, kdo = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, length, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, length, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, length, kv_heads, head_dim), dtype)
    return q, k, v, jax.random.normal(kdo, q.shape, dtype), _segments(batch, length, seed)


def _reference(q, k, v, seg, causal, window, cap, scale):
    mask = attention.make_attention_mask(seg, seg, causal=causal, sliding_window=window)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return attention.dot_product_attention(f32(q), f32(k), f32(v), mask, scale=scale, logits_soft_cap=cap)


def _close(name, actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               atol=tol, rtol=tol, err_msg=name)


def _fwd_bwd(fn, q, k, v, do):
    return jax.jit(lambda q, k, v, do: (lambda o, f: (o, f(do)))(*jax.vjp(fn, q, k, v)))(q, k, v, do)


@pytest.mark.parametrize("name", slow_params(CASES, {"gqa2_causal_packed_len200_f32"}))
def test_matches_reference(name):
    batch, length, heads, kv_heads, head_dim, causal, window, cap, scale, dtype = CASES[name]
    q, k, v, do, seg = _inputs(batch, length, heads, kv_heads, head_dim, dtype, sorted(CASES).index(name))

    def splash(q, k, v):
        return splash_attention(q, k, v, seg, causal=causal, sliding_window=window, logits_soft_cap=cap,
                                scale=scale, block_q=128, block_kv=128, interpret=True)

    out, grads = _fwd_bwd(splash, q, k, v, do)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_grads = _fwd_bwd(lambda q, k, v: _reference(q, k, v, seg, causal, window, cap, scale),
                                  f32(q), f32(k), f32(v), f32(do))
    for label, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert actual.dtype == dtype and actual.shape == expected.shape, label
        _close(f"{name}: {label}", actual, expected, TOLERANCE[dtype])


def test_wrong_settings_are_detected():
    """The comparison can fail: references with another window, cap, scale or no segments differ."""
    q, k, v, _, seg = _inputs(1, 256, 4, 1, 32, jnp.float32, seed=3)
    out = jax.jit(lambda q, k, v: splash_attention(q, k, v, seg, sliding_window=50, logits_soft_cap=5.0, scale=0.3,
                                                   block_q=128, block_kv=128, interpret=True))(q, k, v)
    _close("right", out, _reference(q, k, v, seg, True, 50, 5.0, 0.3), 1e-5)
    for window, cap, scale, segments in ((0, 5.0, 0.3, seg), (51, 5.0, 0.3, seg), (50, 0.0, 0.3, seg),
                                         (50, 5.0, None, seg), (50, 5.0, 0.3, jnp.ones_like(seg))):
        with pytest.raises(AssertionError):
            _close("wrong", out, _reference(q, k, v, segments, True, window, cap, scale), 1e-5)


def test_dispatcher_runs_splash_for_tpu_targets():
    """attention(implementation=flash, platform=tpu) is the splash kernel (interpreted here), and it
    agrees with dot_product."""
    q, k, v, _, seg = _inputs(1, 128, 4, 2, 32, jnp.float32, seed=5)
    flash = jax.jit(lambda q, k, v: attention.attention(q, k, v, seg, implementation="flash", platform="tpu",
                                                        interpret=True))(q, k, v)
    lowered = jax.jit(lambda q, k, v: attention.attention(q, k, v, seg, implementation="flash", platform="tpu",
                                                          interpret=True)).lower(q, k, v).as_text()
    assert "splash" in lowered  # JAX names the kernel's scope after it
    _close("splash vs dot_product", flash, attention.attention(q, k, v, seg, implementation="dot_product"), 1e-5)
