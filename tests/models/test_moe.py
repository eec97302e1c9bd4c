"""Mixture of experts (models/moe/): routers, the two dispatch strategies, capacity and drops, balance
losses that train, per-layer metrics, FLOPs of the active parameters, presets and bad inputs.

Expert parallelism is tested in test_moe_sharding.py, Hugging Face parity in test_families.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, REPO, TINY, slow_params
from maxtrain.training import builder, optimizer, train_step
from maxtrain.models import decoder
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models import sampling
from maxtrain.observability import metrics
from maxtrain.parallel import sharding
from maxtrain.config import ConfigError, load_config, with_devices, with_overrides
from maxtrain.models import moe
from maxtrain.models.moe import expert_matmuls

# 3 layers of 4 experts (2 per token) of width 24; batch and length small enough to compile in seconds.
MOE = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
       "base_num_decoder_layers=3"]


def tiny(*overrides):
    return load_config(with_overrides(with_overrides([BASE_YML, *TINY], *MOE), *overrides))


def forward(config, params, tokens, segment_ids):
    rt = Runtime.from_config(config)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda p: Model.bind(config).forward(p, tokens, positions, segment_ids, rt))(params)


def batch(config, rows=2, seed=1):
    t = config.max_target_length
    tokens = jax.random.randint(jax.random.key(seed), (rows, t), 0, config.vocab_size)
    segment_ids = jnp.ones((rows, t), jnp.int32).at[1, t - 5:].set(0)  # the second row ends in padding
    return tokens, segment_ids


# --------------------------------------------------------------------------------------------
# Routers and dispatch
# --------------------------------------------------------------------------------------------


def settings(router="softmax_topk", norm=True, e=6, k=2, **kw):
    base = dict(num_experts=e, top_k=k, router=router, norm_topk_prob=norm, dispatch="dropless", capacity_factor=1.0,
                load_balance_loss_weight=0.0, router_z_loss_weight=0.0, num_moe_layers=1, dtype=jnp.float32)
    return moe.Settings(**{**base, **kw})


def test_routers_compute_their_definitions():
    logits = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    chosen = np.take_along_axis(logits, top2, axis=-1)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)

    w, e = moe.route(jnp.asarray(logits), settings("topk_softmax"))  # Mixtral: softmax over the chosen logits
    np.testing.assert_array_equal(np.asarray(e), top2)
    np.testing.assert_allclose(np.asarray(w), np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True), rtol=1e-6)

    w, e = moe.route(jnp.asarray(logits), settings("softmax_topk", norm=False))  # Qwen3-MoE, raw probabilities
    np.testing.assert_array_equal(np.asarray(e), top2)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(probs, top2, axis=-1), rtol=1e-6)
    assert np.all(np.asarray(w).sum(-1) < 1.0)

    w_norm, _ = moe.route(jnp.asarray(logits), settings("softmax_topk", norm=True))  # renormalized = Mixtral's
    np.testing.assert_allclose(np.asarray(w_norm), np.asarray(moe.route(jnp.asarray(logits),
                                                                         settings("topk_softmax"))[0]), rtol=1e-6)


def test_capacity_slots_rank_first_choices_then_earlier_tokens():
    # One sequence of 4 tokens, 3 experts, 2 choices each, capacity 2 per expert (factor 0.75: ceil(0.75*4*2/3)).
    experts = jnp.array([[[0, 1], [0, 2], [1, 0], [0, 1]]])
    s = settings(e=3, k=2, capacity_factor=0.75)
    assert s.capacity(4) == 2
    slot, kept = moe.capacity_slots(experts, jnp.ones((1, 4), bool), s)
    # Expert 0: first choices of tokens 0, 1, 3 (token 3 over capacity), then token 2's second choice (dropped).
    # Expert 1: token 2's first choice, then token 0's second; token 3's second choice is dropped.
    assert np.asarray(kept).tolist() == [[[True, True], [True, True], [True, False], [False, False]]]
    assert np.asarray(slot).tolist() == [[[0, 3], [1, 4], [2, 6], [6, 6]]]
    # Padding takes no slot: with token 1 padding, token 3's first choice gets expert 0's second slot.
    slot, kept = moe.capacity_slots(experts, jnp.array([[True, False, True, True]]), s)
    assert np.asarray(kept).tolist() == [[[True, True], [False, False], [True, False], [True, False]]]
    assert np.asarray(slot).tolist() == [[[0, 3], [6, 6], [2, 6], [1, 6]]]


@pytest.mark.parametrize("family", slow_params(["mixtral", "qwen3_moe"], {"qwen3_moe"}))
def test_dropless_and_capacity_agree_when_nothing_is_dropped(family):
    """Capacity factor E / K gives every expert room for a whole sequence: both strategies compute the same
    logits, aux and gradients (padding included: it is routed nowhere in both)."""
    extra = ["mlp_only_layers=[1]", "norm_topk_prob=false"] if family == "qwen3_moe" else []
    outs = {}
    for dispatch in ("dropless", "capacity"):
        config = tiny(f"decoder_block={family}", f"moe_dispatch={dispatch}", "capacity_factor=2.0", *extra)
        params = Model.bind(config).init_params(jax.random.key(0))
        tokens, segment_ids = batch(config)
        logits, aux = forward(config, params, tokens, segment_ids)
        rt = Runtime.from_config(config)
        data = {"inputs": tokens, "targets": tokens, "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]),
                                                                                   tokens.shape),
                "segment_ids": segment_ids, "loss_weights": segment_ids.astype(jnp.float32)}
        grads = jax.jit(jax.grad(lambda p: decoder.objective(*Model.bind(config).loss_fn(p, data, rt))))(params)
        outs[dispatch] = (logits, aux, grads)
    (l1, a1, g1), (l2, a2, g2) = outs["dropless"], outs["capacity"]
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5, atol=1e-5)
    assert float(a2.pop("moe_dropped_fraction")) == 0.0
    assert sorted(a1) == sorted(a2)
    for key in a1:
        np.testing.assert_allclose(float(a1[key]), float(a2[key]), rtol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dispatch", slow_params(["dropless", "capacity"], {"capacity"}))
def test_the_hidden_axis_in_chunks_computes_the_same_block(dispatch):
    """num_moe_hidden_tiling=4 runs the experts' hidden axis (24) as 4 chunks of 6, summed in float32:
    the same logits, aux and gradients as one pass (float32; the sums' order differs, 1e-5)."""
    outs = []
    for tiling in (1, 4):
        config = tiny(f"moe_dispatch={dispatch}", "capacity_factor=2.0", f"num_moe_hidden_tiling={tiling}")
        params = Model.bind(config).init_params(jax.random.key(0))
        tokens, segment_ids = batch(config)
        rt = Runtime.from_config(config)
        data = {"inputs": tokens, "targets": tokens, "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]),
                                                                                   tokens.shape),
                "segment_ids": segment_ids, "loss_weights": segment_ids.astype(jnp.float32)}
        with jax.default_matmul_precision("highest"):
            grads = jax.jit(jax.grad(lambda p: decoder.objective(*Model.bind(config).loss_fn(p, data, rt))))(params)
        outs.append((*forward(config, params, tokens, segment_ids), grads))
    (l1, a1, g1), (l2, a2, g2) = outs
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5, atol=1e-5)
    for key in a1:
        np.testing.assert_allclose(float(a1[key]), float(a2[key]), rtol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
    assert any(float(np.max(np.abs(g))) > 0 for g in jax.tree.leaves(g1["layers"]["moe"]["w_down"]))


def test_the_hidden_chunks_are_chosen_by_what_fsdp_gathers():
    """Autoselected: one chunk unless FSDP gathers the experts; then the fewest chunks, dividing the
    hidden width in multiples of 128, whose gathered gate, up and down weights stay under 512 MiB."""
    s = settings(dtype=jnp.bfloat16)
    assert moe.hidden_chunks(s, (8, 4096, 14336), 2, gathered=False) == 1  # resident experts: nothing to gather
    assert moe.hidden_chunks(s, (8, 4096, 14336), 2, gathered=True) == 7  # Mixtral 8x7B: 2.6 GiB -> 7 x 384 MiB
    assert moe.hidden_chunks(s, (128, 2048, 768), 2, gathered=True) == 3  # Qwen3-30B-A3B: 1.1 GiB -> 3 x 384 MiB
    assert moe.hidden_chunks(s, (4, 64, 24), 4, gathered=True) == 1  # small experts: one pass
    assert moe.hidden_chunks(settings(hidden_tiling=4), (8, 4096, 14336), 2, gathered=False) == 4  # as set
    with pytest.raises(ValueError, match=r"num_moe_hidden_tiling=5 does not divide the experts' hidden width 12 on one"):
        moe.hidden_chunks(settings(hidden_tiling=5), (4, 64, 12), 4, gathered=True)


def test_capacity_drops_the_overflow_and_reports_it():
    """A router that sends every token to experts 0 and 1: with capacity 8 of 16 tokens, tokens 8-15
    lose both experts (their MoE output is 0: only the residual carries them), and half the pairs
    are reported dropped. Tokens 0-7 get exactly what dropless computes."""
    d, t = 8, 16
    x = jnp.abs(jax.random.normal(jax.random.key(0), (2, t, d))) + 0.5            # positive features
    router = jnp.stack([jnp.full(d, 2.0), jnp.full(d, 1.0), -jnp.ones(d), -jnp.ones(d)], axis=1)
    keys = jax.random.split(jax.random.key(1), 3)
    p = {"router": router, "w_gate": jax.random.normal(keys[0], (4, d, 6)),
         "w_up": jax.random.normal(keys[1], (4, d, 6)), "w_down": jax.random.normal(keys[2], (4, 6, d))}
    segment_ids = jnp.ones((2, t), jnp.int32)
    out = {}
    for dispatch in ("capacity", "dropless"):
        config = tiny(f"moe_dispatch={dispatch}", "capacity_factor=1.0", f"base_emb_dim={d}")
        rt = Runtime.from_config(config)
        out[dispatch] = moe.block(x, p, segment_ids, config, rt, router="topk_softmax", num_moe_layers=1)
    (y, aux), (y_all, aux_all) = out["capacity"], out["dropless"]
    assert moe.capacity(4, 2, 1.0, t) == 8
    assert float(aux["moe_dropped_fraction"]) == 0.5 and "moe_dropped_fraction" not in aux_all
    np.testing.assert_array_equal(np.asarray(y[:, 8:]), 0.0)
    np.testing.assert_allclose(np.asarray(y[:, :8]), np.asarray(y_all[:, :8]), rtol=1e-5, atol=1e-5)
    assert float(aux["per_layer/moe_load_max"]) == 0.5 and float(aux["per_layer/moe_load_min"]) == 0.0


def test_balance_and_z_losses_follow_their_formulas():
    config = tiny("load_balance_loss_weight=0.5", "router_z_loss_weight=0.25", "num_experts=4")
    x = jax.random.normal(jax.random.key(0), (2, 8, config.base_emb_dim))
    experts = jax.tree.map(lambda a: a[0], Model.bind(config).init_params(jax.random.key(2))["layers"]["moe"])
    p = {"router": jax.random.normal(jax.random.key(1), (config.base_emb_dim, 4)),
         **{k: experts[k] for k in ("w_gate", "w_up", "w_down")}}
    segment_ids = jnp.ones((2, 8), jnp.int32).at[0, 6:].set(0)
    _, aux = moe.block(x, p, segment_ids, config, Runtime.from_config(config), router="topk_softmax",
                       num_moe_layers=2)
    logits = np.asarray(x @ p["router"]).reshape(-1, 4)[np.asarray(segment_ids).reshape(-1) > 0]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = np.argsort(-logits, axis=-1)[:, :2]
    f = np.stack([(chosen == e).any(-1).mean() for e in range(4)])  # fraction of tokens that chose e
    balance = 4 * np.sum(f * probs.mean(0))
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(aux["moe_lb_loss"]), 0.5 * balance / 2, rtol=1e-5)  # / 2 MoE layers
    np.testing.assert_allclose(float(aux["moe_z_loss"]), 0.25 * z / 2, rtol=1e-5)
    np.testing.assert_allclose(float(aux["per_layer/moe_load_max"]), f.max() / 2, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Training: the balance loss evens out a skewed router
# --------------------------------------------------------------------------------------------


def _train_skewed(weight: float, steps: int = 60):
    """A tiny mixtral whose routers all favor expert 0, trained on random tokens; max load per step."""
    config = with_devices(tiny("base_num_decoder_layers=1", "num_experts=4", "num_experts_per_tok=1",
                               f"load_balance_loss_weight={weight}", "learning_rate=0.01", "warmup_steps_fraction=0",
                               "lr_schedule_type=constant", "adam_weight_decay=0", "gradient_clipping_threshold=0",
                               f"steps={steps}"), 1)
    rt = Runtime.from_config(config)
    tx = optimizer.make_optimizer(config, Model.bind(config))
    state = train_step.init_state(config, Model.bind(config), rt, tx, jax.random.key(0))
    params = state["params"]
    # Skew: every token embedding shares a direction u, and expert 0's router column is 4u: nearly every
    # token's largest logit is expert 0's.
    u = jax.random.normal(jax.random.key(5), (config.base_emb_dim,))
    u = u / jnp.linalg.norm(u)
    params = {**params, "token_embedding": params["token_embedding"] + 2.0 * u}
    router = params["layers"]["moe"]["router"].at[0, :, 0].add(4.0 * u)
    params["layers"]["moe"] = {**params["layers"]["moe"], "router": router}
    state = {**state, "params": params, "opt_state": tx.init(params)}
    step = jax.jit(train_step.make_train_step(config, Model.bind(config), rt, tx))
    rng = np.random.default_rng(0)
    loads = []
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (1, 4, config.max_target_length + 1), dtype=np.int32)
        data = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
                "positions": np.broadcast_to(np.arange(config.max_target_length, dtype=np.int32), (1, 4, 32)),
                "segment_ids": np.ones((1, 4, 32), np.int32), "loss_weights": np.ones((1, 4, 32), np.float32)}
        state, m = step(state, data)
        loads.append(float(m["aux/moe_load_max/layer_0"]))
    return loads


