"""Routing replay (models/moe/replay.py, grpo_routing_replay): the sampler records each token's experts, the
trainer's forward replays them with the router's current weights, and the router keeps its gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from post_helpers import compose
from maxtrain import config as config_lib
from maxtrain.models import moe, sampling
from maxtrain.models.model import Model
from maxtrain.models.moe import replay
from maxtrain.models.runtime import Runtime
from maxtrain.training import grpo, losses

# 3 MoE layers of 4 experts, 2 per token (test_moe.py's tiny Mixtral)
MOE = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
       "base_num_decoder_layers=3"]
PROMPTS = [np.array([1, 5, 9, 12, 7], np.int32), np.array([1, 30], np.int32), np.array([1, 4, 4], np.int32)]
PROMPT_LENGTH, NEW, LENGTH = 6, 8, 16


def _config(tmp_path, *extra):
    return config_lib.with_devices(config_lib.load_config(compose(
        BASE_YML, *TINY, f"base_output_directory={tmp_path}", "vocab_size=64", *MOE,
        "decode_sampling_strategy=weighted", *extra)), 1)


def _with_router(params, router):
    return {**params, "layers": {**params["layers"], "moe": {**params["layers"]["moe"], "router": router}}}


def _rollout(config, params):
    """The update batch (one micro-batch of 3 rows, routed_experts included) of completions sampled from params."""
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    ids, first = grpo.left_padded([grpo.prompts_lib.Prompt(p, "", "") for p in PROMPTS], PROMPT_LENGTH)
    tokens, log_probs, routing = jax.device_get(sampling.sample_completions(
        params, ids, first, jax.random.key(3), model=model, rt=rt, max_new_tokens=NEW, record_routing=True,
        **sampling.sampling_settings(config)))
    assert routing.shape == (3, PROMPT_LENGTH + NEW, model.num_moe_layers, 2)
    rows = [r[f:] for r, f in zip(routing, first)]
    batch = grpo.assemble(PROMPTS, tokens, log_probs, np.full(3, NEW, np.int32), np.array([1.0, -1.0, 0.5], np.float32),
                          LENGTH, (1, 3), rows)
    return {k: jnp.asarray(v[0]) for k, v in batch.items()}


def _log_probs(config, params, batch):
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    return jax.jit(lambda p, b: losses.target_log_probs(p, b, model, rt))(params, batch)


def test_replayed_weights_are_the_routers_own_for_its_own_choice():
    """Each router's weights for the experts it chose itself equal moe.route's, bitwise (one formula each)."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32))
    base = dict(num_experts=8, top_k=3, dispatch="dropless", capacity_factor=1.0, load_balance_loss_weight=0.0,
                router_z_loss_weight=0.0, num_moe_layers=1, dtype=jnp.float32)
    for router, norm, extra in [("topk_softmax", True, {}), ("softmax_topk", False, {}), ("softmax_topk", True, {}),
                                ("sigmoid_group_topk", True, dict(groups=4, topk_groups=2, scaling=2.5)),
                                ("topk_sigmoid", False, {})]:
        s = moe.Settings(router=router, norm_topk_prob=norm, **base, **extra)
        w, e = moe.route(logits, s)
        w_replayed, e_replayed = replay.weights(logits, e, s)
        np.testing.assert_array_equal(np.asarray(e_replayed), np.asarray(e))
        np.testing.assert_array_equal(np.asarray(w_replayed), np.asarray(w), err_msg=router)
    valid = jnp.asarray([[True, True, False]])
    own = jnp.asarray([[[0, 1], [2, 3], [0, 1]]])
    # the order within a token's K does not count; a padding token never does
    assert float(replay.mismatched(own, jnp.asarray([[[1, 0], [2, 1], [3, 2]]]), valid)) == 1.0


