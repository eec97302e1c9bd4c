"""DeepSeek-V4's experts through the shared MoE block (models/moe/, router "given", activation "clamped_silu").

The family's layer routes itself (hash or sqrtsoftplus top-k: families/deepseek_v4/routing.py) and hands the block
each token's experts and weights. Checked here: the block equals routing.moe, the dense reference form, in values and
gradients (float32, ~1e-6) under both routers and both dispatches, with a clamp limit small enough to bind (the
control: gpt-oss's "clamped_swiglu" or an unclamped SwiGLU differ); and on 8 simulated devices, expert parallelism
(EP 4 x FSDP 2, EP 8 with capacity dispatch) trains the tiny model like one device, the tokens reaching their experts
through the collectives the block writes out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import deepseek_v4_dims, load_config, with_overrides
from maxtrain.models import moe
from maxtrain.models.moe import expert_matmuls
from maxtrain.models.families import deepseek_v4
from maxtrain.models.families.deepseek_v4 import routing
from maxtrain.models.runtime import Runtime
from maxtrain.parallel import sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

# 2 layers (hash-routed HCA, then top-k CSA), 8 experts of width 16, 2 per token; a clamp limit that binds.
V4 = ["decoder_block=deepseek_v4", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=16", "q_lora_rank=16",
      "index_n_heads=2", "index_head_dim=16", "index_topk=2", "o_groups=2", "o_lora_rank=16", "hc_mult=2",
      "hc_sinkhorn_iters=3", "compress_rate_hca=8", "num_hash_layers=1", "partial_rotary_factor=0.5",
      "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention]", "mlp_activations_limit=0.5",
      "sliding_window_size=8"]


def tiny(*overrides):
    return load_config(with_overrides([BASE_YML, *TINY], *V4, *overrides))


def hash_table(vocab, e, k):
    """tid2eid [V, k]: each token's k distinct experts, spread over all e."""
    rng = np.random.default_rng(3)
    return np.stack([rng.permutation(e)[:k] for _ in range(vocab)]).astype(np.int32)


def mlp_params(config, seed=0):
    """One layer's MoE weights, nested as the family holds them, random (tid2eid too) and large enough to clamp."""
    d = deepseek_v4_dims.dims_from_keys(config)
    e, i, h, k = d.n_experts, d.moe_intermediate, d.hidden_size, d.top_k
    keys = iter(jax.random.split(jax.random.key(seed), 10))
    w = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[-1]) * 3.0  # noqa: E731
    gate = {"weight": w(e, h), "e_score_correction_bias": 0.1 * jax.random.normal(next(keys), (e,)),
            "tid2eid": jnp.asarray(hash_table(d.vocab_size, e, k))}
    experts = {"w1": w(e, i, h), "w3": w(e, i, h), "w2": w(e, h, i)}
    shared = {"gate_proj.weight": w(i, h), "up_proj.weight": w(i, h), "down_proj.weight": w(h, i)}
    return gate, experts, shared


def both(config, gate, experts, shared, x, ids, is_hash):
    """(the block's y, routing.moe's y) over x [B, T, D]."""
    d = deepseek_v4_dims.dims_from_keys(config)
    rt = Runtime.from_config(config)
    mlp = {**{"gate." + k: v for k, v in gate.items()}, **{"shared_experts." + k: v for k, v in shared.items()}}
    y, aux = deepseek_v4.moe_block(x, ids, is_hash, mlp, experts, None, config, rt, d)
    dense = {**mlp, "experts.gate_up_proj": jnp.concatenate([experts["w1"], experts["w3"]], axis=1),
             "experts.down_proj": experts["w2"]}
    ref = routing.moe(dense, x, ids, is_hash=is_hash, top_k=d.top_k, scaling=d.routed_scaling, limit=d.swiglu_limit)
    return y, ref, aux


