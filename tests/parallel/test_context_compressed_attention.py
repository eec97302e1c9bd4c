"""DeepSeek-V4's attention under context parallelism (models/families/deepseek_v4/compressed_context.py) on
simulated CPU devices: each device's queries, in the load-balanced layout, attend the keys and compressed entries
computed from the layer input gathered back into the sequence's order.

At the layer level: compressed_context.attention of inputs in the layout (dual_chunk_swap and striped), split over
CP 2 or 4 devices (and FSDP 2 beside CP 2), taken back to the sequence's order, equals compressed.attention on one
device for the three kinds (sliding window, CSA with the indexer's top-k, HCA): the outputs and the gradients of a
fixed weighted sum with respect to the input and every weight, with packed documents (positions restarting at 0,
lengths no multiple of either rate, padding) and without, at T = 32 where the window (6), the compression (4 and 8
tokens an entry, windows cut by the devices' chunks) and the top-k (2 entries) all drop keys. The control: the same
run with the keys gathered in the layout's order (not put back in the sequence's) is far off. At the model level:
deepseek4-tiny's loss and gradients under CP 2 and 4 equal one device's, and train.main's losses (slow). Ring,
ulysses and usp are refused before compiling (tests/bad_inputs too).

Tolerances: float32 sums in another order (measured differences ~1e-7); a wrong window moves values at 1e-1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.config.deepseek_v4_dims import Dims
from maxtrain.models.families.deepseek_v4 import compressed_context, packed as packed_lib
from maxtrain.models import decoder
from maxtrain.models.model import Model
from maxtrain.parallel import context, sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

B, T, D, H, DH, Q, E, IH = 2, 32, 16, 2, 8, 8, 8, 2
DIMS = Dims(hidden_size=D, num_heads=H, head_dim=DH, rope_dim=4, q_lora_rank=Q, o_groups=2, o_lora_rank=4,
            sliding_window=6, rms_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, csa_rate=4, hca_rate=8,
            index_n_heads=IH, index_head_dim=E, index_topk=2, hc_mult=1, hc_iters=1, hc_eps=1e-6, n_experts=1,
            top_k=1, routed_scaling=1.0, swiglu_limit=1.0, moe_intermediate=2, vocab_size=2, layer_types=(),
            mlp_layer_types=())
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"]]
# packed rows: documents no multiple of 4 or 8 long, starting inside a device's chunk and spanning devices, padding
SEGMENTS = np.asarray([[1] * 11 + [2] * 15 + [0] * 6, [1] * 3 + [2] * 29])


def _positions(segments):
    """Each token's position in its document (restarting at 0; padding counts on as one more document)."""
    pos = np.zeros_like(segments)
    for r, row in enumerate(segments):
        for t in range(1, len(row)):
            pos[r, t] = pos[r, t - 1] + 1 if row[t] == row[t - 1] else 0
    return pos


def _compressor(key, width, pooled, rate, scale=0.5):
    k = jax.random.split(key, 4)
    return {"kv_proj.weight": jax.random.normal(k[0], (width, D)) * D ** -0.5,
            "gate_proj.weight": jax.random.normal(k[1], (width, D)) * D ** -0.5,
            "position_bias": jax.random.normal(k[2], (rate, width)) * scale,
            "kv_norm.weight": 1.0 + 0.1 * jax.random.normal(k[3], (pooled,))}


