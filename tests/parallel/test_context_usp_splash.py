"""usp (ulysses inside a slice, the ring across slices) with the TPU splash kernel per block pair of the ring
(models/attention/usp.py's splash path over ring_splash.py) in Pallas' TPU interpreter on simulated CPU devices:
values and gradients against the plain-jnp reference over the unsplit sequence, the reordering of a slice's pieces
into its two runs, and what resolve_implementation takes and refuses. (Compiled for a v5p-8 in
tests/kernels/test_kernel_lowering.py.)

2 slices x 2 devices, T = 512 tokens: each slice's two runs are 128 tokens (the TPU's lanes), each device's chunks
64. Rows packed (three documents, then padding). Tolerances as test_context_ring_flash.py's splash test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import slow_params
from maxtrain.models import attention
from maxtrain.models.attention import usp
from maxtrain.parallel import context, sharding

RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]
RTOL, ATOL = 2e-5, 1e-5
T, N, G, H = 512, 4, 2, 16

CASES = {  # name: (inner, outer, causal, logits_soft_cap, sinks)
    "2x2_causal_packed": (2, 2, True, 0.0, False),
    "2x2_causal_softcap_sinks": (2, 2, True, 5.0, True),
    "2x2_bidirectional": (2, 2, False, 0.0, False),
}


def _reference(q, k, v, segment_ids, weights, sinks, *, causal, logits_soft_cap):
    def loss(q, k, v, sinks):
        mask = attention.make_attention_mask(segment_ids, segment_ids, causal=causal)
        out = attention.dot_product_attention(q, k, v, mask, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return jnp.sum(out * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


def test_runs_put_a_slices_pieces_into_the_dual_chunk_swap_layout_over_the_slices():
    """A slice's tokens after the all-to-all are its devices' pieces (chunks c and 2C - 1 - c each); `runs` makes
    them the slice's part of the dual_chunk_swap layout over Co devices, which splash's static masks assume, and
    `pieces_of` takes them back."""
    for inner, outer in [(2, 2), (4, 2), (2, 4)]:
        length, cp = 2 * inner * outer * 3, inner * outer
        pieces, over_slices = context.layout(length, cp), context.layout(length, outer)
        per_slice = length // outer
        for d in range(outer):
            mine = jnp.asarray(pieces[d * per_slice:(d + 1) * per_slice])
            assert not np.array_equal(mine, over_slices[d * per_slice:(d + 1) * per_slice])  # the control
            np.testing.assert_array_equal(usp.runs(mine, inner, axis=0), over_slices[d * per_slice:(d + 1) * per_slice])
            np.testing.assert_array_equal(usp.pieces_of(usp.runs(mine, inner, axis=0), inner, axis=0), mine)


@pytest.mark.parametrize("case", slow_params(list(CASES), {"2x2_causal_packed"}))
def test_usp_with_splash_equals_attention_over_the_unsplit_sequence(case):
    inner, outer, causal, logits_soft_cap, with_sinks = CASES[case]
    cp = inner * outer
    rng = np.random.default_rng(cp)
    q, k, v = (rng.standard_normal((1, T, heads, H)).astype(np.float32) for heads in (N, G, G))
    segment_ids = np.ones((1, T), np.int32)  # three documents, then padding (segment 0)
    segment_ids[0, 150:], segment_ids[0, 300:], segment_ids[0, T - 20:] = 2, 3, 0
    weights = rng.standard_normal((1, T, N, H)).astype(np.float32)
    sinks = rng.standard_normal((N,)).astype(np.float32) if with_sinks else None
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, causal=causal,
                                    logits_soft_cap=logits_soft_cap)

    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)  # slice-major, as create_mesh's
    ql, kl, vl, sl, wl = context.to_layout((q, k, v, segment_ids, weights), cp)

    def loss(q, k, v, sinks):
        out = usp.usp_attention(q, k, v, sl, inner=inner, causal=causal, logits_soft_cap=logits_soft_cap, sinks=sinks,
                                splash={"interpret": True, "block_q": 128, "block_kv": 128})
        return jnp.sum(out * wl), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(ql, kl, vl, sinks)
    np.testing.assert_allclose(np.asarray(context.from_layout(out, cp)), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v"), grads[:3], ref_grads[:3]):
        np.testing.assert_allclose(np.asarray(context.from_layout(got, cp)), np.asarray(ref), rtol=RTOL, atol=ATOL,
                                   err_msg=f"d loss / d {name}")
    if with_sinks:
        np.testing.assert_allclose(np.asarray(grads[3]), np.asarray(ref_grads[3]), rtol=RTOL, atol=ATOL)


def test_under_usp_flash_is_splash_on_tpus_and_autoselected_takes_it_and_the_rest_is_refused_in_one_line():
    common = dict(dtype=jnp.bfloat16, head_dim=128, length=8192, context_parallel=4, context_strategy="usp",
                  context_inner=2)
    assert attention.resolve_implementation("flash", "tpu", **common) == "flash"
    choice = attention.resolve_implementation("autoselected", "tpu", with_reason=True, **common)
    assert choice.implementation == "flash" and "splash kernel per block pair of usp's ring" in choice.reason
    refusals = {  # extra settings: what the line must say
        ("context_reorder", "striped"): r"runs dual_chunk_swap without a sliding window only \(here striped, "
                                        r"sliding_window=0\); use attention=dot_product with usp",
        ("sliding_window", 1024): r"runs dual_chunk_swap without a sliding window only .*sliding_window=1024",
        ("length", 8320): r"needs each slice's two runs .* max_target_length=8320 must be a multiple of 512",
    }
    for (key, value), message in refusals.items():
        with pytest.raises(ValueError, match=r"attention=flash with context_parallel_strategy=usp on TPUs "
                                             r"\(the splash kernel\) " + message):
            attention.resolve_implementation("flash", "tpu", **{**common, key: value})
        choice = attention.resolve_implementation("autoselected", "tpu", with_reason=True, **{**common, key: value})
        assert choice.implementation == "dot_product" and "flash inside usp's ring on TPUs" in choice.reason
