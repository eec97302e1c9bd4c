"""The deepseek family's parts (DeepSeek-V3): the sigmoid group-limited router, the selection bias and its
update outside the gradient (a skewed toy balanced by the bias alone; the train step; checkpoint and
bitwise resume), multi-head latent attention with its latent KV cache, and bad settings.

Parity with transformers' DeepseekV3 is in test_families.py; expert parallelism in test_moe_sharding.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckpt_helpers import assert_bitwise_equal, cache_dir, train  # noqa: F401  (cache_dir is a fixture)
from conftest import BASE_YML, TINY
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.models import moe, sampling
from maxtrain.models.moe import sigmoid_groups

# 2 layers (1 dense, 1 MoE) of 8 experts in 4 groups, 2 chosen from the best 2 groups, 1 shared expert;
# MLA with low-rank queries, v_head_dim 10 != 8 + 4; 4 heads (the kv heads are the query heads).
DEEPSEEK = ["decoder_block=deepseek", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
            "first_num_dense_layers=1", "shared_experts=1", "n_routing_groups=4", "topk_routing_group=2",
            "routed_scaling_factor=2.5", "routed_bias=true", "base_num_query_heads=4", "base_num_kv_heads=4",
            "q_lora_rank=24", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=4", "head_dim=12",
            "v_head_dim=10", "rope_interleave=true", "load_balance_loss_weight=0"]


def tiny(*overrides):
    return load_config(with_overrides(with_overrides([BASE_YML, *TINY], *DEEPSEEK), *overrides))


def settings(**kw):
    base = dict(num_experts=8, top_k=2, router="sigmoid_group_topk", norm_topk_prob=True, dispatch="dropless",
                capacity_factor=1.0, load_balance_loss_weight=0.0, router_z_loss_weight=0.0, num_moe_layers=1,
                dtype=jnp.float32, groups=4, topk_groups=2, scaling=2.5)
    return moe.Settings(**{**base, **kw})


def test_the_sigmoid_router_chooses_within_the_best_groups_by_the_biased_scores():
    rng = np.random.default_rng(0)
    logits, bias = rng.normal(size=(64, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    weights, experts = moe.route(jnp.asarray(logits), settings(), jnp.asarray(bias))
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = (scores + bias).reshape(64, 4, 2)
    best_groups = np.argsort(-choice.sum(-1), axis=-1)[:, :2]  # the sum of a group's 2 best = its 2 experts
    for n in range(64):
        allowed = np.concatenate([2 * g + np.arange(2) for g in best_groups[n]])
        want = allowed[np.argsort(-(scores[n] + bias)[allowed])[:2]]
        assert sorted(np.asarray(experts[n])) == sorted(want)
        w = scores[n, np.asarray(experts[n])]
        np.testing.assert_allclose(np.asarray(weights[n]), 2.5 * w / w.sum(), rtol=1e-5)  # unbiased, normalized
    assert not np.array_equal(np.asarray(experts), np.asarray(moe.route(jnp.asarray(logits), settings())[1]))


def test_the_bias_update_alone_balances_a_skewed_router():
    """4 experts, top-1, one group: a router whose scores favour expert 0 for nearly every token. The sign
    rule (rate 0.01, no gradient) moves the selection bias until the loads are near even."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16)).astype(np.float32)
    w = 0.3 * rng.normal(size=(16, 4)).astype(np.float32)
    logits = jnp.asarray(x @ w + np.array([3.5, 0.0, 0.0, 0.0], np.float32))
    s = settings(num_experts=4, top_k=1, groups=1, topk_groups=1, scaling=1.0)
    config = tiny("num_experts=4", "num_experts_per_tok=1", "n_routing_groups=-1", "topk_routing_group=-1",
                  "routed_bias_update_rate=0.01")
    types = Model.bind(config).layer_types  # one dense layer, one MoE layer (index 1)

    def shares(bias):
        experts = moe.route(logits, s, bias)[1]
        return jnp.zeros(4).at[experts[:, 0]].add(1.0) / logits.shape[0]

    @jax.jit
    def step(bias):
        counts = shares(bias) * logits.shape[0]
        params = {"layers": {"moe": {"router_bias": bias[None]}}}
        new = sigmoid_groups.update_router_bias(params, params, {sigmoid_groups.expert_counts_name(1, 2): counts},
                                             config, types)
        return new["layers"]["moe"]["router_bias"][0]

    bias = jnp.zeros(4)
    before = float(jnp.max(shares(bias)))
    for _ in range(300):
        bias = step(bias)
    after = np.asarray(shares(bias))
    print(f"largest expert's share: {before:.3f} before, {after.max():.3f} after 300 updates (even: 0.25); "
          f"shares {np.round(after, 3)}, bias {np.round(np.asarray(bias), 3)}")
    assert before > 0.9
    assert after.max() < 0.3 and after.min() > 0.2