def _params(seed: int = 0) -> dict:
    """Every kind's attention weights by transformers' names: {kind: {name: array}}."""
    k = jax.random.split(jax.random.key(seed), 16)
    base = {"q_a_proj.weight": jax.random.normal(k[0], (Q, D)) * D ** -0.5, "q_a_norm.weight": jnp.ones((Q,)),
            "q_b_proj.weight": jax.random.normal(k[1], (H * DH, Q)) * Q ** -0.5,
            "kv_proj.weight": jax.random.normal(k[2], (DH, D)) * D ** -0.5, "kv_norm.weight": jnp.ones((DH,)),
            "o_a_proj.weight": jax.random.normal(k[3], (2 * 4, H * DH // 2)) * 0.3,
            "o_b_proj.weight": jax.random.normal(k[4], (D, 2 * 4)) * 0.3, "sinks": jax.random.normal(k[5], (H,))}
    hca = {f"compressor.{n}": v for n, v in _compressor(k[6], DH, DH, 8).items()}
    index = {**_compressor(k[7], 2 * E, E, 4), "q_b_proj.weight": jax.random.normal(k[8], (IH * E, Q)) * Q ** -0.5,
             "scorer.weights_proj.weight": jax.random.normal(k[9], (IH, D)) * D ** -0.5}
    csa = {**{f"compressor.{n}": v for n, v in _compressor(k[10], 2 * DH, DH, 4).items()},
           **{f"compressor.indexer.{n}": v for n, v in index.items()}}
    return {"sliding_attention": dict(base), "compressed_sparse_attention": {**base, **csa},
            "heavily_compressed_attention": {**base, **hca}}


def _inputs(seed: int = 1):
    k = jax.random.split(jax.random.key(seed), 2)
    return jax.random.normal(k[0], (B, T, D)), jax.random.normal(k[1], (B, T, D))


def _loss(pos, segment_ids, weights, reorder, kinds):
    """(a weighted sum of the kinds' outputs, the outputs) of (params, x), through compressed_context.attention."""
    def loss(params, x):
        outs = {kind: compressed_context.attention(params[kind], x, pos, kind, DIMS, segment_ids, reorder=reorder)
                for kind in kinds}
        return sum(jnp.sum(o * weights) for o in outs.values()), outs
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _run(cp: int, reorder: str, fsdp: int = 1, packed: bool = True, kinds=KINDS):
    """(outputs, (d params, d x)) in the sequence's order, split over cp context devices (1: one device)."""
    params = {kind: p for kind, p in _params().items() if kind in kinds}
    x, weights = _inputs()
    segment_ids = jnp.asarray(SEGMENTS) if packed else None
    pos = jnp.asarray(_positions(SEGMENTS)) if packed else jnp.broadcast_to(jnp.arange(T), (B, T))
    if cp == 1:
        (_, outs), grads = jax.jit(_loss(pos, segment_ids, weights, reorder, kinds))(params, x)
        return outs, grads
    x, pos, segment_ids, weights = context.to_layout((x, pos, segment_ids, weights), cp, reorder=reorder)
    mesh = sharding.mesh_of(jax.devices()[:cp * fsdp], context=cp, fsdp=fsdp)
    with sharding.activation_sharding(mesh, RULES):
        step = jax.jit(lambda p, x: _loss(pos, segment_ids, weights, reorder, kinds)(p, x))  # jit's cache sees no mesh
        (_, outs), (d_params, d_x) = step(params, x)
    back = functools.partial(context.from_layout, cp=cp, reorder=reorder)
    return {k: back(v) for k, v in outs.items()}, (d_params, back(d_x))


def _assert_close(got, ref, what):
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())),
                               err_msg=what)


def _assert_same(split, one):
    for kind in one[0]:
        _assert_close(split[0][kind], one[0][kind], kind)
    _assert_close(split[1][1], one[1][1], "d / d x")
    for kind in one[0]:
        for name, ref in one[1][0][kind].items():
            _assert_close(split[1][0][kind][name], ref, f"d / d {kind} {name}")


@functools.lru_cache(maxsize=None)
def _one_device(packed: bool = True, kinds=KINDS):
    return _run(1, "dual_chunk_swap", packed=packed, kinds=kinds)


def test_the_window_the_compression_and_the_top_k_really_drop_keys_here():
    pos = jnp.asarray(_positions(SEGMENTS))
    assert int(np.max(_positions(SEGMENTS))) >= 4 * DIMS.sliding_window       # the window drops keys
    lay = packed_lib.layout(jnp.asarray(SEGMENTS), pos, DIMS.csa_rate)
    seen = np.asarray(packed_lib.visible(lay, jnp.asarray(SEGMENTS), pos, DIMS.csa_rate)).sum(-1)
    assert int(np.sum(seen > DIMS.index_topk)) > 10                             # the top-k drops entries
    # the devices' chunks (CP 4, dual_chunk_swap: 4 tokens) cut HCA's 8-token windows
    assert T // 8 < DIMS.hca_rate


CSA, HCA = ("compressed_sparse_attention",), ("heavily_compressed_attention",)


