"""The attention kernels under context_parallel_strategy=ulysses (models/attention/ulysses.py): after the all-to-all
each device puts its whole sequences back into the original token order and runs the kernel there. Checked on
simulated CPU devices against the plain-jnp reference over the unsplit sequence (values and gradients), with the
flash kernel in Pallas' interpret mode and tokamax through its XLA reference; and what each strategy accepts,
before compiling (resolve_implementation)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import load_config, with_overrides
from maxtrain.models import attention
from maxtrain.models.attention import context_parallel
from maxtrain.models.model import Model
from maxtrain.parallel import context, sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

B, T, N, G, H = 2, 64, 4, 2, 16
RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]


def _inputs():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, G, G))
    segment_ids = np.zeros((B, T), np.int32)  # documents across the shards' boundaries, then padding (segment 0)
    segment_ids[0, :21], segment_ids[0, 21:40], segment_ids[0, 40:60] = 1, 2, 3
    segment_ids[1, :9], segment_ids[1, 9:47], segment_ids[1, 47:62] = 1, 2, 3
    weights = rng.standard_normal((B, T, N, H)).astype(np.float32)
    sinks = rng.standard_normal((N,)).astype(np.float32)
    return q, k, v, segment_ids, weights, sinks


def _grads(fn, q, k, v, weights, sinks):
    def loss(q, k, v, sinks):
        out = fn(q, k, v, sinks)
        return jnp.sum(out.astype(jnp.float32) * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


CASES = {  # name: (implementation, causal, sliding_window, logits_soft_cap, sinks)
    "flash_causal_window": ("flash", True, 24, 0.0, False),
    "flash_softcap_sinks": ("flash", True, 0, 20.0, True),
    "tokamax_causal": ("tokamax", True, 0, 0.0, False),
}


# The default suite runs each case under one reorder, the slow tests under the other.
@pytest.mark.parametrize("case, reorder", [
    ("flash_causal_window", "dual_chunk_swap"), ("flash_softcap_sinks", "striped"), ("tokamax_causal", "striped"),
    *(pytest.param(c, r, marks=pytest.mark.slow) for c, r in [
        ("flash_causal_window", "striped"), ("flash_softcap_sinks", "dual_chunk_swap"),
        ("tokamax_causal", "dual_chunk_swap")])])
def test_a_kernel_under_ulysses_equals_attention_over_the_unsplit_sequence(case, reorder):
    _check_against_the_unsplit_sequence("ulysses", case, reorder)


@pytest.mark.parametrize("case, reorder, cp", [("flash_causal_window", "dual_chunk_swap", 2),
                                               ("flash_softcap_sinks", "striped", 4)])
def test_flash_under_all_gather_equals_attention_over_the_unsplit_sequence(case, reorder, cp):
    """all_gather with attention=flash (context_parallel.all_gather_flash): the kernel on the device's queries against
    the gathered keys, masked by position; dK and dV reduce-scattered back."""
    _check_against_the_unsplit_sequence("all_gather", case, reorder, cp)


def _check_against_the_unsplit_sequence(strategy, case, reorder, cp=2):
    implementation, causal, window, cap, with_sinks = CASES[case]
    if implementation == "tokamax" and importlib.util.find_spec("tokamax") is None:
        pytest.skip("tokamax is the optional [gpu] extra")
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    options = dict(causal=causal, sliding_window=window, logits_soft_cap=cap)

    def reference(q, k, v, sinks):
        mask = attention.make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=window)
        return attention.dot_product_attention(q, k, v, mask, logits_soft_cap=cap, sinks=sinks)
    ref_out, ref_grads = _grads(reference, q, k, v, weights, sinks)

    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)
    lq, lk, lv, lseg, lweights = context.to_layout((q, k, v, segment_ids, weights), cp, reorder=reorder)

    def split(q, k, v, sinks):
        return attention.attention(q, k, v, lseg, implementation=implementation, platform="cpu", block_q=16,
                                   block_kv=16, interpret=True, sinks=sinks, context_strategy=strategy,
                                   context_reorder=reorder, **options)
    with sharding.activation_sharding(mesh, RULES):
        out, grads = jax.jit(lambda *a: _grads(split, *a))(lq, lk, lv, lweights, sinks)
    np.testing.assert_allclose(np.asarray(context.from_layout(out, cp, reorder=reorder)), np.asarray(ref_out),
                               rtol=2e-5, atol=2e-6)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is None:
            continue
        got = got if name == "sinks" else context.from_layout(got, cp, reorder=reorder)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5, err_msg=f"d loss / d {name}")


def test_the_kernel_runs_where_asked():
    """The control: the compiled program of flash under ulysses holds the kernel's custom call and the all-to-all,
    and no [T, T] scores (the plain-jnp form's are the control)."""
    q, k, v, segment_ids, _, _ = _inputs()
    mesh = sharding.mesh_of(jax.devices()[:2], context=2)

    def text(implementation):
        def fn(q, k, v):
            return attention.attention(q, k, v, segment_ids, implementation=implementation, platform="cpu",
                                       block_q=16, block_kv=16, interpret=True, context_strategy="ulysses")
        with sharding.activation_sharding(mesh, RULES):
            return jax.jit(fn).lower(q, k, v).as_text()
    flash, plain = text("flash"), text("dot_product")
    assert "all_to_all" in flash and "all_to_all" in plain
    scores = f"{T}x{T}xf32"
    assert scores in plain and scores not in flash


def test_under_all_gather_flash_runs_when_set_and_autoselected_keeps_the_plain_form():
    gather = dict(dtype=jnp.bfloat16, head_dim=128, context_parallel=2, context_strategy="all_gather")
    assert attention.resolve_implementation("flash", "gpu", **gather) == "flash"
    assert attention.resolve_implementation("autoselected", "gpu", **gather) == "dot_product"
    assert attention.resolve_implementation("flash", "tpu", **gather) == "flash"  # splash: all_gather_splash.py
    with pytest.raises(ValueError, match=r"attention=cudnn does not run with context_parallel_strategy=all_gather "
                                         r"\(2 ways\).*or context_parallel_strategy=ring or ulysses or usp\."):
        attention.resolve_implementation("cudnn", "gpu", **gather)


def test_under_usp_flash_runs_the_rings_block_pairs_on_gpus_and_splash_on_tpus():
    usp = dict(dtype=jnp.bfloat16, head_dim=128, length=8192, context_parallel=4, context_strategy="usp",
               context_inner=2)
    assert attention.resolve_implementation("flash", "gpu", **usp) == "flash"
    assert attention.resolve_implementation("autoselected", "gpu", **usp) == "flash"
    assert attention.resolve_implementation("autoselected", "cpu", **usp) == "dot_product"
    assert attention.resolve_implementation("flash", "tpu", **usp) == "flash"  # splash: test_context_usp_splash.py
    assert attention.resolve_implementation("autoselected", "tpu", **usp) == "flash"
    odd = {**usp, "length": 8200}  # 4,100 tokens a slice: not a multiple of 16
    with pytest.raises(ValueError, match=r"max_target_length=8200 must be a multiple of 32"):
        attention.resolve_implementation("flash", "gpu", **odd)
    choice = attention.resolve_implementation("autoselected", "gpu", with_reason=True, **odd)
    assert choice.implementation == "dot_product" and "multiple of 32" in choice.reason
    assert attention.resolve_implementation("cudnn", "gpu", **usp) == "cudnn"  # ring_cudnn.py inside usp's ring
    with pytest.raises(ValueError, match=r"attention=tokamax does not run inside context_parallel_strategy=usp's ring"):
        attention.resolve_implementation("tokamax", "gpu", **usp)


def test_under_ulysses_autoselected_chooses_as_without_context_parallelism():
    shape = dict(dtype=jnp.bfloat16, head_dim=128, length=8192)
    assert (attention.resolve_implementation("autoselected", "gpu", context_parallel=4, context_strategy="ulysses",
                                             **shape)
            == attention.resolve_implementation("autoselected", "gpu", **shape) != "dot_product")
    assert attention.resolve_implementation("flash", "tpu", context_parallel=4, context_strategy="ulysses",
                                            **shape) == "flash"


def test_the_dispatch_refuses_a_kernel_for_the_plain_strategies():
    """The backstop behind resolve_implementation: context_parallel.attention itself says what to do."""
    with pytest.raises(ValueError, match="context_parallel_strategy=all_gather runs the flash kernel .* not this kernel"):
        context_parallel.attention(*(jnp.zeros((1, 8, 2, 4)),) * 3, jnp.ones((1, 8), jnp.int32),
                                   strategy="all_gather", kernel=lambda *a: a[0])


def _tiny_llama_loss(n_devices: int, *overrides):
    """A tiny Llama's mean loss and gradients on one packed batch (as test_context_ring.py's)."""
    argv = with_overrides([BASE_YML, *TINY], f"per_device_batch_size={GLOBAL_BATCH // n_devices}",
                          "ici_fsdp_parallelism=1", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, _ = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return loss / weight
        loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    return run.rt.attention, float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ulysses", "all_gather"])
def test_tiny_llama_with_flash_under_the_strategy_gives_the_loss_and_gradients_of_one_device(strategy):
    implementation, loss, grads = _tiny_llama_loss(2, "ici_context_parallelism=2",
                                                   f"context_parallel_strategy={strategy}", "attention=flash",
                                                   "sa_block_q=16", "sa_block_kv=16")
    _, ref_loss, ref_grads = _tiny_llama_loss(1, "attention=dot_product")
    assert implementation == "flash"
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(ref_grads)[0], jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
