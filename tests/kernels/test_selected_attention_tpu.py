"""The selected-key attention's TPU (Mosaic) kernel (kernels/selected_attention_tpu.py) in Pallas' interpreters on CPU
against DeepSeek-V3.2's plain-jnp form (models/families/deepseek/selected.py), on test_selected_attention.py's inputs:
two packed documents and padding in one row, queries that see fewer than K keys (the causal edge, a document's first
tokens: one key), K = 6 in two key blocks of 4 (two slots padded), 3 heads padded to 8 (and 12 in two blocks of
8), 16 queries in blocks of 4 (forward, dq) and 2 (rows). Values and gradients (q_nope, q_rope, c, k_rope and W_kvb's key half through the absorbed
queries) within float32 1e-5 (values) and 1e-4 relative / 1e-5 absolute (gradients); bfloat16 (rows stored as uint32
pairs) against the float32 reference 3e-2. One forward runs in the TPU interpreter (InterpretParams: DMAs take
effect when waited on, with its race detector), the gradients too (slow). Controls: a shifted idx, a dropped `kept`
and, in the TPU interpreter, copies not waited for move the output past the tolerance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from maxtrain.kernels import selected_attention_tpu
from maxtrain.models.families.deepseek import selected
from test_selected_attention import B, C, N, SCALE, SEGMENTS, T, TOPK, _choice, _inputs, _reference  # noqa: E402

TILES = dict(block_k=4, block_queries=4, rows_queries=2, bwd_query_chunk=8)


@functools.partial(jax.jit, static_argnames=("interpret", "with_max_logits"))
def _jitted(q_c, q_r, c, k_r, idx, kept, interpret, with_max_logits=False):  # one compile for the calls alike
    return selected_attention_tpu.selected_attention(q_c, q_r, c, k_r, idx, kept, scale=SCALE, interpret=interpret,
                                                     with_max_logits=with_max_logits, **TILES)


def _kernel(x, dtype=jnp.float32, choice=None, interpret=True, **kw):
    idx, kept = choice or _choice(x)
    q_c = jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"])
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return _jitted(cast(q_c), cast(x["q_rope"]), cast(x["c"]), cast(x["k_rope"]), idx, kept, interpret, **kw)


def _close(got, want, tol=1e-5):
    return np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_values_and_max_logits_equal_the_reference_and_the_controls_fail():
    x = _inputs()
    got, head_max = _kernel(x, with_max_logits=True)
    want, want_max = selected.attention(x["q_nope"], x["q_rope"], x["c"], x["k_rope"], x["w_k"], x["index_q"],
                                        x["index_w"], x["index_k"], SEGMENTS, topk=TOPK, scale=SCALE,
                                        with_max_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(head_max, want_max, rtol=1e-5, atol=1e-5)
    idx, kept = _choice(x)
    shifted = jnp.where(kept, jnp.maximum(idx - 1, 0), idx)  # each chosen key's neighbour instead
    assert not _close(_kernel(x, choice=(shifted, kept)), want)
    assert not _close(_kernel(x, choice=(idx, jnp.ones_like(kept))), want)  # slots not kept read after all


def test_another_documents_keys_change_nothing():
    """Packed documents: the second document's outputs do not move when the first document's keys do."""
    x = _inputs()
    second = slice(5, 13)
    moved = {**x, "c": x["c"].at[0, :5].add(3.0), "k_rope": x["k_rope"].at[0, :5].add(-2.0)}
    np.testing.assert_array_equal(_kernel(moved, choice=_choice(x))[0, second], _kernel(x)[0, second])


def test_gradients_equal_the_reference():
    """dq_c, dq_r (through q_nope, W_kvb's key half and q_rope), dc and dk_r (the rows scatter-added; two chunks of
    8 queries, each in rows kernels of 2)."""
    x = _inputs()
    cotangent = jax.random.normal(jax.random.key(7), (B, T, N, C))
    params = {k: x[k] for k in ("q_nope", "q_rope", "c", "k_rope", "w_k")}

    def loss(fn):
        return lambda p: jnp.sum(fn({**x, **p}) * cotangent)

    want = jax.grad(loss(_reference))(params)
    got = jax.grad(loss(_kernel))(params)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
        assert float(jnp.max(jnp.abs(want[name]))) > 0.1, name  # a real gradient, not zeros on both sides


@pytest.mark.parametrize("gradient", [False, pytest.param(True, marks=pytest.mark.slow)])  # with it: ~25 s
def test_heads_in_several_blocks(gradient):
    """12 heads (the 3 four times over) in blocks of 8, the last padded: each copy's output is the reference's, and
    c's gradient four times the reference's (each copy adds its own)."""
    x = _inputs()
    idx, kept = _choice(x)
    q_c = jnp.tile(jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"]), (1, 1, 4, 1))
    q_r = jnp.tile(x["q_rope"], (1, 1, 4, 1))

    def run(c):
        return selected_attention_tpu.selected_attention(q_c, q_r, c, x["k_rope"], idx, kept, scale=SCALE,
                                                         interpret=True, block_heads=8, **TILES)
    np.testing.assert_allclose(run(x["c"]), jnp.tile(_reference(x), (1, 1, 4, 1)), rtol=1e-5, atol=1e-5)
    if not gradient:
        return
    got = jax.grad(lambda c: jnp.sum(run(c)))(x["c"])
    want = jax.grad(lambda c: jnp.sum(_reference({**x, "c": c})))(x["c"])
    np.testing.assert_allclose(got, 4 * want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~10 s more in the default run; its causal edge (a query with one key) is in every test there
def test_a_query_with_no_kept_key_gives_zero_and_no_gradient():
    """Slots not kept are ignored even where every slot of a query is (output 0, as selected.py's masked softmax)."""
    x = _inputs()
    idx, kept = _choice(x)
    kept = kept.at[1, 3].set(False)
    q_c = jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"])

    def run(q_c, c):
        return _jitted(q_c, x["q_rope"], c, x["k_rope"], idx, kept, True)
    out = run(q_c, x["c"])
    assert float(jnp.max(jnp.abs(out[1, 3]))) == 0.0 and float(jnp.max(jnp.abs(out[1, 4]))) > 0.0
    dq_c, dc = jax.grad(lambda q, c: jnp.sum(run(q, c)[1, 3]), argnums=(0, 1))(q_c, x["c"])
    assert float(jnp.max(jnp.abs(dq_c))) == 0.0 and float(jnp.max(jnp.abs(dc))) == 0.0


@pytest.mark.slow  # ~15 s: a second compile of the three kernels in bfloat16
def test_bfloat16_rows_packed_in_pairs_are_close_to_the_float32_reference():
    x = _inputs()
    got = _kernel(x, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), _reference(x), rtol=3e-2, atol=3e-2)
    dc = jax.grad(lambda c: jnp.sum(_kernel({**x, "c": c}, jnp.bfloat16).astype(jnp.float32)))(x["c"])
    want = jax.grad(lambda c: jnp.sum(_reference({**x, "c": c})))(x["c"])
    np.testing.assert_allclose(dc, want, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(want))))


