"""Ring attention with cuDNN's forward per block pair (models/attention/ring_cudnn.py) on 8 simulated CPU devices.

cuDNN does not run on CPU, so the pair's forward is ring_cudnn.reference_block (cudnn_block's contract in plain jnp:
(out, lse) of a boolean-masked block, a row that sees no key given cuDNN's uniform softmax); everything else is the
code a GPU runs: the masks by original indices, the online merge, the causal block skipping under dual_chunk_swap,
and the backward by the flash kernel (Pallas interpret mode) given the ring's global out and lse. Compared with the
plain-jnp attention over the unsplit sequence (test_context_ring_flash.py's inputs: packed rows, then padding):
values and the gradients of a weighted sum. The control: the same ring whose block returns its lse rounded to
bfloat16, as the public jax.nn.dot_product_attention(return_residual=True) does, which the check must catch. The
compiled form with cuDNN itself: tests/kernels/test_kernel_lowering.py; on a GPU: scripts/gpu_ring_check.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import attention
from maxtrain.models.attention import ring_cudnn
from maxtrain.parallel import context, sharding
from conftest import BASE_YML, TINY, slow_params
from maxtrain.config import ConfigError, load_config, with_overrides
from test_context_ring_flash import ATOL, RTOL, RULES, _inputs, _reference


def _ring(cp, q, k, v, segment_ids, weights, sinks, *, causal, sliding_window, reorder, block):
    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)
    q, k, v, segment_ids, weights = context.to_layout((q, k, v, segment_ids, weights), cp, reorder=reorder)

    def loss(q, k, v, sinks):
        out = ring_cudnn.ring_cudnn_attention(q, k, v, segment_ids, reorder=reorder, causal=causal,
                                              sliding_window=sliding_window, sinks=sinks, interpret=True,
                                              block_q=16, block_k=16, block=block)
        return jnp.sum(out * weights), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    back = functools.partial(context.from_layout, cp=cp, reorder=reorder)
    return back(out), [back(g) for g in grads[:3]] + [grads[3]]


def _bf16_lse_block(q, k, v, mask, *, causal, scale):
    out, lse = ring_cudnn.reference_block(q, k, v, mask, causal=causal, scale=scale)
    return out, lse.astype(jnp.bfloat16).astype(jnp.float32)


CASES = {  # name: (cp, causal, sliding_window, reorder, sinks)
    "4-causal": (4, True, 0, "dual_chunk_swap", False),
    "4-striped_causal_window": (4, True, 21, "striped", False),
    "2-bidirectional_sinks": (2, False, 0, "dual_chunk_swap", True),
    "1-causal_window": (1, True, 21, "dual_chunk_swap", False),
}


def _compare(case, block):
    cp, causal, sliding_window, reorder, with_sinks = CASES[case]
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, causal=causal, logits_soft_cap=0.0,
                                    sliding_window=sliding_window)
    out, grads = _ring(cp, q, k, v, segment_ids, weights, sinks, causal=causal, sliding_window=sliding_window,
                       reorder=reorder, block=block)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL,
                                       err_msg=f"d loss / d {name}")


# the default run keeps the striped ring with a window (every pair masked by position, 6 s); the causal
# dual_chunk_swap ring (half pairs skipped, 12 s), bidirectional with sinks and the ring of one run with the slow tests
@pytest.mark.parametrize("case", slow_params(CASES, {"4-causal", "2-bidirectional_sinks", "1-causal_window"}))
def test_ring_with_a_cudnn_style_forward_equals_attention_over_the_unsplit_sequence(case):
    _compare(case, ring_cudnn.reference_block)


def test_control_a_bfloat16_lse_per_block_is_caught():
    with pytest.raises(AssertionError):
        _compare("4-striped_causal_window", _bf16_lse_block)


def test_cudnn_resolves_inside_the_ring_on_gpus_and_the_rest_is_refused_in_one_line():
    resolve = functools.partial(attention.resolve_implementation, platform="gpu", dtype=jnp.bfloat16, head_dim=128,
                                length=32768, context_parallel=8, context_strategy="ring", gpu_present=True,
                                capability="9.0")
    assert resolve("cudnn") == "cudnn"
    assert resolve("autoselected") == "flash"  # cuDNN inside the ring is not measured yet (the module docstring)
    for kwargs, words in [({"logits_soft_cap": 30.0}, "logits_soft_cap"), ({"sinks": True}, "sinks"),
                          ({"context_strategy": "usp"}, "usp"), ({"platform": "cpu"}, "GPU")]:
        with pytest.raises(ValueError, match=words) as err:
            resolve("cudnn", **kwargs)
        assert "\n" not in str(err.value) and "attention=flash" in str(err.value), str(err.value)


def test_soft_cap_and_sinks_are_refused_by_the_ring_itself():
    q = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
    seg = jnp.ones((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="attention=flash"):
        ring_cudnn.ring_cudnn_shard(q, q, q, seg, jnp.arange(32), axes=("context",), ways=1, logits_soft_cap=5.0)
    with pytest.raises(ValueError, match="sinks"):
        ring_cudnn.attention(q, q, q, seg, platform="gpu", reorder="dual_chunk_swap", causal=True, sliding_window=0,
                             logits_soft_cap=0.0, scale=None, block_q=16, block_kv=16, interpret=True,
                             sinks=jnp.zeros((2,)))


def test_the_config_takes_cudnn_inside_the_ring_and_still_refuses_tokamax():
    ring = ["ici_context_parallelism=2", "context_parallel_strategy=ring", "max_target_length=64"]
    config = load_config(with_overrides([BASE_YML, *TINY], *ring, "attention=cudnn"))
    assert config.attention == "cudnn" and config.context_parallel_strategy == "ring"
    with pytest.raises(ConfigError, match=r"attention=tokamax does not run inside context_parallel_strategy=ring"):
        load_config(with_overrides([BASE_YML, *TINY], *ring, "attention=tokamax"))