# The default run keeps one case of each reorder, one compressed kind each (5-10 s a case on 2 cores, up to 20 s
# with 5 jobs sharing them, 2026-12-02, the one-device reference's compile included); the slow run every kind in
# each (5-9 s a case on quiet cores, ~40 s shared). No slow CP 2 dual_chunk_swap case: CP 4's (whose chunks also cut
# HCA's windows) and the default run's CP 2 CSA case cover it.
@pytest.mark.parametrize("cp, reorder, fsdp, packed, kinds", [
    (2, "dual_chunk_swap", 1, True, CSA),
    (2, "striped", 2, True, HCA),
    pytest.param(4, "dual_chunk_swap", 1, True, KINDS, marks=pytest.mark.slow),
    pytest.param(2, "striped", 2, True, KINDS, marks=pytest.mark.slow),
    pytest.param(4, "striped", 1, True, KINDS, marks=pytest.mark.slow),
    pytest.param(2, "dual_chunk_swap", 2, False, KINDS, marks=pytest.mark.slow),
], ids=["cp2-csa", "cp2-fsdp2-striped-hca", "cp4", "cp2-fsdp2-striped", "cp4-striped", "cp2-fsdp2-unpacked"])
def test_split_over_the_context_group_equals_one_device(cp, reorder, fsdp, packed, kinds):
    _assert_same(_run(cp, reorder, fsdp, packed, kinds), _one_device(packed, kinds))


def test_keys_left_in_the_layout_order_are_far_off(monkeypatch):
    """The control: each device's keys gathered in the layout's order (the positions in the layout taken for the
    original indices), not put back in the sequence's."""
    one = _one_device(kinds=CSA)
    monkeypatch.setattr(compressed_context, "order", lambda length, reorder: np.arange(length))
    split = _run(4, "dual_chunk_swap", kinds=CSA)
    assert float(jnp.max(jnp.abs(split[0][CSA[0]] - one[0][CSA[0]]))) > 1e-1


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_other_strategies_are_refused_with_the_fix(strategy):
    with pytest.raises(ConfigError, match=rf"^context_parallel_strategy={strategy} cannot split DeepSeek-V4's "
                                          r"attention over context parallelism 2: .* set "
                                          r"context_parallel_strategy=all_gather \(it gathers each layer's input"):
        load_config([BASE_YML, "model_name=deepseek4-tiny", "ici_context_parallelism=2",
                     f"context_parallel_strategy={strategy}"])
    load_config([BASE_YML, "model_name=deepseek4-tiny", "ici_context_parallelism=2"])  # all_gather: served


# --------------------------------------------------------------------------------------------
# deepseek4-tiny: loss and gradients under context parallelism equal one device's
# --------------------------------------------------------------------------------------------

# one layer of each kind (the preset's 4th is a second CSA): the compiles are the time
TINY_V4 = ["model_name=deepseek4-tiny", "vocab_size=512", "dtype=float32", "remat_policy=none",
           "enable_tensorboard=false", "max_target_length=64", "ici_fsdp_parallelism=1", "base_num_decoder_layers=3",
           "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention,sliding_attention]"]


@functools.lru_cache(maxsize=None)
def _model_loss_and_grads(n_devices: int, *overrides):
    argv = with_overrides([BASE_YML, *TINY_V4], f"per_device_batch_size={GLOBAL_BATCH // n_devices}", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))  # [B, T]: two packed documents a row
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, aux = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return decoder.objective(loss, weight, aux) / weight
        loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow  # two compiled tiny models a case
@pytest.mark.parametrize("overrides", [("ici_context_parallelism=2",),
                                       ("ici_context_parallelism=4", "context_parallel_reorder_strategy=striped")],
                         ids=["cp2", "cp4-striped"])
def test_a_tiny_model_under_context_parallelism_gives_the_loss_and_gradients_of_one_device(overrides):
    one = _model_loss_and_grads(1)
    split = _model_loss_and_grads(int(overrides[0].split("=")[1]), *overrides)
    assert split[0] == pytest.approx(one[0], rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(one[1])[0], jax.tree.leaves(split[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())),
                                   err_msg=jax.tree_util.keystr(path))
