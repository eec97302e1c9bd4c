"""Ring attention with the flash kernel per block (models/attention/ring_flash.py), Pallas interpret mode on 8
simulated CPU devices, against the plain-jnp reference attention over the unsplit sequence on one device.

The sequence is put into the dual_chunk_swap layout, split over CP 2 or 4 devices, attends through the ring with the
flash kernel (causal block skipping: after its own block each device runs half of each block pair), is taken back to
the original order and compared with dot_product_attention under make_attention_mask: values, and the gradients of
a fixed weighted sum with respect to q, k, v (and the sinks). Rows are packed (three documents, then padding).
Windows and the striped layout go through the kernel's positions operands. T = 128 tokens: 16-token chunks at CP 4,
the kernel's smallest block. Tolerances as test_context_ring.py (float32 sums in another order); a pair of chunks
skipped or taken wrongly moves values at the 1e-2 level. Also: the kernel calls' shapes (half of each other block
pair under causal dual_chunk_swap), the TPU form (ring_splash.py, splash in Pallas' TPU interpreter), a tiny Llama's
loss and gradients against one device's dot_product, and what resolve_implementation lets through or refuses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain.config import load_config, with_overrides
from maxtrain.models import attention
from maxtrain.models.model import Model
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches
from maxtrain.models.attention import ring_flash, ring_splash
from maxtrain.parallel import context, sharding

B, T, N, G, H = 1, 128, 4, 2, 16
RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]
RTOL, ATOL = 2e-5, 2e-6


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, G, G))
    segment_ids = np.zeros((B, T), np.int32)  # three documents, then padding (segment 0)
    segment_ids[0, :40], segment_ids[0, 40:77], segment_ids[0, 77:120] = 1, 2, 3
    weights = rng.standard_normal((B, T, N, H)).astype(np.float32)
    sinks = rng.standard_normal((N,)).astype(np.float32)
    return q, k, v, segment_ids, weights, sinks


def _reference(q, k, v, segment_ids, weights, sinks, *, causal, logits_soft_cap, sliding_window):
    def loss(q, k, v, sinks):
        mask = attention.make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
        out = attention.dot_product_attention(q, k, v, mask, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return jnp.sum(out * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


def _ring(cp, q, k, v, segment_ids, weights, sinks, *, causal, logits_soft_cap, sliding_window, reorder, tensor=1):
    mesh = sharding.mesh_of(jax.devices()[:cp * tensor], context=cp, tensor=tensor)
    q, k, v, segment_ids, weights = context.to_layout((q, k, v, segment_ids, weights), cp, reorder=reorder)

    def loss(q, k, v, sinks):
        out = ring_flash.ring_flash_attention(q, k, v, segment_ids, reorder=reorder, causal=causal,
                                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                              sinks=sinks, interpret=True, block_q=16, block_k=16)
        return jnp.sum(out * weights), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    back = functools.partial(context.from_layout, cp=cp, reorder=reorder)
    return back(out), [back(g) for g in grads[:3]] + [grads[3]]


CASES = {  # name: (causal, logits_soft_cap, sinks, tensor, sliding_window, reorder)
    "causal": (True, 0.0, False, 1, 0, "dual_chunk_swap"),
    "causal_softcap_sinks": (True, 5.0, True, 1, 0, "dual_chunk_swap"),
    "bidirectional_heads_split": (False, 0.0, True, 2, 0, "dual_chunk_swap"),
    "causal_window": (True, 0.0, False, 1, 21, "dual_chunk_swap"),
    "striped_causal_window_sinks": (True, 0.0, True, 1, 21, "striped"),
    "striped_causal_softcap": (True, 5.0, False, 1, 0, "striped"),
}


@pytest.mark.parametrize("cp, case", slow_params([(cp, case) for cp in (2, 4) for case in CASES],
                                                  {f"{cp}-{case}" for cp in (2, 4) for case in CASES}
                                                  - {"4-causal_softcap_sinks"},
                                                  ids=[f"{cp}-{case}" for cp in (2, 4) for case in CASES]))
def test_ring_with_the_flash_kernel_equals_attention_over_the_unsplit_sequence(cp, case):
    causal, logits_soft_cap, with_sinks, tensor, sliding_window, reorder = CASES[case]
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    kwargs = dict(causal=causal, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, **kwargs)
    out, grads = _ring(cp, q, k, v, segment_ids, weights, sinks, tensor=tensor, reorder=reorder, **kwargs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL,
                                       err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("case", ["causal_softcap_sinks", "striped_causal_window_sinks"])
def test_a_ring_of_one_device_attends_its_own_block_once(case):
    """scripts/gpu_ring_check.py runs the ring on one GPU: with no other block to pass, the own block must not be
    merged a second time (the ring's last step assumed two devices or more)."""
    causal, logits_soft_cap, _, _, sliding_window, reorder = CASES[case]
    q, k, v, segment_ids, weights, sinks = _inputs()
    kwargs = dict(causal=causal, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, **kwargs)
    out, grads = _ring(1, q, k, v, segment_ids, weights, sinks, reorder=reorder, **kwargs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL, err_msg=f"d loss / d {name}")


# --------------------------------------------------------------------------------------------
# A tiny Llama: loss and gradients with attention=flash inside the ring equal dot_product's on one device
# --------------------------------------------------------------------------------------------


def _loss_and_grads(n_devices: int, *overrides):
    argv = with_overrides([BASE_YML, *TINY], "max_target_length=64",
                          f"per_device_batch_size={GLOBAL_BATCH // n_devices}",
                          "ici_fsdp_parallelism=1", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))  # [B, T]: two packed documents a row
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, _ = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return loss / weight
        step = jax.jit(jax.value_and_grad(mean_loss))
        kernels = str(jax.make_jaxpr(step)(params)).count("flash_attention_fwd")  # Pallas calls, by name
        loss, grads = step(params)
    return float(loss), jax.tree.map(np.asarray, grads), kernels, run.rt.attention