@pytest.mark.parametrize("is_hash", [True, False], ids=["hash", "topk"])
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_the_block_equals_the_dense_reference_values_and_gradients(is_hash, dispatch):
    # capacity: factor E / K gives every expert T slots, so nothing is dropped
    config = tiny(f"moe_dispatch={dispatch}", "capacity_factor=4.0")
    gate, experts, shared = mlp_params(config)
    x = jax.random.normal(jax.random.key(1), (2, 16, config.base_emb_dim))
    ids = jax.random.randint(jax.random.key(2), (2, 16), 0, config.vocab_size)
    with jax.default_matmul_precision("highest"):
        y, ref, aux = jax.jit(lambda *a: both(config, *a, ids, is_hash))(gate, experts, shared, x)
        assert float(jnp.std(ref)) > 0.1
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
        # no router logits: no balance loss, only the loads (the largest share of the pairs any expert took)
        assert "moe_lb_loss" not in aux and float(next(v for k, v in aux.items() if k.endswith("moe_load_max"))) > 0

        def loss(which, gate_w, experts, shared, x):
            g = {**gate, "weight": gate_w}
            out = both(config, g, experts, shared, x, ids, is_hash)[which]
            return jnp.sum(jnp.sin(out))
        grads = [jax.jit(jax.grad(functools.partial(loss, w), argnums=(0, 1, 2, 3)))(gate["weight"], experts, shared, x)
                 for w in (0, 1)]
    for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        assert float(jnp.max(jnp.abs(want))) > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))

    # The control: the clamps bind, so the other clamped form (gpt-oss's) and the plain SwiGLU give other values.
    for activation in ("clamped_swiglu", "swiglu"):
        s = moe.Settings.of(config, Runtime.from_config(config), moe.GIVEN, 2, activation)
        gate_x = jnp.ones((4,)) * 2.0
        assert not np.allclose(expert_matmuls.gated(gate_x, gate_x, s),
                               routing.clamped_swiglu(gate_x, gate_x, config.mlp_activations_limit))


def test_router_given_takes_the_routing_and_only_it():
    config = tiny()
    rt = Runtime.from_config(config)
    _, experts, _ = mlp_params(config)
    x = jnp.zeros((1, 8, config.base_emb_dim))
    weights = {"w_gate": experts["w1"].swapaxes(1, 2), "w_up": experts["w3"].swapaxes(1, 2),
               "w_down": experts["w2"].swapaxes(1, 2)}
    with pytest.raises(ValueError, match="router 'given' takes given=\\(weights, experts\\)"):
        moe.block(x, weights, jnp.ones((1, 8), jnp.int32), config, rt, router=moe.GIVEN, num_moe_layers=2)


# --------------------------------------------------------------------------------------------
# Expert parallelism on 8 simulated devices
# --------------------------------------------------------------------------------------------

LAYOUTS = {"ep4xfsdp2": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
           "ep8": ["ici_expert_parallelism=8", "ici_fsdp_parallelism=1"]}


@functools.lru_cache(maxsize=None)
def train(devices, dispatch, *overrides):
    r = builder.build(tiny(f"per_device_batch_size={GLOBAL_BATCH // len(devices)}", f"moe_dispatch={dispatch}",
                           "capacity_factor=1.0", *overrides), devices=devices)
    history, grads = [], None
    with sharding.activation_sharding(r.mesh, r.config.logical_axis_rules):
        state = r.init(jax.random.key(0))
        # a hash table that spreads the tokens (its initial zeros send every token to expert 0)
        layers = state["params"]["layers"]
        for kind in [k for k in layers if k.endswith("_hash")]:
            old = layers[kind]["mlp"]["gate"]["tid2eid"]
            table = hash_table(old.shape[1], 8, 2)
            layers[kind]["mlp"]["gate"]["tid2eid"] = jax.device_put(
                jnp.broadcast_to(jnp.asarray(table, old.dtype), old.shape), old.sharding)
        for batch in batches(r.config):
            batch = jax.device_put(batch, r.batch_sharding)
            if grads is None:
                lowered = r.train_step.lower(state, batch)
                step, lowered = lowered.compile(), lowered.as_text()
            state, m = step(state, batch)
            if grads is None:
                # The first step's gradients, per parameter, from the train step itself (no second compile): Adam's
                # first moment after one step is (1 - b1) x the gradients, clipped by the global norm (the same
                # factor on every layout: the grad norms agree). Read before the next step donates the state.
                grads = jax.device_get(optax.tree_utils.tree_get(state["opt_state"], "mu"))
            history.append([float(m[k]) for k in ("loss", "grad_norm")])
    return np.array(history), grads, lowered


@pytest.mark.slow
@pytest.mark.parametrize("layout, dispatch", [("ep4xfsdp2", "dropless"), ("ep8", "capacity")])
def test_expert_parallelism_matches_one_device(layout, dispatch):
    ref_history, ref_grads, _ = train(tuple(jax.devices()[:1]), dispatch, "ici_fsdp_parallelism=1")
    history, grads, lowered = train(tuple(jax.devices()), dispatch, *LAYOUTS[layout])
    np.testing.assert_allclose(history, ref_history, rtol=1e-5)
    for ref, got in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5 * np.max(np.abs(ref)))
    # the experts are split over the devices, and the tokens travel to them (the control: one device has no such op)
    collective = "all_to_all" if dispatch == "capacity" else "reduce_scatter"
    assert collective in lowered and collective not in train(tuple(jax.devices()[:1]), dispatch,
                                                               "ici_fsdp_parallelism=1")[2]