def test_the_balance_loss_drives_a_skewed_router_toward_even_load():
    """Expert 0 starts with nearly all tokens (one expert per token, Switch-style). With
    load_balance_loss_weight=1 the router spreads them toward 1/4 each within 60 AdamW steps (the
    largest share of a 128-token batch stays a little above 1/4 by chance); without the loss (the
    language-model loss alone) it stays skewed. So it is the balance loss, through the aux channel
    into the objective, that evens the load."""
    balanced, unbalanced = _train_skewed(1.0), _train_skewed(0.0)
    assert balanced[0] > 0.9 and unbalanced[0] > 0.9, (balanced[0], unbalanced[0])
    assert np.mean(balanced[-10:]) < 0.4, balanced
    assert np.mean(unbalanced[-10:]) > 0.8, unbalanced


# --------------------------------------------------------------------------------------------
# Per-layer metrics, console line, metrics file, TensorBoard
# --------------------------------------------------------------------------------------------


def test_per_layer_entries_name_their_layer_under_scan_and_unrolled():
    """qwen3_moe with dense layers 1 and 3 of 5: the layers run as scanned groups, and each MoE layer's
    load reaches aux under its own index, the same as when unrolled."""
    config = tiny("decoder_block=qwen3_moe", "base_num_decoder_layers=5", "mlp_only_layers=[1,3]")
    assert [t.kind for t in Model.bind(config).layer_types] == ["moe", "dense", "moe", "dense", "moe"]
    params = Model.bind(config).init_params(jax.random.key(0))
    tokens, segment_ids = batch(config)
    _, scanned = forward(config, params, tokens, segment_ids)
    _, unrolled = forward(config.replace(scan_layers=False), params, tokens, segment_ids)
    assert sorted(k for k in scanned if "/layer_" in k) == sorted(
        f"moe_load_{m}/layer_{i}" for m in ("min", "max") for i in (0, 2, 4))
    assert sorted(scanned) == sorted(unrolled)
    for key in scanned:
        np.testing.assert_allclose(float(scanned[key]), float(unrolled[key]), rtol=1e-5, err_msg=key)


