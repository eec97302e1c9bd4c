"""Ring and ulysses attention (context_parallel_strategy) on 8 simulated CPU devices against unsplit attention.

At the attention level: the sequence put into a reorder strategy's layout (dual_chunk_swap, striped), split over
CP 2 or 4 devices, attends with models/attention/ring.py (or ulysses.py at CP 2), is taken back to the original
order and compared with the plain-jnp reference (dot_product_attention with make_attention_mask) on one device:
values, and the gradients of a fixed weighted sum with respect to q, k and v. The rows are packed (three documents, then padding) and the
masks causal, windowed, soft-capped or with sinks (whose gradient is compared too). The ring's compiled program
holds one block at a time, forward and backward. At the model level: a tiny Llama's loss and gradients with the
ring (both reorders) and with ulysses equal the all_gather strategy's and one device's.

Tolerances: float32 sums in another order (online softmax against one softmax): measured differences ~1e-7;
a wrong mask (a block's indices off by one device, a window of the wrong side) moves values at the 1e-2 level.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import load_config, with_overrides
from maxtrain.models import attention
from maxtrain.models.attention import context_parallel, ring, ulysses
from maxtrain.models.model import Model
from maxtrain.parallel import context, sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

B, T, N, G, H = 2, 32, 4, 2, 16
RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]
RTOL, ATOL = 1e-5, 1e-6


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, G, G))
    segment_ids = np.zeros((B, T), np.int32)  # three documents, then padding (segment 0)
    segment_ids[0, :11], segment_ids[0, 11:20], segment_ids[0, 20:29] = 1, 2, 3
    segment_ids[1, :5], segment_ids[1, 5:23], segment_ids[1, 23:30] = 1, 2, 3
    weights = rng.standard_normal((B, T, N, H)).astype(np.float32)  # the loss whose gradients are compared
    sinks = rng.standard_normal((N,)).astype(np.float32)
    return q, k, v, segment_ids, weights, sinks


def _reference(q, k, v, segment_ids, weights, sinks, *, causal, sliding_window, logits_soft_cap):
    def loss(q, k, v, sinks):
        mask = attention.make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
        out = attention.dot_product_attention(q, k, v, mask, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return jnp.sum(out * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


STRATEGIES = {"ring": ring.ring_attention, "ulysses": ulysses.ulysses_attention}


def _split(strategy, cp, tensor, reorder, q, k, v, segment_ids, weights, sinks, *, causal, sliding_window,
           logits_soft_cap):
    """The same loss with the sequence in the layout, split over cp devices (and the heads over `tensor`)."""
    mesh = sharding.mesh_of(jax.devices()[:cp * tensor], context=cp, tensor=tensor)
    q, k, v, segment_ids, weights = context.to_layout((q, k, v, segment_ids, weights), cp, reorder=reorder)

    def loss(q, k, v, sinks):
        out = STRATEGIES[strategy](q, k, v, segment_ids, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, sinks=sinks)
        return jnp.sum(out * weights), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return (context.from_layout(out, cp, reorder=reorder),
            [context.from_layout(g, cp, reorder=reorder) for g in grads[:3]] + [grads[3]])


MASKS = {  # name: (causal, sliding_window, logits_soft_cap, sinks)
    "causal": (True, 0, 0.0, False),
    "causal_window": (True, 6, 0.0, False),
}
EXTRA = {
    "bidirectional_window_softcap_sinks": (False, 6, 5.0, True),
}


def _check(strategy, cp, tensor, reorder, mask):
    causal, sliding_window, logits_soft_cap, with_sinks = {**MASKS, **EXTRA}[mask]
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    kwargs = dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, **kwargs)
    out, grads = _split(strategy, cp, tensor, reorder, q, k, v, segment_ids, weights, sinks, **kwargs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is None:  # no sinks
            continue
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("reorder", context.REORDER_STRATEGIES)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_attention_over_the_unsplit_sequence(cp, reorder, mask):
    _check("ring", cp, 1, reorder, mask)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_sinks_and_soft_cap_without_causality(strategy):
    """The ring with the heads split over tensor 2 too; ulysses at CP 2 (G = 2 kv heads split no further)."""
    cp, tensor = (4, 2) if strategy == "ring" else (2, 1)
    _check(strategy, cp, tensor, "dual_chunk_swap", "bidirectional_window_softcap_sinks")


@pytest.mark.parametrize("reorder", context.REORDER_STRATEGIES)
def test_ulysses_attention_equals_attention_over_the_unsplit_sequence(reorder):
    _check("ulysses", 2, 1, reorder, "causal_window")


def test_ulysses_refuses_heads_that_do_not_split_over_the_group():
    q, k, v, segment_ids, _, _ = _inputs()  # N = 4 query heads, G = 2 kv heads: not over 4 devices
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:4], context=4), RULES):
        with pytest.raises(ValueError, match=r"query heads \(4\) and kv heads \(2\) per device must be multiples "
                                             r"of 4"):
            ulysses.ulysses_attention(q, k, v, segment_ids)


@pytest.mark.parametrize("reorder", context.REORDER_STRATEGIES)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_each_reorder_is_a_permutation_that_balances_the_causal_work(cp, reorder):
    order = context.layout(64, cp, reorder)
    tokens = np.arange(64)[None]
    assert sorted(order) == list(range(64))
    np.testing.assert_array_equal(context.from_layout(context.to_layout(tokens, cp, reorder=reorder), cp,
                                                      reorder=reorder), tokens)
    work = (order + 1).reshape(cp, -1).sum(axis=1)  # causal (query, key) pairs per device: query t sees t + 1 keys
    # striped: a query of device i sees i keys more than the same-row query of device 0
    assert work.max() - work.min() == (0 if reorder == "dual_chunk_swap" else (cp - 1) * (64 // cp))


def test_a_mask_of_the_wrong_layout_would_be_seen():
    """The control: ring attention told the wrong layout (striped tokens, dual_chunk_swap's indices) is far off."""
    q, k, v, segment_ids, weights, _ = _inputs()
    ref_out, _ = _reference(q, k, v, segment_ids, weights, None, causal=True, sliding_window=0, logits_soft_cap=0.0)
    mesh = sharding.mesh_of(jax.devices()[:4], context=4)
    q, k, v, segment_ids = context.to_layout((q, k, v, segment_ids), 4, reorder="striped")
    with sharding.activation_sharding(mesh, RULES):
        out = jax.jit(functools.partial(ring.ring_attention, reorder="dual_chunk_swap"))(q, k, v, segment_ids)
    out = context.from_layout(out, 4, reorder="striped")
    assert np.max(np.abs(np.asarray(out) - np.asarray(ref_out))) > 1e-2


def _largest_float_array(fn, cp, length):
    """The element count of the largest float32 array of fn's compiled per-device program (forward and gradient)
    at `length` tokens split over cp devices."""
    q, k, _, _, _, _ = _inputs()
    q, k = np.resize(q, (B, length, N, H)), np.resize(k, (B, length, G, H))
    segment_ids = np.ones((B, length), np.int32)
    step = jax.value_and_grad(lambda q, k, v, segment_ids: jnp.sum(fn(q, k, v, segment_ids)), argnums=(0, 1, 2))
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:cp], context=cp), RULES):
        text = jax.jit(step).lower(q, k, k, segment_ids).compile().as_text()
    return max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"f32\[([0-9,]*)\]", text))


