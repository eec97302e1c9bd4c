"""Ring attention with cuDNN per block pair (models/attention/ring_cudnn.py) on 8 simulated CPU devices: inside
context_parallel_strategy=ring, and inside usp's ring across slices (2 devices a slice x 4 slices).

cuDNN does not run on CPU, so the pair's forward is ring_cudnn.reference_block (cudnn_block's contract in plain jnp:
(out, lse) of a boolean-masked block, a row that sees no key given cuDNN's uniform softmax) and the pair's backward
either the flash kernel (Pallas interpret mode) or ring_cudnn.reference_block_grad (cudnn_block_grad's contract:
dq, dk, dv of the pair from the ring's GLOBAL out and lse); everything else is the code a GPU runs: the masks by
original indices, the online merge, the causal block skipping under dual_chunk_swap, usp's all-to-alls. Compared with
the plain-jnp attention over the unsplit sequence (test_context_ring_flash.py's inputs: packed rows, then padding):
values and the gradients of a weighted sum. The controls: the same ring whose block returns its lse rounded to
bfloat16, as the public jax.nn.dot_product_attention(return_residual=True) does, and a pair backward from the pair's
OWN out and lse (what jax's public VJP of cuDNN would give), which the checks must catch. The compiled forms with
cuDNN itself: tests/kernels/test_kernel_lowering.py; on a GPU: scripts/gpu_ring_check.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import attention
from maxtrain.models.attention import ring_cudnn, usp
from maxtrain.parallel import context, sharding
from conftest import BASE_YML, TINY, slow_params
from maxtrain.config import ConfigError, load_config, with_overrides
from test_context_ring_flash import ATOL, RTOL, RULES, _inputs, _reference


def _ring(cp, q, k, v, segment_ids, weights, sinks, *, causal, sliding_window, reorder, block, block_grad=None,
          inner=0):
    """The ring (inner=0) or usp with `inner` devices a slice, over cp devices: (out, grads) in the original order."""
    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)
    q, k, v, segment_ids, weights = context.to_layout((q, k, v, segment_ids, weights), cp, reorder=reorder)
    settings = dict(interpret=True, block_q=16, block_k=16, block=block, block_grad=block_grad)

    def loss(q, k, v, sinks):
        if inner:
            out = usp.usp_attention(q, k, v, segment_ids, inner=inner, reorder=reorder, causal=causal,
                                    sliding_window=sliding_window, sinks=sinks, cudnn=settings)
        else:
            out = ring_cudnn.ring_cudnn_attention(q, k, v, segment_ids, reorder=reorder, causal=causal,
                                                  sliding_window=sliding_window, sinks=sinks, **settings)
        return jnp.sum(out * weights), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    back = functools.partial(context.from_layout, cp=cp, reorder=reorder)
    return back(out), [back(g) for g in grads[:3]] + [grads[3]]


def _bf16_lse_block(q, k, v, mask, *, causal, scale):
    out, lse = ring_cudnn.reference_block(q, k, v, mask, causal=causal, scale=scale)
    return out, lse.astype(jnp.bfloat16).astype(jnp.float32)


def _own_stats_block_grad(q, k, v, mask, out, lse, d_out, *, causal, scale):
    """The control: the pair's backward from its OWN out and lse (not the ring's global ones)."""
    del out, lse
    own_out, own_lse = ring_cudnn.reference_block(q, k, v, mask, causal=causal, scale=scale)
    return ring_cudnn.reference_block_grad(q, k, v, mask, own_out, own_lse, d_out, causal=causal, scale=scale)


CASES = {  # name: (cp, causal, sliding_window, reorder, sinks, usp's devices a slice or 0: the ring)
    "4-causal": (4, True, 0, "dual_chunk_swap", False, 0),
    "4-striped_causal_window": (4, True, 21, "striped", False, 0),
    "2-bidirectional_sinks": (2, False, 0, "dual_chunk_swap", True, 0),
    "1-causal_window": (1, True, 21, "dual_chunk_swap", False, 0),
    "usp_2x4-causal_window": (8, True, 21, "dual_chunk_swap", False, 2),
    "usp_2x4-striped_causal": (8, True, 0, "striped", False, 2),
    "usp_2x2-bidirectional_sinks": (4, False, 0, "dual_chunk_swap", True, 2),
}


def _compare(case, block, block_grad=None):
    cp, causal, sliding_window, reorder, with_sinks, inner = CASES[case]
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, causal=causal, logits_soft_cap=0.0,
                                    sliding_window=sliding_window)
    out, grads = _ring(cp, q, k, v, segment_ids, weights, sinks, causal=causal, sliding_window=sliding_window,
                       reorder=reorder, block=block, block_grad=block_grad, inner=inner)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL,
                                       err_msg=f"d loss / d {name}")


RING_CASES = [c for c in CASES if not c.startswith("usp")]
USP_CASES = [c for c in CASES if c.startswith("usp")]


# the default run keeps the striped ring with a window (every pair masked by position, 6 s); the causal
# dual_chunk_swap ring (half pairs skipped, 12 s), bidirectional with sinks and the ring of one run with the slow tests
@pytest.mark.parametrize("case", slow_params(RING_CASES, {"4-causal", "2-bidirectional_sinks", "1-causal_window"}))
def test_ring_with_a_cudnn_style_forward_equals_attention_over_the_unsplit_sequence(case):
    _compare(case, ring_cudnn.reference_block)


@pytest.mark.parametrize("case", slow_params(USP_CASES, {"usp_2x4-striped_causal", "usp_2x2-bidirectional_sinks"}))
def test_usp_with_a_cudnn_style_forward_equals_attention_over_the_unsplit_sequence(case):
    """usp's ring across slices with cuDNN's forward contract per pair and the flash backward (interpret mode)."""
    _compare(case, ring_cudnn.reference_block)


@pytest.mark.parametrize("case", slow_params(list(CASES), {"1-causal_window", "usp_2x2-bidirectional_sinks"}))
def test_cudnn_style_forward_and_backward_per_pair_equal_attention_over_the_unsplit_sequence(case):
    """cuDNN's backward contract per pair (reference_block_grad: dq, dk, dv from the global out and lse), inside the
    ring and inside usp's ring."""
    _compare(case, ring_cudnn.reference_block, ring_cudnn.reference_block_grad)