def test_moe_metrics_reach_the_console_the_metrics_file_and_tensorboard(tiny_args, tmp_path, capsys):
    from maxtrain import train  # pylint: disable=import-outside-toplevel
    from tensorboard_files import read_tensorboard  # pylint: disable=import-outside-toplevel

    metrics_file = tmp_path / "metrics.jsonl"
    result = train.main(with_overrides(with_overrides(tiny_args, *MOE), "moe_dispatch=capacity", "capacity_factor=1.0", "router_z_loss_weight=1e-3",
                         "dataset_type=synthetic", "steps=3", "log_period=1", "enable_checkpointing=false",
                         "enable_tensorboard=true", f"metrics_file={metrics_file}"))
    out = capsys.readouterr().out
    assert "experts: 4 x F 24, 2 per token, in 3 of 3 layers" in out and "dispatch capacity" in out
    assert "hidden chunks 1 (autoselected)" in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("moe lb_loss" in line and "dropped" in line and "load 0." in line for line in lines)
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    names = ["learning/moe_lb_loss", "learning/moe_z_loss", "learning/moe_dropped_fraction"] + [
        f"learning/moe_load_{m}/layer_{i}" for m in ("min", "max") for i in range(3)]
    for name in names:
        assert all(isinstance(r[name], float) for r in rows), name
    assert all(0 < r["learning/moe_lb_loss"] and 0 <= r["learning/moe_dropped_fraction"] < 1 for r in rows)
    assert all(r["learning/moe_load_min/layer_1"] <= 0.25 <= r["learning/moe_load_max/layer_1"] for r in rows)
    scalars, _ = read_tensorboard(result.config.tensorboard_dir)
    for name in names:
        assert [s for s, _ in scalars[name]] == [1, 2, 3], name


