"""What is particular to gpt-oss: attention sinks (dot_product, the flash and splash kernels, cuDNN's
refusal), the clamped SwiGLU experts with biases, the same loss and gradients on a mesh as on one
device, and its config errors.

Parity with transformers is in test_families.py, parameter counts and FLOPs in test_presets.py.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain.models.model import Model
from maxtrain.models import decoder
from maxtrain.models import model_keys
from maxtrain.models.runtime import Runtime
from maxtrain.checkpointing import convert
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.models import attention, moe
from maxtrain.models.moe import expert_matmuls
from maxtrain.parallel import sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

GPT_OSS = ["decoder_block=gpt_oss", "num_experts=4", "num_experts_per_tok=2", "sliding_window_size=8",
           "mlp_activations_limit=1.0"]


def _reference_with_sink_column(q, k, v, mask, sinks, scale):
    """transformers' formulation: the sink as a concatenated column of the scores, dropped after the softmax."""
    b, t, n, h = q.shape
    r = n // k.shape[2]
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    scores = jnp.where(mask[:, None], scores, -1e30)
    column = jnp.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.slow
def test_sinks_are_one_more_softmax_column():
    """dot_product_attention in both layouts and the CPU's causal chunks, values and gradients (the sinks'
    included), against transformers' formulation."""
    b, t, n, g, h = 2, 40, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(keys[i], (b, t, n if i == 0 else g, h)) for i in range(3))
    sinks = 2.0 * jax.random.normal(keys[3], (n,))
    segments = jnp.ones((b, t), jnp.int32).at[1, 15:].set(2)
    mask = attention.make_attention_mask(segments, segments, sliding_window=12)

    def forms(q, k, v, sinks):
        return (attention.dot_product_attention(q, k, v, mask, scale=0.3, sinks=sinks),
                attention.dot_product_attention(q, k, v, mask, scale=0.3, heads_major=True, sinks=sinks),
                # two chunks of 20 queries
                attention.causal_chunks(q, k, v, segments, sliding_window=12, scale=0.3, min_chunk=16, sinks=sinks))

    def reference(q, k, v, sinks):
        return _reference_with_sink_column(q, k, v, mask, sinks, 0.3)

    def values_and_grads(f):
        def one(*args):
            out, pull = jax.vjp(f, *args)
            return out, pull(cotangent)
        return jax.jit(one)(q, k, v, sinks)

    cotangent = jax.random.normal(keys[4], (b, t, n, h))
    with jax.default_matmul_precision("highest"):
        want_out, want_grads = values_and_grads(reference)
        for i in range(3):
            out, grads = values_and_grads(lambda *a, i=i: forms(*a)[i])
            np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
            for a, e in zip(grads, want_grads):  # the sinks' gradient included
                np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4,
                                           atol=1e-4 * float(jnp.max(jnp.abs(e))))
        # A sink far below every score takes nothing: plain attention.
        plain = attention.dot_product_attention(q, k, v, mask, scale=0.3)
        np.testing.assert_allclose(np.asarray(jax.jit(forms)(q, k, v, jnp.full((n,), -1e4))[1]), np.asarray(plain),
                                   atol=1e-6)


@pytest.mark.parametrize("platform", slow_params(["gpu", "tpu"], {"gpu"}))
def test_the_flash_kernels_add_the_sinks_exactly(platform):
    """The Triton kernel (sinks applied to its output and log-sum-exp) and the splash kernel (which has
    them), interpreted on CPU: output and gradients of q, k, v and the sinks, against dot_product."""
    b, t, n, g, h = 1, 64, 4, 2, 32
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(keys[i], (b, t, n if i == 0 else g, h)) for i in range(3))
    sinks, cotangent = 2.0 * jax.random.normal(keys[3], (n,)), jax.random.normal(keys[4], (b, t, n, h))
    segments = jnp.ones((b, t), jnp.int32).at[0, 40:].set(2)
    block = 32 if platform == "gpu" else 128  # splash's blocks are multiples of 128

    def run(implementation):
        def f(q, k, v, sinks):
            return attention.attention(q, k, v, segments, implementation=implementation, platform=platform,
                                       sliding_window=20, scale=0.3, sinks=sinks, interpret=True, block_q=block,
                                       block_kv=block)
        return jax.jit(lambda *a: (lambda o, pull: (o, *pull(cotangent)))(*jax.vjp(f, *a)))(q, k, v, sinks)

    with jax.default_matmul_precision("highest"):
        for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), run("flash"), run("dot_product")):
            assert got.dtype == jnp.float32, name
            assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want))), name


def test_autoselected_keeps_the_kernels_and_cudnn_refuses_sinks():
    assert attention.resolve_implementation("autoselected", "cpu", sinks=True) == "dot_product"
    for platform in ("gpu", "tpu"):
        assert attention.resolve_implementation("autoselected", platform, sinks=True) == "flash"
    with pytest.raises(ValueError, match=r"attention=cudnn does not implement sinks=True, which this model uses\. "
                                         r"Use attention=flash, dot_product or autoselected"):
        attention.resolve_implementation("cudnn", "gpu", dtype=jnp.bfloat16, sinks=True)
    with pytest.raises(ValueError, match="attention=cudnn does not implement sinks=True"):
        Runtime.from_config(tiny("attention=cudnn", "dtype=bfloat16"), "gpu")
    q = jnp.zeros((1, 16, 2, 16))
    with pytest.raises(ValueError, match="does not implement sinks=True; use attention=dot_product"):
        attention.attention(q, q, q, jnp.ones((1, 16), jnp.int32), implementation="cudnn", platform="gpu",
                            sinks=jnp.zeros(2))


