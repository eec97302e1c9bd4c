"""DeepSeek Sparse Attention under context parallelism (models/families/deepseek/selected_context.py) on simulated
CPU devices: each device's queries, in the load-balanced layout, choose and attend to the gathered keys.

At the block level: selected_context.attention of inputs in the layout (dual_chunk_swap and striped), split over
CP 2 or 4 devices (and over FSDP 2 beside CP 2), taken back to the sequence's order, equals selected.attention on
one device: o_c, each head's largest logit, the indexer's KL (the sparse stage) and the gradients of a fixed
weighted sum with respect to every input, with packed documents and padding, at T = 32 > index_topk = 6 (queries
really drop keys); the selected-key kernel (interpret mode) too. The control: the same run with each device's
queries at their positions in the layout instead of their original indices is far off. At the model level: a tiny
DeepSeek-V3.2's loss and gradients under CP 2 and 4 equal one device's, without and with indexer_training; GLM-5's
shared indexer layers too. Ring, ulysses and usp are refused before compiling (tests/bad_inputs too).

Tolerances: float32 sums in another order (measured differences ~1e-7); a wrong mask moves values at the 1e-1 level.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.models.families.deepseek import selected, selected_context
from maxtrain.models import decoder
from maxtrain.models.model import Model
from maxtrain.parallel import context, sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

B, T, N, HN, HR, HV, C, I, E = 2, 32, 3, 8, 4, 6, 10, 4, 8
TOPK = 6
SCALE = (HN + HR) ** -0.5
RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]
# packed rows: documents that start inside a device's chunk and span devices, then padding (segment 0)
SEGMENTS = np.asarray([[1] * 11 + [2] * 15 + [0] * 6, [1] * 3 + [2] * 29])


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 10)
    normal = lambda key, *shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    return dict(q_nope=normal(keys[0], B, T, N, HN), q_rope=normal(keys[1], B, T, N, HR), c=normal(keys[2], B, T, C),
                k_rope=normal(keys[3], B, T, HR), w_k=normal(keys[4], C, N, HN) * C**-0.5,
                index_q=normal(keys[6], B, T, I, E), index_w=normal(keys[7], B, T, I),
                index_k=normal(keys[8], B, T, E)), normal(keys[9], B, T, N, C)


def _loss(segment_ids, weights, reorder, kernel=None):
    """(a weighted sum of o_c + the KL, (o_c, head max, KL)) of the inputs, through selected_context.attention."""
    def loss(x):
        (o_c, head_max), kl = selected_context.attention(
            x["q_nope"], x["q_rope"], x["c"], x["k_rope"], x["w_k"], x["index_q"], x["index_w"], x["index_k"],
            segment_ids, topk=TOPK, scale=SCALE, reorder=reorder, with_max_logits=True, kernel=kernel,
            indexer_kl=True)
        return jnp.sum(o_c * weights) + kl, (o_c, head_max, kl)
    return jax.value_and_grad(loss, has_aux=True)


def _run(cp: int, reorder: str, fsdp: int = 1, kernel=None):
    """(o_c, head max, KL, gradients) in the sequence's order, split over cp context devices (1: one device)."""
    x, weights = _inputs()
    segment_ids = jnp.asarray(SEGMENTS)
    if cp == 1:
        (_, (o_c, m, kl)), grads = jax.jit(_loss(segment_ids, weights, reorder, kernel))(x)
        return o_c, m, kl, grads
    tokens = {k: v for k, v in x.items() if k != "w_k"}
    tokens, segment_ids, weights = context.to_layout((tokens, segment_ids, weights), cp, reorder=reorder)
    mesh = sharding.mesh_of(jax.devices()[:cp * fsdp], context=cp, fsdp=fsdp)
    with sharding.activation_sharding(mesh, RULES):
        step = jax.jit(lambda x: _loss(segment_ids, weights, reorder, kernel)(x))  # a new function: jit's cache sees no mesh
        (_, (o_c, m, kl)), grads = step({**tokens, "w_k": x["w_k"]})
    back = functools.partial(context.from_layout, cp=cp, reorder=reorder)
    return back(o_c), m, kl, {k: (v if k == "w_k" else back(v)) for k, v in grads.items()}


def _assert_close(got, ref, what):
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())),
                               err_msg=what)


def _assert_same(split, one):
    for name, got, ref in zip(("o_c", "head max", "indexer KL"), split[:3], one[:3]):
        _assert_close(got, ref, name)
    for name in one[3]:
        _assert_close(split[3][name], one[3][name], f"d / d {name}")


@functools.lru_cache(maxsize=None)
def _one_device(kernel=None):
    return _run(1, "dual_chunk_swap", kernel=kernel)  # no layout on one device


def test_queries_really_drop_keys_here():
    visible = np.asarray(selected.visible_keys(jnp.asarray(SEGMENTS), jnp.asarray(SEGMENTS), jnp.arange(T)))
    assert int(np.sum(visible.sum(-1) > TOPK)) > 20


# The default run keeps one case of each reorder (CP 4, and CP 2 x FSDP 2), each 5-14 s on 2 shared cores
# (2026-12-02; the first compiles the one-device reference too); the slow run all four.
@pytest.mark.parametrize("cp, reorder, fsdp", [pytest.param(2, "dual_chunk_swap", 1, marks=pytest.mark.slow),
                                               (4, "dual_chunk_swap", 1),
                                               pytest.param(4, "striped", 1, marks=pytest.mark.slow),
                                               (2, "striped", 2)])