def test_greedy_decoding_with_the_kv_cache_matches_the_full_forward():
    config = tiny("moe_dispatch=dropless", "max_target_length=16")
    rt = Runtime.from_config(config)
    params = Model.bind(config).init_params(jax.random.key(3))
    prompt = [5, 17, 3, 99]
    new = sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=6)
    tokens = list(prompt)
    for _ in range(6):
        ids = jnp.asarray([tokens])
        logits, _ = forward(config, params, ids, jnp.ones_like(ids))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    assert list(new) == tokens[len(prompt):]


# --------------------------------------------------------------------------------------------
# Counts and FLOPs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_presets_have_the_published_total_and_active_parameters(name, total, active):
    """Published to 0.1B: Mixtral 46.70B / 12.88B; Qwen 30.53B / 3.35B (its model card says 3.3B)."""
    config = load_config([BASE_YML, f"model_name={name}"])
    assert Model.bind(config).is_moe
    assert Model.bind(config).num_params == pytest.approx(total, abs=0.06e9)
    assert Model.bind(config).num_active_params == pytest.approx(active, abs=0.06e9)
    assert Model.bind(load_config([BASE_YML, "model_name=qwen3-8b"])).num_active_params == Model.bind(load_config([BASE_YML, "model_name=qwen3-8b"])).num_params  # dense: every parameter is active