@pytest.mark.slow
def test_the_train_step_moves_the_bias_by_the_sign_rule_and_a_resumed_run_continues_from_it(tmp_path, cache_dir):  # noqa: F811
    """The bias changes only by +-rate or 0 per step (the optimizer's update, weight decay included, is
    discarded); it is saved with the params, and a resumed run continues from the saved bias. (That a
    resumed run is bitwise a straight one, params included, is test_checkpoint_resume.py's.) With one MTP
    module: its params are saved and resumed, and its loss is logged beside the main loss (models/mtp.py)."""
    rate = 2.0**-7  # a power of two: bias + rate x sign is exact in float32
    common = [*DEEPSEEK, f"routed_bias_update_rate={rate}", "adam_weight_decay=0.5", "checkpoint_period=2",
              "learning_rate_schedule_steps=3", "mtp_num_layers=1", f"metrics_file={tmp_path / 'm.jsonl'}"]
    first = train(tmp_path, "b", cache_dir, *common, "steps=2")
    saved = checkpoint_files.read_params(str(tmp_path / "b" / "checkpoints" / "2"))
    assert_bitwise_equal(saved, first.state["params"], "saved params (router bias and MTP module included)")
    resumed = train(tmp_path, "b", cache_dir, *common, "steps=3")
    assert int(resumed.state["step"]) == 3
    # the MTP module (models/mtp.py) resumed from its saved params and trained on; its loss is logged apart
    resumed_mtp = jax.device_get(resumed.state["params"]["mtp"])
    assert resumed_mtp.keys() == saved["mtp"].keys() and np.any(resumed_mtp["eh_proj"] != saved["mtp"]["eh_proj"])
    logged = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert all(m["learning/mtp_ce"] > m["learning/mtp_loss"] > 0 for m in logged)
    at_2 = np.asarray(saved["layers"]["moe"]["router_bias"])
    at_3 = np.asarray(resumed.state["params"]["layers"]["moe"]["router_bias"])
    for bias, steps in ((at_2, 2), (at_3, 3)):  # whole multiples of the rate: no other update reached it
        np.testing.assert_array_equal(bias, np.round(bias / rate) * rate)
        assert np.abs(bias / rate).max() <= steps
    assert set(np.round((at_3 - at_2) / rate).ravel()) <= {-1.0, 0.0, 1.0} and np.any(at_3 != at_2)
    assert np.any(at_2 != 0)


@pytest.mark.slow
def test_mla_decoding_from_the_latent_cache_equals_the_full_forward():
    config = tiny("max_target_length=16")
    rt = Runtime.from_config(config)
    params = jax.jit(lambda key: Model.bind(config).init_params(key))(jax.random.key(3))
    cache = Model.bind(config).init_cache(1, 10, rt.dtype)
    assert cache["k"].shape == (2, 1, 10, 1, 16) and cache["v"].shape == (2, 1, 10, 1, 4)  # latent, RoPE key
    prompt = [5, 17, 3, 99]
    new = [int(t) for t in sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=6)]
    ids = jnp.asarray([prompt + new])  # the full forward over prompt + generated: each token its argmax
    logits = jax.jit(lambda p: Model.bind(config).forward(p, ids, jnp.arange(10)[None], jnp.ones_like(ids), rt)[0])(params)
    assert [int(t) for t in jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1)] == new


SPARSE = ["index_n_heads=4", "index_head_dim=8", "index_topk=3", "q_lora_rank=8"]


@pytest.mark.parametrize("interleave", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["deepseek-v3.2", "glm-5"])
def test_sparse_attention_decoding_from_the_cache_equals_the_full_forward(interleave):
    """DeepSeek-V3.2's indexer keeping 3 keys a query (GLM-5's: its RoPE interleaved): greedy decoding (the indexer's
    keys cached beside the latent, each step selecting among the slots) gives the tokens the full forward's argmax
    gives; and a control that keeps every key decodes other tokens, so the selection was in force."""
    config = tiny("max_target_length=16", *SPARSE, f"index_rope_interleave={str(interleave).lower()}")
    rt = Runtime.from_config(config)
    assert rt.attention == "dot_product" and "the indexer keeps index_topk=3 of 16 keys" in rt.attention_reason
    params = jax.jit(lambda key: Model.bind(config).init_params(key))(jax.random.key(3))
    cache = Model.bind(config).init_cache(1, 10, rt.dtype)
    assert cache["index_k"].shape == (2, 1, 10, 1, 8)
    prompt = [5, 17, 3, 99]
    new = [int(t) for t in sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=6)]
    ids = jnp.asarray([prompt + new])

    def argmax(config):
        logits = jax.jit(lambda p: Model.bind(config).forward(p, ids, jnp.arange(10)[None], jnp.ones_like(ids),
                                                             Runtime.from_config(config))[0])(params)
        return jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1), logits
    tokens, sparse_logits = argmax(config)
    assert [int(t) for t in tokens] == new
    _, dense_logits = argmax(config.replace(index_topk=16))
    assert float(jnp.max(jnp.abs(sparse_logits - dense_logits))) > 1e-3