def test_split_over_the_context_group_equals_one_device(cp, reorder, fsdp):
    _assert_same(_run(cp, reorder, fsdp), _one_device())


@pytest.mark.slow  # ~40 s on 2 shared cores (2026-12-02): the kernel's interpreted Pallas calls, compiled
def test_the_kernel_split_over_the_context_group_equals_one_device():
    _assert_same(_run(2, "dual_chunk_swap", kernel="cpu"), _one_device(kernel="cpu"))


def test_local_positions_in_place_of_the_original_indices_are_far_off(monkeypatch):
    """The control: each device's queries at their positions in the layout (not their original indices)."""
    one = _one_device()
    monkeypatch.setattr(selected_context, "_positions", lambda length, reorder: jnp.arange(length, dtype=jnp.int32))
    split = _run(2, "dual_chunk_swap")
    assert float(jnp.max(jnp.abs(split[0] - one[0]))) > 1e-1


# --------------------------------------------------------------------------------------------
# A tiny DeepSeek-V3.2 (and GLM-5): loss and gradients under context parallelism equal one device's
# --------------------------------------------------------------------------------------------

DEEPSEEK = ["decoder_block=deepseek", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
            "first_num_dense_layers=1", "shared_experts=1", "routed_bias=true", "base_num_query_heads=4",
            "base_num_kv_heads=4", "q_lora_rank=8", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=4",
            "head_dim=12", "v_head_dim=10", "rope_interleave=true", "load_balance_loss_weight=0",
            "index_n_heads=4", "index_head_dim=8", "index_topk=6", "max_target_length=32"]
GLM = ["base_num_decoder_layers=3", "indexer_types=[full,shared,full]", "index_rope_interleave=true",
       "n_routing_groups=-1", "topk_routing_group=-1"]


@functools.lru_cache(maxsize=None)
def _model_loss_and_grads(n_devices: int, *overrides):
    argv = with_overrides(with_overrides([BASE_YML, *TINY], *DEEPSEEK, "ici_fsdp_parallelism=1"),
                          f"per_device_batch_size={GLOBAL_BATCH // n_devices}", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))  # [B, T]: two packed documents a row
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):  # what training minimizes: with indexer_training, the indexer's loss too
            loss, weight, aux = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return decoder.objective(loss, weight, aux) / weight, aux.get("indexer_kl")
        (loss, kl), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(params)
    return float(loss), None if kl is None else float(kl), jax.tree.map(np.asarray, grads)


def _assert_model_same(split, one, trained: bool):
    assert split[0] == pytest.approx(one[0], rel=1e-5)
    assert (one[1] is not None) == trained and (not trained or one[1] > 0.0)
    if trained:
        assert split[1] == pytest.approx(one[1], rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(one[2])[0], jax.tree.leaves(split[2])):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # 20-75 s a case on 2 shared cores (2026-12-02): two compiled tiny models
# cp2 alone is in cp2-fsdp2 (the same context split and default reorder, with fsdp beside it)
@pytest.mark.parametrize("overrides", [
    ("ici_context_parallelism=4", "context_parallel_reorder_strategy=striped"),
    ("ici_context_parallelism=2", "ici_fsdp_parallelism=2"),
    ("ici_context_parallelism=2", "indexer_training=sparse"),
    ("ici_context_parallelism=4", "indexer_training=dense_warmup"),
    ("ici_context_parallelism=2", "indexer_training=sparse", *GLM),
], ids=["cp4-striped", "cp2-fsdp2", "cp2-sparse-stage", "cp4-dense-warmup", "glm5-shared-sparse-stage"])
def test_a_tiny_model_under_context_parallelism_gives_the_loss_and_gradients_of_one_device(overrides):
    cp = int(overrides[0].split("=")[1])
    fsdp = 2 if "ici_fsdp_parallelism=2" in overrides else 1
    rest = tuple(o for o in overrides[1:] if not o.startswith("ici_fsdp"))
    one = _model_loss_and_grads(1, *[o for o in rest if "reorder" not in o])
    split = _model_loss_and_grads(cp * fsdp, *overrides)
    _assert_model_same(split, one, any(o.startswith("indexer_training") for o in overrides))


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_other_strategies_are_refused_with_the_fix(strategy):
    with pytest.raises(ConfigError, match=rf"^context_parallel_strategy={strategy} cannot split DeepSeek Sparse "
                                          r"Attention over context parallelism 2: .* set "
                                          r"context_parallel_strategy=all_gather \(it gathers MLA's latent, 20 "):
        load_config(with_overrides(with_overrides([BASE_YML, *TINY], *DEEPSEEK), "ici_context_parallelism=2",
                                   f"context_parallel_strategy={strategy}"))
    # at or below index_topk tokens (and the indexer untrained) the model is MLA, which every strategy serves
    load_config(with_overrides(with_overrides([BASE_YML, *TINY], *DEEPSEEK), "ici_context_parallelism=2",
                               f"context_parallel_strategy={strategy}", "index_topk=32"))