def test_flops_count_active_parameters_and_match_xla():
    """The formula against XLA's count of the compiled train step of an unrolled tiny qwen3_moe (one dense
    layer, two MoE layers). Capacity dispatch at factor 1 computes exactly T*K/E slots per expert, the
    active FLOPs; XLA also counts the elementwise work the formula leaves out (a few percent: norms,
    softmax, SiLU, and AdamW over all parameters, which for a mixture of experts are several times the
    active ones, hence 1,024 tokens a step here rather than the dense test's 256)."""
    cfg = with_devices(load_config([
        BASE_YML, "decoder_block=qwen3_moe", "base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=2",
        "head_dim=32", "base_mlp_dim=384", "base_moe_mlp_dim=256", "num_experts=8", "num_experts_per_tok=2",
        "mlp_only_layers=[0]", "base_num_decoder_layers=3", "vocab_size=512", "max_target_length=128",
        "per_device_batch_size=8", "scan_layers=false", "remat_policy=none", "dtype=float32",
        "attention=dot_product", "moe_dispatch=capacity", "capacity_factor=1.0"]), 1)
    rt = Runtime.from_config(cfg)
    tx = optimizer.make_optimizer(cfg, Model.bind(cfg))
    state = jax.eval_shape(lambda k: train_step.init_state(cfg, Model.bind(cfg), rt, tx, k), jax.random.key(0))
    shape = (1, 8, 128)
    data = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_weights" else jnp.int32)
            for k in ("inputs", "targets", "positions", "segment_ids", "loss_weights")}
    cost = jax.jit(train_step.make_train_step(cfg, Model.bind(cfg), rt, tx)).lower(state, data).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    formula = metrics.flops_per_token(Model.bind(cfg), dense_attention=True) * 8 * 128
    assert cost["flops"] == pytest.approx(formula, rel=0.05)
    # Counting every expert instead would be far off: the formula is about the active parameters.
    everything = metrics.flops_per_token(Model.bind(cfg.replace(num_experts_per_tok=8)), dense_attention=True) * 8 * 128
    assert everything > 1.5 * cost["flops"]