def test_sparse_attention_refuses_a_kernel_and_a_context_strategy_in_one_line():
    config = tiny("max_target_length=16", *SPARSE)
    with pytest.raises(ValueError, match=r"^attention=cudnn cannot take each query's chosen keys, and the indexer "
                                         r"keeps index_topk=3 of 16 keys per query .* use attention=autoselected"):
        Runtime.from_config(config.replace(attention="cudnn"), "gpu")
    for platform, form in (("tpu", "Mosaic"), ("gpu", "Triton")):  # autoselected and flash: the selected-key kernel
        for name in ("flash", "autoselected"):
            rt = Runtime.from_config(config.replace(attention=name), platform)
            assert rt.attention == "flash" and f"selected-key Pallas kernel ({form})" in rt.attention_reason
    assert Runtime.from_config(config.replace(attention="flash", index_topk=16), "tpu").attention == "flash"  # dense
    assert Runtime.from_config(config, context_parallel=2).attention == "dot_product"  # all_gather: selected_context
    with pytest.raises(ValueError, match=r"^context_parallel_strategy=ring cannot split DeepSeek Sparse Attention "
                                         r"over context parallelism 2: .* set context_parallel_strategy=all_gather"):
        Runtime.from_config(config.replace(context_parallel_strategy="ring"), context_parallel=2)
    with pytest.raises(ConfigError, match="index_head_dim=2 must hold the qk_rope_head_dim=4 features"):
        tiny(*SPARSE[:1], "index_head_dim=2", *SPARSE[2:])
    with pytest.raises(ConfigError, match="index_n_heads > 0 .* reads MLA's query latent: set q_lora_rank > 0"):
        tiny(*SPARSE[:3], "q_lora_rank=0")


