"""The gated delta-net under context parallelism (models/recurrent/context_parallel.py) on simulated CPU devices.

At the layer level: the gated delta-net mixer of x in the dual_chunk_swap layout, split over CP 2 or 4 devices,
taken back to the original order, equals the mixer on one device: values and the gradients of a fixed weighted sum
with respect to x and every parameter. The rows are packed: documents start inside a device's chunk and span
chunks and devices. The control: the same rows with every chunk cut off from the one before (its convolution
window and its entering state) are far from the reference, so the comparison sees the hand-over. At the model
level: a tiny Qwen3-Next's (and Qwen3.5's) loss and gradients under CP 2, with the all_gather and the ring
attention, equal one device's.

Tolerances: float32 sums in another order (chunk boundaries that differ, the state's correction S0^T W added
after): measured differences ~1e-6; a lost hand-over moves values at the 1e-1 level.
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
from maxtrain.models.model import Model
from maxtrain.models.recurrent import gated_deltanet
from maxtrain.models.runtime import Runtime
from maxtrain.parallel import context, sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

B, T = 2, 64
RULES = [["batch", ["data", "fsdp", "expert"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]
EXPERTS = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "shared_experts=1"]
HYBRID = ["decoder_block=qwen3_next", "base_num_decoder_layers=2", "inhomogeneous_layer_cycle_interval=2", *EXPERTS,
          "gdn_num_key_heads=2", "gdn_num_value_heads=4", "gdn_key_head_dim=8", "gdn_value_head_dim=8",
          "gdn_chunk_size=8", "partial_rotary_factor=0.5"]


def _layer_setup(*overrides):
    cfg = load_config([BASE_YML, *with_overrides(with_overrides(TINY, *HYBRID, f"max_target_length={T}"), *overrides)])
    rng = np.random.default_rng(0)
    params = {name: jnp.asarray(rng.normal(size=spec.shape) * (0.3 if name not in ("dt_bias", "lin_norm") else 1.0),
                                jnp.float32) for name, spec in gated_deltanet.specs(cfg).items()}
    x = jnp.asarray(rng.normal(size=(B, T, cfg.base_emb_dim)), jnp.float32)
    segment_ids = np.zeros((B, T), np.int32)  # documents across chunk (8 tokens at CP 4) and device boundaries
    segment_ids[0, :13], segment_ids[0, 13:50], segment_ids[0, 50:61] = 1, 2, 3  # then padding (0)
    segment_ids[1, :3], segment_ids[1, 3:40], segment_ids[1, 40:] = 1, 2, 3
    weights = jnp.asarray(rng.normal(size=(B, T, cfg.base_emb_dim)), jnp.float32)
    return cfg, Runtime.from_config(cfg), params, x, jnp.asarray(segment_ids), weights


def _loss(cfg, rt, segment_ids, weights):
    def loss(x, params):
        out = gated_deltanet.mixer(x, params, segment_ids, cfg, rt)
        return jnp.sum(out * weights), out
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _one_device(cfg, rt, params, x, segment_ids, weights):
    (_, out), (dx, dp) = jax.jit(_loss(cfg, rt, segment_ids, weights))(x, params)
    return out, dx, dp


def _split(cp, cfg, rt, params, x, segment_ids, weights):
    mesh = sharding.mesh_of(jax.devices()[:cp], context=cp)
    x, segment_ids, weights = context.to_layout((x, segment_ids, weights), cp)
    with sharding.activation_sharding(mesh, RULES):
        (_, out), (dx, dp) = jax.jit(_loss(cfg, rt, segment_ids, weights))(x, params)
    return context.from_layout(out, cp), context.from_layout(dx, cp), dp


def _assert_close(got, ref, what):
    """Within float32 rounding of sums in another order: rtol 1e-4, and an absolute slack of 1e-6 of the array's
    largest entry (a gradient entry near 0 that sums terms of 100 differs by ~1e-5 in the last place)."""
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=max(2e-5, 1e-6 * float(np.abs(ref).max())),
                               err_msg=what)


@pytest.mark.slow  # ~20 s a case on 2 shared cores (2026-11-29): compile-bound
@pytest.mark.parametrize("cp", [2, 4])
def test_the_layer_split_over_the_context_group_equals_one_device(cp):
    cfg, rt, params, x, segment_ids, weights = _layer_setup()
    ref_out, ref_dx, ref_dp = _one_device(cfg, rt, params, x, segment_ids, weights)
    out, dx, dp = _split(cp, cfg, rt, params, x, segment_ids, weights)
    _assert_close(out, ref_out, "out")
    _assert_close(dx, ref_dx, "d loss / d x")
    for name in ref_dp:
        _assert_close(dp[name], ref_dp[name], f"d loss / d {name}")


def test_the_layer_forward_split_four_ways_equals_one_device():
    """The default run's share of the slow test above: values only, CP 4 (each device two chunks of 8 tokens)."""
    cfg, rt, params, x, segment_ids, _ = _layer_setup()
    def mixer(x, params, segment_ids):  # a new function for each jit: jit's cache does not see the mesh
        return gated_deltanet.mixer(x, params, segment_ids, cfg, rt)
    ref_out = jax.jit(mixer)(x, params, segment_ids)
    x, segment_ids = context.to_layout((x, segment_ids), 4)
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:4], context=4), RULES):
        out = jax.jit(lambda *args: mixer(*args))(x, params, segment_ids)
    _assert_close(context.from_layout(out, 4), ref_out, "out")