# --------------------------------------------------------------------------------------------
# Bad input: each a clear error before any work
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, fragment", [
    (["num_experts_per_tok=6"], "num_experts_per_tok=6 is more than num_experts=4"),
    (["ici_expert_parallelism=3", "ici_fsdp_parallelism=1"], "expert parallelism 3 .* must divide num_experts=4"),
    (["moe_dispatch=capacity", "capacity_factor=0"], r"capacity_factor=0.0 is not allowed: it must be > 0.*moe_dispatch=dropless"),
    (["capacity_factor=-1"], "capacity_factor=-1.0 is not allowed: it must be > 0"),
    (["moe_dispatch=sorted"], "moe_dispatch='sorted' is not allowed: it must be one of: dropless, capacity"),
    (["decoder_block=llama"], "decoder_block=llama has no experts, but num_experts=4"),
    (["mlp_only_layers=[0]"], r"mlp_only_layers=\[0\] does nothing without decoder_block=qwen3_moe"),
    (["decoder_block=qwen3_moe", "mlp_only_layers=[7]"], r"mlp_only_layers=\[7\] must list layer indices in \[0, 2\]"),
    (["load_balance_loss_weight=-0.1"], "load_balance_loss_weight=-0.1 is not allowed: it must be >= 0"),
    (["num_moe_hidden_tiling=5"], r"num_moe_hidden_tiling=5 must divide the experts' hidden width 24 .* e.g. "
                                  r"num_moe_hidden_tiling=4"),
    (["num_moe_hidden_tiling=0"], "num_moe_hidden_tiling=0 is not allowed: it must be -1 or >= 1"),
])
def test_bad_moe_settings_are_refused_with_the_fix(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny(*overrides)


def test_an_expert_parallelism_filling_the_devices_must_divide_the_experts():
    config = tiny("ici_expert_parallelism=-1", "ici_fsdp_parallelism=1", "num_experts=6")  # 8 devices
    with pytest.raises(sharding.MeshError, match=r"expert parallelism 8 .* must divide num_experts=6"):
        builder.build(config)


def test_the_cli_prints_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", BASE_YML, "model_name=mixtral-8x7b",
                           "num_experts_per_tok=9"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "maxtrain: error: num_experts_per_tok=9 is more than num_experts=8: each token is routed to "
        "num_experts_per_tok distinct experts; use num_experts_per_tok <= 8"]


