"""all_gather context parallelism with the TPU splash kernel (models/attention/all_gather_splash.py) in Pallas' TPU
interpreter on simulated CPU devices: values and gradients against attention over the unsplit sequence, and what it
refuses. (Compiled for a TPU slice in tests/kernels/test_kernel_lowering.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import slow_params
from maxtrain.models import attention
from maxtrain.models.attention import all_gather_splash
from maxtrain.parallel import context, sharding

RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]
H = 16

CASES = {  # name: (cp, causal, sliding_window, logits_soft_cap, sinks)
    "cp2_causal_packed": (2, True, 0, 0.0, False),
    "cp2_window_softcap_sinks": (2, True, 200, 5.0, True),
    "cp4_causal_sinks": (4, True, 0, 0.0, True),
    "cp2_bidirectional": (2, False, 0, 0.0, False),
}


def _reference(q, k, v, segment_ids, weights, sinks, *, causal, logits_soft_cap, sliding_window):
    def loss(q, k, v, sinks):
        mask = attention.make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
        out = attention.dot_product_attention(q, k, v, mask, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return jnp.sum(out * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


@pytest.mark.parametrize("case", slow_params(list(CASES), {"cp2_causal_packed"}))
def test_all_gather_with_splash_equals_attention_over_the_unsplit_sequence(case):
    cp, causal, sliding_window, logits_soft_cap, with_sinks = CASES[case]
    t, n, g = 2 * cp * 128, 4, 2  # chunks of 128 tokens: the TPU's lanes
    rng = np.random.default_rng(cp)
    q, k, v = (rng.standard_normal((1, t, heads, H)).astype(np.float32) for heads in (n, g, g))
    segment_ids = np.ones((1, t), np.int32)  # three documents, then padding (segment 0)
    segment_ids[0, 150:], segment_ids[0, 300:], segment_ids[0, t - 20:] = 2, 3, 0
    weights = rng.standard_normal((1, t, n, H)).astype(np.float32)
    sinks = rng.standard_normal((n,)).astype(np.float32) if with_sinks else None
    kwargs = dict(causal=causal, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, **kwargs)

    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)
    ql, kl, vl, sl, wl = context.to_layout((q, k, v, segment_ids, weights), cp)

    def loss(q, k, v, sinks):
        out = all_gather_splash.all_gather_splash(q, k, v, sl, reorder="dual_chunk_swap", scale=None, sinks=sinks,
                                                  block=128, interpret=True, **kwargs)
        return jnp.sum(out * wl), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(ql, kl, vl, sinks)
    back = functools.partial(context.from_layout, cp=cp)
    np.testing.assert_allclose(np.asarray(back(out)), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    for name, got, ref in zip(("q", "k", "v"), grads, ref_grads):
        np.testing.assert_allclose(np.asarray(back(got)), np.asarray(ref), rtol=2e-5, atol=2e-5,
                                   err_msg=f"d loss / d {name}")
    if with_sinks:
        np.testing.assert_allclose(np.asarray(grads[3]), np.asarray(ref_grads[3]), rtol=2e-5, atol=2e-5)


def test_flash_resolves_to_splash_under_all_gather_on_tpus_and_the_rest_is_refused_in_one_line():
    common = dict(dtype=jnp.bfloat16, head_dim=128, context_parallel=4, context_strategy="all_gather",
                  length=8192)
    assert attention.resolve_implementation("flash", "tpu", **common) == "flash"
    assert attention.resolve_implementation("autoselected", "tpu", **common) == "dot_product"  # the default stays
    with pytest.raises(ValueError, match=r"all_gather on TPUs \(the splash kernel\) runs dual_chunk_swap only"):
        attention.resolve_implementation("flash", "tpu", **{**common, "context_reorder": "striped"})
    with pytest.raises(ValueError, match=r"max_target_length=8320 must be a multiple of 1024"):
        attention.resolve_implementation("flash", "tpu", **{**common, "length": 8320})