def test_the_hand_over_matters_for_these_rows():
    """The control: each of the 8 chunks (CP 4) cut off from the one before (a new document id at every chunk
    start: no convolution window, no entering state) is far from the reference."""
    cfg, rt, params, x, segment_ids, _ = _layer_setup()
    mixer = jax.jit(functools.partial(gated_deltanet.mixer, config=cfg, rt=rt))
    ref_out = mixer(x, params, segment_ids)
    cut_out = mixer(x, params, segment_ids + 100 * (jnp.arange(T) // (T // 8))[None])
    assert np.max(np.abs(np.asarray(cut_out) - np.asarray(ref_out))) > 1e-2


def test_striped_is_refused_by_the_layer():
    cfg, rt, params, x, segment_ids, _ = _layer_setup()
    cfg = cfg.replace(context_parallel_reorder_strategy="striped")
    with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:2], context=2), RULES):
        with pytest.raises(ValueError, match="context_parallel_reorder_strategy=dual_chunk_swap, not 'striped'"):
            gated_deltanet.mixer(x, params, segment_ids, cfg, rt)


def _largest_float_array(cp, length):
    """The element count of the largest float32 array of the layer's compiled per-device program (value and
    gradients) at `length` tokens, one row, split over cp devices (cp = 1: no mesh)."""
    cfg, rt, params, _, _, _ = _layer_setup(f"max_target_length={length}")
    x, segment_ids = jnp.ones((1, length, cfg.base_emb_dim), jnp.float32), jnp.ones((1, length), jnp.int32)
    step = jax.jit(jax.value_and_grad(lambda x, p: jnp.sum(gated_deltanet.mixer(x, p, segment_ids, cfg, rt)),
                                      argnums=(0, 1)))
    if cp == 1:
        text = step.lower(x, params).compile().as_text()
    else:
        with sharding.activation_sharding(sharding.mesh_of(jax.devices()[:cp], context=cp), RULES):
            text = step.lower(x, params).compile().as_text()
    return max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"f32\[([0-9,]*)\]", text))


@pytest.mark.slow  # ~15 s on 2 shared cores (2026-11-29)
def test_each_device_holds_its_own_tokens_not_the_sequence():
    """At T = 512 over 4 devices no float array of the program is larger than one device's T / 4 tokens of its
    widest per-token array: the solve's right-hand side [N, Dv + Dk + Dk] (the values widened by Dk, and the keys)
    or the convolution's channels. Nothing gathers the sequence: one device's program holds [T, channels]."""
    cfg = _layer_setup()[0]
    channels = gated_deltanet.conv_channels(cfg)
    solve = cfg.gdn_num_value_heads * (cfg.gdn_value_head_dim + 2 * cfg.gdn_key_head_dim)
    per_device = (512 // 4) * max(channels, solve)
    assert _largest_float_array(4, 512) <= per_device < 512 * channels <= _largest_float_array(1, 512)


# --------------------------------------------------------------------------------------------
# Tiny hybrid models: loss and gradients under CP 2 equal one device's
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _loss_and_grads(n_devices: int, family: str, *overrides):
    hybrid = HYBRID if family == "qwen3_next" else [o for o in HYBRID if o not in EXPERTS]  # qwen3_5_text: dense
    argv = with_overrides(with_overrides([BASE_YML, *TINY], *hybrid), f"decoder_block={family}",
                          f"per_device_batch_size={GLOBAL_BATCH // n_devices}", "ici_fsdp_parallelism=1", *overrides)
    run = builder.build(load_config(argv), devices=tuple(jax.devices()[:n_devices]))
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))  # [B, T]: two packed documents a row
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, _ = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return loss / weight
        loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    return float(loss), jax.tree.map(np.asarray, grads)


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(b[1])[0], jax.tree.leaves(a[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_tiny_hybrid_under_context_parallelism_gives_the_loss_and_gradients_of_one_device(family, strategy):
    one_device = _loss_and_grads(1, family)
    split = _loss_and_grads(2, family, "ici_context_parallelism=2", f"context_parallel_strategy={strategy}")
    _assert_same(split, one_device)


@pytest.mark.slow
def test_the_kernel_split_over_the_context_group_equals_one_device():
    """gdn_kernel=pallas (interpret mode on CPU: the GPU kernel) at CP 2: the kernel runs on each device's chunks
    from the state [0 | I] (its initial_state), the values widened to Dv + Dk = 48 columns and padded to 64 (its
    value blocks), and its backward through the jnp form."""
    cfg, rt, params, x, segment_ids, weights = _layer_setup("gdn_kernel=pallas", "gdn_chunk_size=16",
                                                            "gdn_key_head_dim=16", "gdn_value_head_dim=32")
    assert rt.gdn_kernel == "pallas"
    ref_out, ref_dx, ref_dp = _one_device(cfg, rt, params, x, segment_ids, weights)
    out, dx, dp = _split(2, cfg, rt, params, x, segment_ids, weights)
    _assert_close(out, ref_out, "out")
    _assert_close(dx, ref_dx, "d loss / d x")
    for name in ref_dp:
        _assert_close(dp[name], ref_dp[name], f"d loss / d {name}")