@pytest.mark.parametrize("overrides, fragment", [
    (["topk_routing_group=5"], "topk_routing_group=5 is more than n_routing_groups=4"),
    (["num_experts_per_tok=5"], "num_experts_per_tok=5 is more than the 4 experts that topk_routing_group=2 groups of 2"),
    (["n_routing_groups=3"], "n_routing_groups=3 must divide num_experts=8"),
    (["n_routing_groups=-1"], "topk_routing_group=2 needs n_routing_groups"),
    (["routed_bias=false", "routed_bias_update_rate=0.001"], "routed_bias_update_rate=0.001 updates the router's"),
    (["first_num_dense_layers=3"], "first_num_dense_layers=3 leaves no layer of experts"),
    (["qk_rope_head_dim=5"], "qk_rope_head_dim=5 must be even"),
    (["qk_rope_head_dim=6"], "head_dim=12 must be the query/key head width .* = 14 .* set head_dim=14"),
    (["base_num_kv_heads=2"], "base_num_kv_heads=2 must equal base_num_query_heads=4"),
    (["decoder_block=mixtral", "n_routing_groups=-1", "topk_routing_group=-1", "first_num_dense_layers=0",
      "routed_scaling_factor=2.0"], r"does nothing without decoder_block=deepseek or deepseek_v4 \(here decoder_block=mixtral\)"),
    (["decoder_block=llama", "num_experts=1", "num_experts_per_tok=1", "n_routing_groups=-1", "topk_routing_group=-1",
      "first_num_dense_layers=0", "routed_scaling_factor=1"], "shared_experts=1 needs a mixture of experts"),
    (["mtp_num_layers=1", "decoder_block=mixtral", "n_routing_groups=-1", "topk_routing_group=-1",
      "first_num_dense_layers=0", "routed_scaling_factor=1", "shared_experts=0"],
     r"does nothing without decoder_block=deepseek or deepseek_v4 \(here decoder_block=mixtral\)"),
    (["mtp_num_layers=1", "objective=distill", "distill_teacher_path=t"],
     "mtp_num_layers=1 with objective=distill: .* set mtp_num_layers=0"),
    (["mtp_num_layers=1", "lora_rank=4"], "LoRA would leave the MTP modules untrained"),
    (["mtp_num_layers=1", "ici_context_parallelism=2"], "does not run with context parallelism 2 yet; set "
                                                        "ici_context_parallelism=1"),
])
def test_bad_deepseek_settings_are_refused_with_the_fix(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny(*overrides)


@pytest.mark.parametrize("implementation, platform", [("flash", "gpu"), ("flash", "tpu"), ("cudnn_padding", None)])
def test_attention_takes_a_value_head_dim_of_its_own(implementation, platform):
    """MLA's values are narrower than its queries and keys (12 < 20 here): every implementation gives the
    reference's output [B, T, N, Hv] and gradients (dot_product on CPU: the parity test in test_families.py
    and the tests above run it). flash: the GPU (Triton) and TPU (splash) kernels,
    interpreted on this CPU; cudnn runs only on a GPU, so its zero-padding of v (pad_head_dims) is checked
    around the reference."""
    from maxtrain.models import attention  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(2, 32, 4, 20)).astype(np.float32)) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(2, 32, 2, 12)).astype(np.float32))
    segments = jnp.ones((2, 32), jnp.int32).at[1, 20:].set(2)
    k = k[:, :, :2]  # 2 kv heads: grouped-query layout too
    w = jnp.asarray(rng.normal(size=(2, 32, 4, 12)).astype(np.float32))
    mask = attention.make_attention_mask(segments, segments)

    def reference(q, k, v):
        return jnp.sum(attention.dot_product_attention(q, k, v, mask, scale=0.3) * w)

    def ours(q, k, v):
        if implementation == "cudnn_padding":
            qp, kp, vp, scale, hv = attention.pad_head_dims(q, k, v, 0.3)
            return jnp.sum(attention.dot_product_attention(qp, kp, vp, mask, scale=scale)[..., :hv] * w)
        blocks = 128 if platform == "tpu" else 16  # splash: multiples of 128 (32 tokens padded inside)
        out = attention.attention(q, k, v, segments, implementation=implementation, platform=platform, scale=0.3,
                                  block_q=blocks, block_kv=blocks, interpret=True)
        assert out.shape == (2, 32, 4, 12)
        return jnp.sum(out * w)

    with jax.default_matmul_precision("highest"):
        want, want_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(q, k, v)
        got, got_grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_parallelism_computes_the_deepseek_block_like_one_device(dispatch):
    """The MoE block (group-limited router with a bias, shared experts, the sequence-wise loss, the expert
    counts the bias update reads) on EP 4 x FSDP 2 against no mesh: output, aux and gradients."""
    from maxtrain.models import params as params_lib  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel

    config = tiny("routed_bias_update_rate=0.01", "seq_balance_loss_weight=0.1", "load_balance_loss_weight=0.01",
                  f"moe_dispatch={dispatch}", "capacity_factor=1.0")
    rt = Runtime.from_config(config)
    p = params_lib.init_params(moe.specs(config), jax.random.key(0), "float32")
    p["router_bias"] = 0.1 * jax.random.normal(jax.random.key(1), (8,))
    x = jax.random.normal(jax.random.key(2), (8, 16, config.base_emb_dim))
    segments = jnp.ones((8, 16), jnp.int32).at[3, 10:].set(0)
    w = jax.random.normal(jax.random.key(3), x.shape)

    def run(p, x):
        y, aux = moe.block(x, p, segments, config, rt, router="sigmoid_group_topk", num_moe_layers=1)
        return jnp.sum(y * w) + aux["moe_seq_balance_loss"] + aux["moe_lb_loss"], aux

    want, want_grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))(p, x)
    mesh = sharding.mesh_of(jax.devices(), fsdp=2, expert=4)
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        got, got_grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))(p, x)
    counts = [k for k in want[1] if "moe_expert_counts" in k]
    assert counts and float(want[1]["moe_seq_balance_loss"]) > 0
    np.testing.assert_array_equal(got[1][counts[0]], want[1][counts[0]])  # whole counts, summed over devices
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-7, err_msg=name)
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5 * float(np.max(np.abs(r))))


def test_every_mla_weight_matrix_is_split_by_fsdp():
    """Under the default rules each MLA projection has an axis FSDP splits; the latent up-projections
    wq_b and wkv_b once had none and stayed whole on every device (35 GiB per chip of DeepSeek-V3's
    parameters and AdamW state on v5p-256, EP 64 x FSDP 2)."""
    from maxtrain.models.families.deepseek import mla  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel

    config = tiny("q_lora_rank=16")
    for name, spec in mla.specs(config).items():
        if len(spec.shape) >= 2:
            split = sharding.logical_to_spec(spec.axes, config.logical_axis_rules)
            assert any("fsdp" in ((a,) if isinstance(a, str) else a or ()) for a in split), (name, split)