def test_clamped_swiglu_is_gpt_oss_activation():
    s = moe.Settings(num_experts=2, top_k=1, router="topk_softmax", norm_topk_prob=True, dispatch="dropless",
                     capacity_factor=1.0, load_balance_loss_weight=0.0, router_z_loss_weight=0.0, num_moe_layers=1,
                     dtype=jnp.float32, activation="clamped_swiglu", alpha=1.702, limit=7.0)
    gate = np.array([-9.0, -1.0, 0.5, 6.0, 9.0], np.float32)
    up = np.array([-9.0, 3.0, -0.5, 8.0, 2.0], np.float32)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    np.testing.assert_allclose(np.asarray(expert_matmuls.gated(jnp.asarray(gate), jnp.asarray(up), s)), want, rtol=1e-6)


def _random_biases(params, key):
    """Every bias and sink drawn at random (they start at zero), so that the mesh test exercises them. Each is keyed
    by a checksum of its name, the same in every process (Python's hash() of a string is salted per process, and
    one draw in many routed a token within float error of a tie, failing the mesh test now and then)."""
    def draw(path, a):
        name = jax.tree_util.keystr(path[-1:])
        if any(b in name for b in ("'b", "sinks")):
            return 0.5 * jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), a.shape, a.dtype)
        return a
    return jax.tree_util.tree_map_with_path(draw, params)


def tiny(*overrides):
    return load_config(with_overrides(with_overrides([BASE_YML, *TINY], *GPT_OSS), *overrides))


@pytest.mark.slow
def test_expert_biases_cut_with_the_hidden_chunks_compute_the_same_model():
    """num_moe_hidden_tiling=4: the gate and up biases are cut with the experts' hidden axis, the down
    bias added once."""
    config = tiny("max_target_length=16")
    params = jax.jit(lambda key: _random_biases(Model.bind(config).init_params(key), jax.random.fold_in(key, 1)))(
        jax.random.key(3))
    rt = Runtime.from_config(config)

    def forward(config, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        with jax.default_matmul_precision("highest"):
            return jax.jit(lambda p: Model.bind(config).forward(p, ids, positions, jnp.ones_like(ids), rt)[0])(params)

    ids = jax.random.randint(jax.random.key(5), (2, 16), 0, config.vocab_size)
    np.testing.assert_allclose(np.asarray(forward(config.replace(num_moe_hidden_tiling=4), ids)),
                               np.asarray(forward(config, ids)), rtol=1e-5, atol=1e-5)


def _loss_and_grads(n_devices, *overrides):
    config = tiny(f"per_device_batch_size={GLOBAL_BATCH // n_devices}", *overrides)
    run = builder.build(config, devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        params = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                              jax.jit(_random_biases)(jax.device_get(params), jax.random.key(1)), params)
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, aux = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return decoder.objective(loss, weight, aux) / weight
        loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow
def test_context_expert_and_tensor_parallel_mesh_gives_one_device_loss_and_gradients():
    """Sinks under context parallelism, expert biases on experts split over `expert` and their hidden
    axis over `tensor` (b_down added once, after the tensor sum): the loss and every gradient of one device.
    One device dispatches by capacity with room for every token, the mesh dropless: both add the biases alike."""
    ref_loss, ref_grads = _loss_and_grads(1, "ici_fsdp_parallelism=1", "moe_dispatch=capacity", "capacity_factor=2.0")
    loss, grads = _loss_and_grads(8, "ici_fsdp_parallelism=1", "ici_context_parallelism=2", "ici_expert_parallelism=2",
                                  "ici_tensor_parallelism=2", "moe_dispatch=dropless")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(ref_grads)[0], jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.max(np.abs(ref)), err_msg=jax.tree_util.keystr(path))
    assert np.max(np.abs(ref_grads["layers"]["moe"]["sinks"])) > 0 and np.max(np.abs(ref_grads["layers"]["moe"]["b_down"])) > 0


@pytest.mark.parametrize("overrides, message", [
    (["mlp_only_layers=[1]"], r"mlp_only_layers=\[1\] does nothing without decoder_block=qwen3_moe"),
    (["norm_topk_prob=false"], r"norm_topk_prob=false does nothing without decoder_block=qwen3_moe"),
    (["mlp_activations_limit=0"], "mlp_activations_limit"),
    (["num_experts_per_tok=5"], "num_experts_per_tok=5 is more than num_experts=4"),
])
def test_impossible_settings_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny(*overrides)


def test_the_released_config_json_imports_as_the_preset():
    """gpt-oss-20b's config.json as published (MXFP4 quantization, rope_scaling, layer_types) reads as the
    gpt-oss-20b preset, key for key."""
    released = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "quantization_config": {"quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "vocab_size": 201088}
    preset = load_config([BASE_YML, "model_name=gpt-oss-20b"])
    keys = convert.model_keys(released)
    assert {k: keys[k] for k in model_keys.MODEL_KEYS} == {k: getattr(preset, k) for k in model_keys.MODEL_KEYS}