def test_control_a_bfloat16_lse_per_block_is_caught():
    with pytest.raises(AssertionError):
        _compare("4-striped_causal_window", _bf16_lse_block)
    with pytest.raises(AssertionError):
        _compare("usp_2x4-causal_window", _bf16_lse_block, ring_cudnn.reference_block_grad)


@pytest.mark.parametrize("case", ["4-causal", "usp_2x4-causal_window"])
def test_control_a_pair_backward_from_its_own_statistics_is_caught(case):
    with pytest.raises(AssertionError, match="d loss / d"):  # the values are right; the gradients are not
        _compare(case, ring_cudnn.reference_block, _own_stats_block_grad)


def test_cudnn_resolves_inside_the_ring_and_usp_on_gpus_and_the_rest_is_refused_in_one_line():
    resolve = functools.partial(attention.resolve_implementation, platform="gpu", dtype=jnp.bfloat16, head_dim=128,
                                length=32768, context_parallel=8, context_strategy="ring", gpu_present=True,
                                capability="9.0")
    assert resolve("cudnn") == "cudnn"
    assert resolve("autoselected") == "flash"  # cuDNN inside the ring is not measured yet (the module docstring)
    usp_cudnn = resolve("cudnn", context_strategy="usp", context_inner=2, with_reason=True)
    assert usp_cudnn.implementation == "cudnn" and "usp's ring across slices" in usp_cudnn.reason
    assert "cuDNN's backward from the global out and lse" in usp_cudnn.reason  # this jax's is bound (below)
    assert resolve("autoselected", context_strategy="usp", context_inner=2) == "flash"
    for kwargs, words in [({"logits_soft_cap": 30.0}, "logits_soft_cap"), ({"sinks": True}, "sinks"),
                          ({"platform": "cpu"}, "GPU"),
                          ({"context_strategy": "usp", "context_inner": 2, "sinks": True}, "sinks"),
                          ({"context_strategy": "usp", "context_inner": 2, "length": 32776}, "multiple of 64"),
                          ({"context_strategy": "usp", "context_inner": 2, "platform": "cpu"}, "GPU")]:
        with pytest.raises(ValueError, match=words) as err:
            resolve("cudnn", **kwargs)
        assert "\n" not in str(err.value) and "attention=flash" in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="attention=tokamax does not run inside context_parallel_strategy=usp"):
        resolve("tokamax", context_strategy="usp", context_inner=2)


def test_cudnn_backward_binds_the_installed_jax_form_and_anything_else_is_said_in_one_line(monkeypatch):
    """The form is chosen by jax's version (0.10 and 0.11: no score_mod; 0.12: score_mod_args and score_mod), then
    checked against the installed signature; a mismatch or an unread version falls back to the Triton backward, and
    the start-up summary says why."""
    form, why = ring_cudnn.backward_form()
    assert (form, why) == ("0.12" if jax.__version_info__[:2] == (0, 12) else "0.10", "")
    assert ring_cudnn.default_block_grad() is ring_cudnn.cudnn_block_grad

    def module(params):  # a stand-in for jax's cuDNN module whose backward takes `params`
        impl = eval(f"lambda {', '.join(params)}: None")  # pylint: disable=eval-used
        names = ring_cudnn._BWD_NAMES  # pylint: disable=protected-access
        return type("Cudnn", (), {"_dot_product_attention_bwd_impl": staticmethod(impl),
                                  **{name: object() for name in names}})
    assert ring_cudnn.backward_form(module(ring_cudnn.BWD_FORMS["0.12"]), (0, 12, 0)) == ("0.12", "")
    assert ring_cudnn.backward_form(module(ring_cudnn.BWD_FORMS["0.10"]), (0, 11, 2)) == ("0.10", "")
    for version, params, words in [((0, 10, 2), ring_cudnn.BWD_FORMS["0.12"], "not the jax 0.10 form"),
                                   ((0, 12, 0), ring_cudnn.BWD_FORMS["0.10"], "not the jax 0.12 form"),
                                   ((0, 13, 0), ring_cudnn.BWD_FORMS["0.12"], "jax 0.13's private cuDNN backward was "
                                                                              "not read here")]:
        form, why = ring_cudnn.backward_form(module(params), version)
        assert form is None and words in why and "\n" not in why, why

    monkeypatch.setattr(ring_cudnn, "cudnn_backward_unsupported", lambda: "jax 0.13's ... not read here")
    choice = attention.resolve_implementation("cudnn", "gpu", dtype=jnp.bfloat16, head_dim=128, length=32768,
                                              context_parallel=8, context_strategy="ring", with_reason=True)
    assert "the Triton kernel's backward (jax 0.13's ... not read here) from the global out and lse" in choice.reason
    assert ring_cudnn.default_block_grad() is None  # the flash kernel's backward
    monkeypatch.setattr(ring_cudnn, "backward_form", lambda: (None, "jax 0.13's ... not read here"))
    x = jnp.zeros((1, 16, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"inside the ring: jax 0.13's ... not read here; use attention=flash"):
        ring_cudnn.cudnn_block_grad(x, x, x, jnp.ones((1, 16, 16), bool), x, jnp.zeros((1, 2, 16)), x, causal=True,
                                    scale=0.25)


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