def test_replay_keeps_the_samplers_log_probs_after_the_router_moved(tmp_path):
    """Two experts' router columns tied (so that a move of 1e-6 changes choices, as rounding does between an
    inference engine and the trainer), completions sampled, then every router weight moved by 1e-6 (one Adam
    step at lr 1e-6): with replay the trainer's log-probabilities are the sampler's to float32 rounding,
    without it they differ; the mismatch metric counts the changed choices."""
    config = _config(tmp_path)
    params = Model.bind(config).init_params(jax.random.key(1))
    router = params["layers"]["moe"]["router"]                          # [layers, D, E]
    tied = _with_router(params, router.at[..., 1].set(router[..., 0]))
    batch = _rollout(config, tied)
    w = np.asarray(batch["loss_weights"]) > 0
    assert w.sum() == 3 * NEW
    sampled = np.asarray(batch["old_log_probs"])[w]
    plain = {k: v for k, v in batch.items() if k != "routed_experts"}

    same, aux = _log_probs(config, tied, batch)  # unmoved: replay and the router's own choice agree
    np.testing.assert_allclose(np.asarray(same)[w], sampled, atol=1e-5)
    assert float(aux["moe_routing_mismatch"]) == 0.0

    step = 1e-6 * jnp.sign(jax.random.normal(jax.random.key(7), router.shape))
    moved = _with_router(params, tied["layers"]["moe"]["router"] + step)
    replayed, aux = _log_probs(config, moved, batch)
    own, own_aux = _log_probs(config, moved, plain)
    np.testing.assert_allclose(np.asarray(replayed)[w], sampled, atol=1e-5)
    assert np.abs(np.asarray(own)[w] - sampled).max() > 1e-2      # its own routing: other experts, other tokens' odds
    assert 0.0 < float(aux["moe_routing_mismatch"]) < 1.0
    assert "moe_routing_mismatch" not in own_aux


@pytest.mark.slow  # ~25 s on 2 cores: two gradients of the tiny MoE compiled
def test_routing_replay_gives_the_router_a_gradient(tmp_path):
    """GRPO's loss under replay differentiates the router's weights (through the replayed experts' weights);
    with the experts the router would choose anyway, loss and gradients are the plain path's."""
    config = _config(tmp_path)
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    params = model.init_params(jax.random.key(1))
    batch = _rollout(config, params)
    plain = {k: v for k, v in batch.items() if k != "routed_experts"}

    def loss(p, b):
        total, weight, _ = losses.grpo(p, b, params, model, rt)  # the KL term's reference replays too
        return total / weight

    value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
    plain_value, plain_grads = jax.jit(jax.value_and_grad(loss))(params, plain)
    router_grad = np.asarray(grads["layers"]["moe"]["router"])
    assert np.all(np.abs(router_grad).reshape(3, -1).max(axis=1) > 1e-6)  # every MoE layer's router
    np.testing.assert_allclose(float(value), float(plain_value), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("scan", slow_params([True, False], {"False"}))
def test_recorded_experts_follow_the_layers_under_scan_and_unrolled(tmp_path, scan):
    """A stack of dense and MoE layers (every other layer MoE): the sampler's recording is per MoE layer in
    order, and replaying a permutation of it reaches the layer it names."""
    config = _config(tmp_path, "decoder_block=qwen3_moe", "base_num_decoder_layers=4", "decoder_sparse_step=2", f"scan_layers={str(scan).lower()}")
    model = Model.bind(config)
    assert model.num_moe_layers == 2 and not all(t.is_moe for t in model.layer_types)
    params = model.init_params(jax.random.key(1))
    batch = _rollout(config, params)
    same, aux = _log_probs(config, params, batch)
    assert float(aux["moe_routing_mismatch"]) == 0.0  # each MoE layer got its own recorded experts
    swapped = {**batch, "routed_experts": batch["routed_experts"][..., ::-1, :]}
    _, aux = _log_probs(config, params, swapped)
    assert float(aux["moe_routing_mismatch"]) > 0.0