@pytest.mark.slow
def test_tiny_llama_with_flash_inside_the_ring_gives_the_loss_and_gradients_of_one_device():
    one_device = _loss_and_grads(1, "attention=dot_product")
    split = _loss_and_grads(2, "attention=flash", "ici_context_parallelism=2", "context_parallel_strategy=ring")
    assert (split[3], one_device[3]) == ("flash", "dot_product") and split[2] > 0 and one_device[2] == 0
    assert split[0] == pytest.approx(one_device[0], rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(one_device[1])[0], jax.tree.leaves(split[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_flash_resolves_inside_the_ring_and_the_rest_is_refused_in_one_line():
    ring = dict(context_parallel=2, context_strategy="ring", head_dim=16)
    assert attention.resolve_implementation("flash", "gpu", **ring) == "flash"
    assert attention.resolve_implementation("flash", "cpu", **ring) == "flash"
    assert attention.resolve_implementation("flash", "gpu", sliding_window=8, context_reorder="striped",
                                            **ring) == "flash"
    assert attention.resolve_implementation("flash", "tpu", length=1024, **ring) == "flash"
    refusals = {  # (name, platform, extra settings): what the line must say
        ("flash", "tpu", ("context_reorder", "striped")): r"on TPUs \(the splash kernel\) runs dual_chunk_swap "
                                                         r"without a sliding window only",
        ("flash", "tpu", ("length", 768)): r"max_target_length=768 must be a multiple of 512",
        ("tokamax", "gpu", ()): r"attention=tokamax does not run inside context_parallel_strategy=ring.*use "
                                r"attention=flash",
    }
    for (name, platform, extra), message in refusals.items():
        with pytest.raises(ValueError, match=message):
            attention.resolve_implementation(name, platform, **{**ring, **dict([extra] if extra else [])})


@pytest.mark.slow
def test_ring_with_the_splash_kernel_equals_attention_over_the_unsplit_sequence():
    """The TPU form (ring_splash.py) in Pallas' TPU interpreter: CP 2, 512 tokens (chunks of 128, the lanes), packed,
    soft-capped, with sinks."""
    rng = np.random.default_rng(1)
    t, n, g = 512, 2, 1
    q, k, v = (rng.standard_normal((1, t, heads, H)).astype(np.float32) for heads in (n, g, g))
    segment_ids = np.ones((1, t), np.int32)
    segment_ids[0, 170:], segment_ids[0, 490:] = 2, 0
    weights = rng.standard_normal((1, t, n, H)).astype(np.float32)
    sinks = rng.standard_normal((n,)).astype(np.float32)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, causal=True, logits_soft_cap=5.0,
                                    sliding_window=0)
    mesh = sharding.mesh_of(jax.devices()[:2], context=2)
    ql, kl, vl, sl, wl = context.to_layout((q, k, v, segment_ids, weights), 2)

    def loss(q, k, v, sinks):
        out = ring_splash.ring_splash_attention(q, k, v, sl, logits_soft_cap=5.0, sinks=sinks, interpret=True)
        return jnp.sum(out * wl), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(ql, kl, vl, sinks)
    np.testing.assert_allclose(np.asarray(context.from_layout(out, 2)), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v"), grads[:3], ref_grads[:3]):
        np.testing.assert_allclose(np.asarray(context.from_layout(got, 2)), np.asarray(ref), rtol=RTOL, atol=1e-5,
                                   err_msg=f"d loss / d {name}")
    np.testing.assert_allclose(np.asarray(grads[3]), np.asarray(ref_grads[3]), rtol=RTOL, atol=1e-5)


def _forward_kernel_calls(jaxpr):
    """(q length, k length) of every forward flash kernel call (a Pallas call giving out and lse [B, N, T]) in a
    jaxpr, sub-jaxprs (shard_map, custom VJP, scan, cond) included."""
    found = []
    for eqn in jaxpr.eqns:
        outs = eqn.params.get("out_avals", ())
        if eqn.primitive.name == "pallas_call" and len(outs) == 2 and len(outs[1].shape) == 3:
            found.append((eqn.invars[0].aval.shape[1], eqn.invars[1].aval.shape[1]))
            continue
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _forward_kernel_calls(inner)
    return found


def test_after_its_own_block_each_device_runs_half_of_each_block_pair():
    """Causal dual_chunk_swap at CP 4 (32 tokens a device, chunks of 16): the forward's kernel calls are the own block
    (32 x 32, causal) and, in the two branches of the ring step, 32 queries x 16 keys and 16 x 32: never a whole
    32 x 32 pair of another device's block. Striped has no skipping: its ring step calls 32 x 32."""
    q, k, v, segment_ids, _, _ = _inputs()
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:4], context=4), RULES):
        calls = {reorder: _forward_kernel_calls(jax.make_jaxpr(lambda q, k, v: ring_flash.ring_flash_attention(
            q, k, v, segment_ids, reorder=reorder, interpret=True, block_q=16, block_k=16))(q, k, v).jaxpr)
            for reorder in ("dual_chunk_swap", "striped")}
    # the own block once; the other blocks' steps (in the loop, and the last one after it) only halves
    assert sorted(set(calls["dual_chunk_swap"])) == [(16, 32), (32, 16), (32, 32)]
    assert calls["dual_chunk_swap"].count((32, 32)) == 1
    assert set(calls["striped"]) == {(32, 32)} and len(calls["striped"]) >= 2