def test_the_ring_holds_one_block_at_a_time_forward_and_backward():
    """At T = 96 over 4 devices (24 tokens each) no float array of the ring's forward and backward program is larger
    than one block pair's scores, [B, 24, N, 24]: neither the whole sequence's keys nor every step's blocks (JAX's
    autodiff of the scan kept those: 3 x that, measured). all_gather's scores against every key are the control."""
    block_scores = B * (96 // 4) ** 2 * N
    assert _largest_float_array(ring.ring_attention, 4, 96) <= block_scores
    assert _largest_float_array(context_parallel.context_parallel_attention, 4, 96) >= B * (96 // 4) * 96 * N


# --------------------------------------------------------------------------------------------
# A tiny Llama: loss and gradients with the ring equal the all_gather strategy's and one device's
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _loss_and_grads(n_devices: int, *overrides):
    argv = with_overrides([BASE_YML, *TINY], f"per_device_batch_size={GLOBAL_BATCH // n_devices}", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))  # [B, T]: two packed documents a row
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, _ = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return loss / weight
        step = jax.jit(jax.value_and_grad(mean_loss))
        text = step.lower(params).as_text()
        collectives = " ".join(c for c in ("collective_permute", "all_to_all") if c in text)
        loss, grads = step(params)
    return float(loss), jax.tree.map(np.asarray, grads), collectives


def test_the_summary_says_the_strategy_and_the_reorder():
    argv = with_overrides([BASE_YML, *TINY], "per_device_batch_size=4", "ici_context_parallelism=2",
                          "ici_fsdp_parallelism=1", "context_parallel_strategy=ring",
                          "context_parallel_reorder_strategy=striped")
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:2]))
    assert builder.parallelism_lines(run) == [
        "context: each sequence split 2 ways (striped: token t on device t mod 2, causal work balanced); attention "
        "ring: keys and values passed around the ring (ppermute), the softmax merged online"]


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(b[1])[0], jax.tree.leaves(a[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("strategy, reorder", [  # the default run keeps one; the rest run with the slow tests
    ("ring", "dual_chunk_swap"), pytest.param("ring", "striped", marks=pytest.mark.slow),
    pytest.param("ulysses", "dual_chunk_swap", marks=pytest.mark.slow)])
def test_tiny_llama_with_the_strategy_gives_the_loss_and_gradients_of_all_gather_and_one_device(strategy, reorder):
    cp = ("ici_context_parallelism=2", "ici_fsdp_parallelism=1",
          f"context_parallel_reorder_strategy={reorder}")
    one_device = _loss_and_grads(1, "ici_fsdp_parallelism=1")
    gathered = _loss_and_grads(2, *cp, "context_parallel_strategy=all_gather")
    split = _loss_and_grads(2, *cp, f"context_parallel_strategy={strategy}")
    collective = {"ring": "collective_permute", "ulysses": "all_to_all"}[strategy]
    assert collective in split[2] and collective not in gathered[2] + one_device[2]  # it ran where asked, only there
    _assert_same(split, gathered)
    _assert_same(split, one_device)


# --------------------------------------------------------------------------------------------
# Long context: past ring.QUERY_CHUNK queries a device attends each block in pieces of its queries
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reorder, mask", [("dual_chunk_swap", "causal_window"), ("striped", "causal"),
                                           ("dual_chunk_swap", "bidirectional_window_softcap_sinks")])
def test_the_ring_in_query_pieces_equals_attention_over_the_unsplit_sequence(monkeypatch, reorder, mask):
    monkeypatch.setattr(ring, "QUERY_CHUNK", 4)  # 16 queries a device at CP 2: 4 pieces of 4
    assert ring.query_pieces(T // 2) == 4
    _check("ring", 2, 1, reorder, mask)


def test_query_pieces_hold_less_than_a_block_pair_of_scores_forward_and_backward(monkeypatch):
    """At T = 96 over 4 devices (24 queries each) the whole block pair's scores [B, 24, N, 24] are the ring's largest
    float array; in pieces of 8 queries its largest is smaller (the device's own q, [B, 24, N, H])."""
    block_scores = B * (96 // 4) ** 2 * N
    assert _largest_float_array(ring.ring_attention, 4, 96) == block_scores
    monkeypatch.setattr(ring, "QUERY_CHUNK", 8)
    assert ring.query_pieces(96 // 4) == 3 and ring.query_pieces(8) == 1 and ring.query_pieces(4096) == 512
    assert _largest_float_array(ring.ring_attention, 4, 96) < block_scores
