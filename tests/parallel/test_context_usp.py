"""usp (ulysses inside a slice, the ring across slices), MLA and chunked attention under context parallelism, on
8 simulated CPU devices against unsplit attention and one device.

At the attention level (as tests/parallel/test_context_ring.py): the sequence in a reorder's layout, split over
C = outer x inner devices of the context axis, attends with models/attention/usp.py, is taken back to the original
order and compared with the plain-jnp reference on one device: values, and the gradients of a fixed weighted sum
with respect to q, k, v (and the sinks). At the model level, on the mesh the config builds from num_slices=2 (two
simulated slices), dcn_context_parallelism=2 and ici_context_parallelism=2: a tiny Llama's loss and gradients with
usp equal all_gather's and one device's, and its compiled program's all-to-alls stay inside a slice while its
collective-permutes cross them. A tiny DeepSeek (MLA: value head dim 10, key head dim 12) under ring and ulysses,
and a tiny Llama 4 with chunked layers under every strategy, equal all_gather and one device; chunked attention with
the flash kernel (interpret mode) under ulysses equals the unsplit reference.

Tolerances as test_context_ring.py's: float32 sums in another order, ~1e-7 measured; a wrong mask moves values at
the 1e-2 level.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import load_config, with_overrides
from maxtrain.models.attention import usp
from maxtrain.parallel import context, sharding
from maxtrain.training import builder
from test_context_ring import ATOL, RTOL, RULES, _assert_same, _inputs, _loss_and_grads, _reference

FLASH_RTOL, FLASH_ATOL = 2e-5, 2e-6  # as test_context_ring_flash.py's: the kernel's float32 sums in its own order
MASKS = {  # name: (causal, sliding_window, logits_soft_cap, sinks)
    "causal": (True, 0, 0.0, False),
    "causal_window": (True, 6, 0.0, False),
    "bidirectional_window_softcap_sinks": (False, 6, 5.0, True),
}


def _usp_split(inner, outer, reorder, q, k, v, segment_ids, weights, sinks, **kwargs):
    cp = inner * outer
    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)  # the context axis slice-major, as create_mesh's
    q, k, v, segment_ids, weights = context.to_layout((q, k, v, segment_ids, weights), cp, reorder=reorder)

    def loss(q, k, v, sinks):
        out = usp.usp_attention(q, k, v, segment_ids, inner=inner, reorder=reorder, sinks=sinks, **kwargs)
        return jnp.sum(out * weights), out
    with sharding.activation_sharding(mesh, RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return (context.from_layout(out, cp, reorder=reorder),
            [context.from_layout(g, cp, reorder=reorder) for g in grads[:3]] + [grads[3]])


@pytest.mark.parametrize("inner, outer, reorder, mask", [
    (2, 2, "dual_chunk_swap", "causal"), (2, 2, "striped", "causal_window"), (2, 4, "dual_chunk_swap", "causal_window"),
    (2, 2, "dual_chunk_swap", "bidirectional_window_softcap_sinks")])
def test_usp_attention_equals_attention_over_the_unsplit_sequence(inner, outer, reorder, mask):
    causal, sliding_window, logits_soft_cap, with_sinks = MASKS[mask]
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    kwargs = dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, **kwargs)
    out, grads = _usp_split(inner, outer, reorder, q, k, v, segment_ids, weights, sinks, **kwargs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=RTOL, atol=ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL,
                                       err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("reorder, mask", [("dual_chunk_swap", "causal"), ("striped", "causal_window"),
                                           ("dual_chunk_swap", "bidirectional_window_softcap_sinks")])
def test_usp_with_the_flash_kernel_per_block_pair_equals_attention_over_the_unsplit_sequence(reorder, mask):
    """The ring across slices with the flash kernel (interpret mode) per block pair, masking by the tokens'
    original indices: 2 slices x 2 devices, values and gradients."""
    causal, sliding_window, logits_soft_cap, with_sinks = MASKS[mask]
    q, k, v, segment_ids, weights, sinks = _inputs()
    sinks = sinks if with_sinks else None
    kwargs = dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    ref_out, ref_grads = _reference(q, k, v, segment_ids, weights, sinks, **kwargs)
    out, grads = _usp_split(2, 2, reorder, q, k, v, segment_ids, weights, sinks, **kwargs,
                            flash={"interpret": True, "block_q": 16, "block_k": 16})
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=FLASH_RTOL, atol=FLASH_ATOL)
    for name, got, ref in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        if ref is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=FLASH_RTOL, atol=FLASH_ATOL,
                                       err_msg=f"d loss / d {name}")


def test_usp_told_the_wrong_layout_would_be_seen():
    """The control: usp over 2 x 4 devices told the wrong layout (dual_chunk_swap tokens, striped indices) is far off."""
    q, k, v, segment_ids, weights, _ = _inputs()
    ref_out, _ = _reference(q, k, v, segment_ids, weights, None, causal=True, sliding_window=0, logits_soft_cap=0.0)
    q, k, v, segment_ids = context.to_layout((q, k, v, segment_ids), 8)
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:8], context=8), RULES):
        out = jax.jit(lambda *a: usp.usp_attention(*a, inner=2, reorder="striped"))(q, k, v, segment_ids)
    assert np.max(np.abs(np.asarray(context.from_layout(out, 8)) - np.asarray(ref_out))) > 1e-2


def test_usp_refuses_heads_that_do_not_split_inside_a_slice_and_a_single_level():
    q, k, v, segment_ids, _, _ = _inputs()  # N = 4 query heads, G = 2 kv heads: not over 4 devices of a slice
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:8], context=8), RULES):
        with pytest.raises(ValueError, match=r"splits the heads 4 ways inside each slice: query heads \(4\) and kv "
                                             r"heads \(2\) per device must be multiples of 4"):
            usp.usp_attention(q, k, v, segment_ids, inner=4)
        with pytest.raises(ValueError, match=r"with one context level use context_parallel_strategy=ring or ulysses"):
            usp.usp_attention(q, k, v, segment_ids, inner=8)


# --------------------------------------------------------------------------------------------
# Tiny models: usp on two simulated slices; MLA under ring and ulysses; chunked attention under every strategy
# --------------------------------------------------------------------------------------------

USP = ("ici_context_parallelism=2", "dcn_context_parallelism=2", "num_slices=2", "ici_fsdp_parallelism=1",
       "dcn_data_parallelism=1")


@pytest.mark.slow
def test_usp_mesh_keeps_the_all_to_all_inside_a_slice_and_the_ring_across():
    """On 4 devices in 2 simulated slices (devices 0, 1 and 2, 3) the compiled step's all-to-alls group the devices
    of a slice and its collective-permutes pair each device with the same device of the other slice."""
    argv = with_overrides([BASE_YML, *TINY], "per_device_batch_size=2", *USP, "context_parallel_strategy=usp")
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:4]))
    assert [d.id for d in run.mesh.devices.flat] == [0, 1, 2, 3]
    assert "the ring across the 2 slices" in builder.parallelism_lines(run)[0]
    loss, _, collectives = _loss_and_grads(4, *USP, "context_parallel_strategy=usp")
    assert collectives == "collective_permute all_to_all"
    text = _compiled_text(USP + ("context_parallel_strategy=usp",))
    groups = set(re.findall(r"all-to-all\(.*?replica_groups=(\{[{}0-9,]*\})", text))
    pairs = set(re.findall(r"collective-permute\(.*?source_target_pairs=(\{[{}0-9,]*\})", text))
    assert groups == {"{{0,1},{2,3}}"}, groups
    assert pairs == {"{{0,2},{1,3},{2,0},{3,1}}"}, pairs


def _compiled_text(overrides):
    argv = with_overrides([BASE_YML, *TINY], "per_device_batch_size=2", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:4]))
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from sharded_batches import batches  # pylint: disable=import-outside-toplevel
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)
        step = jax.jit(jax.grad(lambda p: Model.bind(run.config).loss_fn(p, batch, run.rt)[0]))
        return step.lower(params).compile().as_text()


@pytest.mark.slow
def test_tiny_llama_with_usp_gives_the_loss_and_gradients_of_all_gather_and_one_device():
    one_device = _loss_and_grads(1, "ici_fsdp_parallelism=1")
    gathered = _loss_and_grads(4, *USP, "context_parallel_strategy=all_gather")
    split = _loss_and_grads(4, *USP, "context_parallel_strategy=usp")
    _assert_same(split, gathered)
    _assert_same(split, one_device)


@pytest.mark.slow
def test_tiny_llama_with_usp_and_the_flash_kernel_gives_the_loss_and_gradients_of_one_device():
    """attention=flash with usp (interpret mode on CPU): the model path takes the kernel per block pair of the ring
    across the 2 slices, and equals one device."""
    one_device = _loss_and_grads(1, "ici_fsdp_parallelism=1")
    split = _loss_and_grads(4, *USP, "context_parallel_strategy=usp", "attention=flash", "sa_block_q=16",
                            "sa_block_kv=16")
    _assert_same(split, one_device)
    argv = with_overrides([BASE_YML, *TINY], "per_device_batch_size=2", *USP, "context_parallel_strategy=usp",
                          "attention=flash", "sa_block_q=16", "sa_block_kv=16")
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:4]))
    assert run.rt.attention == "flash"
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from sharded_batches import batches  # pylint: disable=import-outside-toplevel
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: Model.bind(run.config).loss_fn(p, batch, run.rt)[0]))(params))
    # the ring's calls mask by position (a slice's tokens are its devices' pieces): every block visited
    assert jaxpr.count("flash_attention_fwd_every_block") > 0 and "flash_attention_dkv_every_block" in jaxpr


DEEPSEEK = ("decoder_block=deepseek", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
            "first_num_dense_layers=1", "shared_experts=1", "base_num_query_heads=4", "base_num_kv_heads=4",
            "q_lora_rank=24", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=4", "head_dim=12",
            "v_head_dim=10", "load_balance_loss_weight=0")  # MLA: value head dim 10, key head dim 12
CP2 = ("ici_context_parallelism=2", "ici_fsdp_parallelism=1")
COLLECTIVE = {"ring": "collective_permute", "ulysses": "all_to_all"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_tiny_deepseek_mla_with_the_strategy_gives_the_loss_and_gradients_of_all_gather_and_one_device(strategy):
    one_device = _loss_and_grads(1, *DEEPSEEK, "ici_fsdp_parallelism=1")
    gathered = _loss_and_grads(2, *DEEPSEEK, *CP2, "context_parallel_strategy=all_gather")
    split = _loss_and_grads(2, *DEEPSEEK, *CP2, f"context_parallel_strategy={strategy}")
    assert COLLECTIVE[strategy] in split[2] and COLLECTIVE[strategy] not in gathered[2]  # it ran where asked
    _assert_same(split, gathered)
    _assert_same(split, one_device)


LLAMA4 = ("decoder_block=llama4_text", "base_mlp_dim=48", "num_experts=4", "base_moe_mlp_dim=24", "shared_experts=1",
          "decoder_sparse_step=2", "nope_layer_interval=2", "chunk_attn_window_size=8")  # chunks cross the shards


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all_gather", "ring", "ulysses"])
def test_tiny_llama4_chunked_attention_with_the_strategy_gives_the_loss_and_gradients_of_one_device(strategy):
    """Chunks of 8 positions in rows of two documents (20 and 12 tokens: chunks restart with each document) over CP 2
    in dual_chunk_swap (chunks of 8 tokens per device, not aligned with the documents' chunks)."""
    one_device = _loss_and_grads(1, *LLAMA4, "ici_fsdp_parallelism=1")
    split = _loss_and_grads(2, *LLAMA4, *CP2, f"context_parallel_strategy={strategy}")
    assert strategy == "all_gather" or COLLECTIVE[strategy] in split[2]  # it ran where asked
    _assert_same(split, one_device)
    unchunked = _loss_and_grads(1, *LLAMA4[:-1], "chunk_attn_window_size=32", "ici_fsdp_parallelism=1")
    assert abs(unchunked[0] - one_device[0]) > 1e-4  # the chunks change the loss: the comparison could fail


@pytest.mark.slow
def test_chunked_attention_with_the_flash_kernel_under_ulysses_equals_the_unsplit_reference():
    """Chunks of 8 positions (restarting with each document) with flash (Pallas interpret mode) under ulysses at CP 2:
    the elementwise chunk ids reach the kernel, which masks by them in the original order; values and gradients."""
    from maxtrain.models import attention  # pylint: disable=import-outside-toplevel
    from test_context_ulysses_kernels import _grads, _inputs as _kernel_inputs  # pylint: disable=import-outside-toplevel
    q, k, v, segment_ids, weights, _ = _kernel_inputs()
    starts = np.concatenate([np.ones((2, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = np.maximum.accumulate(np.where(starts, np.arange(segment_ids.shape[1]), 0), axis=1)
    positions = (np.arange(segment_ids.shape[1])[None] - first).astype(np.int32)  # restart in each document

    def reference(q, k, v, sinks):
        mask = attention.make_attention_mask(segment_ids, segment_ids, chunk=8, q_positions=positions,
                                             kv_positions=positions)
        return attention.dot_product_attention(q, k, v, mask, sinks=sinks)
    ref_out, ref_grads = _grads(reference, q, k, v, weights, None)
    lq, lk, lv, lseg, lpos, lweights = context.to_layout((q, k, v, segment_ids, positions, weights), 2)

    def split(q, k, v, sinks):
        return attention.attention(q, k, v, lseg, implementation="flash", platform="cpu", block_q=16, block_kv=16,
                                   interpret=True, sinks=sinks, chunk=8, positions=lpos, context_strategy="ulysses")
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:2], context=2), RULES):
        out, grads = jax.jit(lambda *a: _grads(split, *a))(lq, lk, lv, lweights, None)
    np.testing.assert_allclose(np.asarray(context.from_layout(out, 2)), np.asarray(ref_out), rtol=1e-4, atol=1e-5)
    for name, got, ref in zip("qkv", grads[:3], ref_grads[:3]):
        np.testing.assert_allclose(np.asarray(context.from_layout(got, 2)), np.asarray(ref), rtol=1e-4, atol=1e-5,
                                   err_msg=f"d loss / d {name}")