@pytest.mark.slow
def test_an_moe_preset_refuses_a_dense_checkpoint_and_an_moe_checkpoint_a_dense_model(tiny_args, tmp_path):
    """Before any work: mixtral-8x7b's 46.7B parameters are never allocated (this machine could not hold
    them); the message says which model is which and what to do."""
    from maxtrain.checkpointing import files as checkpoint_files  # pylint: disable=import-outside-toplevel
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    run = with_overrides(tiny_args, "dataset_type=synthetic", "steps=1", "max_new_tokens=0")
    train.main(with_overrides(run, "run_name=dense"))
    with pytest.raises(checkpoint_files.CheckpointError,
                       match=r"holds a dense llama model \(no experts\), but this run's model is a mixture of experts "
                             r"\(mixtral, 8 experts, 2 per token\).*upcycling"):
        train.main([BASE_YML, "model_name=mixtral-8x7b", "dataset_type=synthetic", f"base_output_directory={tmp_path}",
                    "run_name=moe", "ici_expert_parallelism=8", "ici_fsdp_parallelism=1",
                    f"load_parameters_path={tmp_path / 'dense' / 'checkpoints' / '1'}"])
    assert not list((tmp_path / "moe").glob("checkpoints/[0-9]*"))
    train.main(with_overrides(run, *MOE, "run_name=moe2"))
    with pytest.raises(checkpoint_files.CheckpointError, match=r"holds a mixture of experts \(mixtral, 4 experts, 2 per "
                                                         r"token\), but this run's model is a dense llama model"):
        train.main(with_overrides(run, "run_name=dense2", "decoder_block=llama", "base_num_decoder_layers=3",
                                  f"load_parameters_path={tmp_path / 'moe2' / 'checkpoints' / '1'}"))


def test_expert_biases_are_gathered_so_their_gradient_sums_in_float32():
    """expert_rows' forward is the gather's, bitwise; its gradient, onehot^T @ dy, sums each expert's ~1,000 bfloat16
    rows in float32 (a gather's scatter-add would sum them in bfloat16: ~7% off here)."""
    e, m, n = 16, 16384, 128
    rows = jnp.sort(jax.random.randint(jax.random.PRNGKey(0), (m,), 0, e))
    table = jax.random.normal(jax.random.PRNGKey(1), (e, n)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(2), (m, n)).astype(jnp.bfloat16)
    y, vjp = jax.vjp(lambda t: expert_matmuls.expert_rows(t, rows), table)
    assert y.dtype == jnp.bfloat16 and bool((y == jnp.take(table, rows, axis=0)).all())
    exact = jax.ops.segment_sum(dy.astype(jnp.float32), rows, e)
    scale = float(jnp.abs(exact).max())
    error = float(jnp.abs(vjp(dy)[0].astype(jnp.float32) - exact).max()) / scale
    gathered = jax.vjp(lambda t: jnp.take(t, rows, axis=0), table)[1](dy)[0]
    assert error < 0.004 < 0.02 < float(jnp.abs(gathered.astype(jnp.float32) - exact).max()) / scale
    table32 = table.astype(jnp.float32) + 1e-3  # float32 tables are gathered exactly too (no bfloat16 matmul passes)
    assert bool((expert_matmuls.expert_rows(table32, rows) == jnp.take(table32, rows, axis=0)).all())


def test_the_scatter_benchmark_times_both_gradients(tmp_path):
    """scripts/benchmark_scatter.py (the GPU check of the scatter-add suspected in docs/scale.md), tiny, on CPU."""
    done = subprocess.run([sys.executable, f"{REPO}/scripts/benchmark_scatter.py", "--rows", "64", "--experts", "4",
                           "--width", "8", "--repeats", "1", "--json", str(tmp_path / "s.json")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["dtype"], r["way"].split()[0]) for r in rows] == [
        ("bfloat16", "gather"), ("bfloat16", "one-hot"), ("float32", "gather"), ("float32", "one-hot")]
    assert all(r["ms"] > 0 and r["predicted_ms"] is None for r in rows)  # no chip record for this CPU
