"""The gated delta rule (maxtrain/models/recurrent/gated_delta.py): the chunked (WY) form against the token-by-token
recurrence, in float64 (forward, final state and every input's gradient), packed documents against the same
documents run apart, an initial state, float32 against float64, and no [T, T] array in the chunked program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import slow_params
from maxtrain.models.recurrent import gated_delta


def _inputs(rng, b=1, t=21, n=2, dk=8, dv=6, dtype=np.float64):
    q, k = rng.normal(size=(b, t, n, dk)), rng.normal(size=(b, t, n, dk))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # the layer L2-normalises them
    v = rng.normal(size=(b, t, n, dv))
    log_decay = -np.abs(rng.normal(size=(b, t, n))) * 0.5
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, n))))
    return [np.asarray(x, dtype) for x in (q, k, v, log_decay, beta)]


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("chunk", slow_params([4, 8, 32], {"4", "32"}))
def test_chunked_equals_the_recurrence_in_float64(x64, chunk):
    """Chunks smaller than, dividing and larger than the sequence; documents crossing chunk boundaries."""
    rng = np.random.default_rng(0)
    x = [jnp.asarray(a) for a in _inputs(rng)]
    seg = jnp.asarray([[1] * 6 + [2] * 11 + [3] * 4])
    o_ref, s_ref = gated_delta.recurrent(*x, seg)
    o, s = gated_delta.chunked(*x, seg, chunk_size=chunk)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_allclose(s, s_ref, atol=1e-12)

    def loss(fn):
        def f(*args):
            o, s = fn(*args)
            return jnp.sum(o * jnp.cos(o)) + jnp.sum(s ** 2)
        return f
    grads_ref = jax.grad(loss(lambda *a: gated_delta.recurrent(*a, seg)), argnums=range(5))(*x)
    grads = jax.grad(loss(lambda *a: gated_delta.chunked(*a, seg, chunk_size=chunk)), argnums=range(5))(*x)
    for name, g, g_ref in zip(("q", "k", "v", "log_decay", "beta"), grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, atol=1e-11, err_msg=name)


@pytest.mark.slow
def test_packed_documents_are_separate_documents(x64):
    """The state restarts at each boundary: a packed row's outputs equal each document's run alone."""
    rng = np.random.default_rng(1)
    x = [jnp.asarray(a) for a in _inputs(rng, b=2, t=40)]
    bounds = [(0, 9), (9, 30), (30, 40)]
    seg = jnp.asarray(np.repeat([sum(([i + 1] * (e - s) for i, (s, e) in enumerate(bounds)), [])], 2, 0))
    packed, _ = gated_delta.chunked(*x, seg, chunk_size=8)
    for s, e in bounds:
        alone, _ = gated_delta.recurrent(*[a[:, s:e] for a in x])
        np.testing.assert_allclose(packed[:, s:e], alone, atol=1e-12)


@pytest.mark.slow
def test_an_initial_state_continues_the_first_document(x64):
    rng = np.random.default_rng(2)
    x = [jnp.asarray(a) for a in _inputs(rng, t=21)]
    s0 = jnp.asarray(rng.normal(size=(1, 2, 8, 6)))
    o_ref, s_ref = gated_delta.recurrent(*x, None, s0)
    o, s = gated_delta.chunked(*x, None, 8, s0)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_allclose(s, s_ref, atol=1e-12)
    # and splitting the sequence in two, the second half from the first's final state, is the same
    o1, s1 = gated_delta.chunked(*[a[:, :13] for a in x], None, 8, s0)
    o2, s2 = gated_delta.chunked(*[a[:, 13:] for a in x], None, 8, s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], axis=1), o_ref, atol=1e-12)
    np.testing.assert_allclose(s2, s_ref, atol=1e-12)


def test_float32_against_float64(x64):
    """What training computes (float32 inputs) against the float64 recurrence."""
    rng = np.random.default_rng(3)
    x = _inputs(rng, t=64)
    o_ref, _ = gated_delta.recurrent(*[jnp.asarray(a) for a in x])
    o, _ = gated_delta.chunked(*[jnp.asarray(a, jnp.float32) for a in x], chunk_size=16)
    assert o.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(o, np.float64) - np.asarray(o_ref))) < 1e-5


def test_the_chunked_program_holds_no_length_by_length_array():
    """Memory O(T C): no intermediate of the program (forward and backward) has two axes of the sequence's size."""
    t, c = 1024, 32
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
              ((1, t, 2, 16), (1, t, 2, 16), (1, t, 2, 16), (1, t, 2), (1, t, 2))]

    def loss(*args):
        return jnp.sum(gated_delta.chunked(*args, jnp.ones((1, t), jnp.int32), chunk_size=c)[0])

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=range(5)))(*shapes)
    seen = []

    def walk(jp):
        for eqn in jp.eqns:
            seen.extend(v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                walk(sub)
            for p in eqn.params.values():
                if hasattr(p, "jaxpr"):
                    walk(p.jaxpr if hasattr(p.jaxpr, "eqns") else p.jaxpr.jaxpr)
    walk(jaxpr.jaxpr)
    assert seen and not [s for s in seen if sum(d >= t for d in s) >= 2]


def test_the_solve_is_the_triangular_solve(x64):
    """unit_lower_solve's matmul product equals LAPACK's triangular solve (which deadlocked XLA:CPU in a scan)."""
    rng = np.random.default_rng(4)
    for c in (1, 5, 16):
        lmat = jnp.asarray(np.tril(rng.normal(size=(3, c, c)) * 0.5, -1))
        rhs = jnp.asarray(rng.normal(size=(3, c, 7)))
        want = jax.scipy.linalg.solve_triangular(jnp.eye(c) + lmat, rhs, lower=True, unit_diagonal=True)
        np.testing.assert_allclose(gated_delta.unit_lower_solve(lmat, rhs), want, atol=1e-10)