def test_the_tpu_interpreter_gives_the_same_values_without_races(monkeypatch):
    """Pallas' TPU interpreter simulates the DMAs and semaphores (a copy lands only when waited on; fresh VMEM is
    NaN, so a slot read before its copy, or a row never copied and not zeroed, would show) and, asked to, reports a
    DMA racing a load or store of the same buffer."""
    # its race detector's result: private to JAX (checked against jax 0.10.2)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # pylint: disable=import-outside-toplevel

    x = _inputs()
    params = pltpu.InterpretParams(detect_races=True)
    np.testing.assert_allclose(_kernel(x, interpret=params), _reference(x), rtol=1e-5, atol=1e-5)
    assert not interpret_pallas_call.races.races_found
    monkeypatch.setattr(selected_attention_tpu._Gather, "wait", lambda self, q, j, slot: None)  # control: no wait
    broken = _jitted.__wrapped__(jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"]), x["q_rope"], x["c"],
                                 x["k_rope"], *_choice(x), params)  # traced anew, not jit's cached kernel
    assert not _close(broken, _reference(x))  # rows read before their copies land


@pytest.mark.slow  # the TPU interpreter's DMAs and semaphores, three kernels: ~35 s on CPU
def test_the_tpu_interpreter_gives_the_same_gradients():
    x = _inputs()
    cotangent = jax.random.normal(jax.random.key(7), (B, T, N, C))
    params = {k: x[k] for k in ("q_rope", "c", "k_rope")}
    want = jax.grad(lambda p: jnp.sum(_reference({**x, **p}) * cotangent))(params)
    got = jax.grad(lambda p: jnp.sum(_kernel({**x, **p}, interpret="tpu") * cotangent))(params)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_block_k_off_the_lanes_is_refused_when_compiled():
    x = _inputs()
    with pytest.raises(ValueError, match=r"block_k=4 must be a multiple of 128 \(the TPU.s lanes\)"):
        selected_attention_tpu.selected_attention(x["c"][:, :, None], x["k_rope"][:, :, None], x["c"], x["k_rope"],
                                                  *_choice(x), scale=SCALE, interpret=False, block_k=4)
