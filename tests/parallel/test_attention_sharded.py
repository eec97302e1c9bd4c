"""Attention kernels under shard_map on 8 simulated CPU devices (Pallas interpret mode).

Under data, FSDP, tensor and FSDP x tensor parallelism, a model using the flash kernel gives the
loss and gradients of dot_product attention on 1 device, and the compiled program gathers none of
q, k and v: each device runs the kernel on its own batch rows and heads. The TPU splash kernel
is checked the same way at the attention level. Without shard_map (the control), GSPMD gathers.

Tolerance: float32, loss to 1e-5 relative, gradients 1e-5 absolute + 1e-4 relative.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.config import with_overrides

from conftest import BASE_YML, TINY
from maxtrain.models import attention, ops
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.parallel import sharding
from maxtrain.config import load_config, with_devices

# Length 64 and head dim 16 appear together in no parameter, only in q, k, v (and the kernels' blocks).
LENGTH, HEAD_DIM = 64, 16
OVERRIDES = with_overrides(TINY, "base_emb_dim=32", "base_num_query_heads=8", "base_num_kv_heads=4",
                           f"head_dim={HEAD_DIM}", "base_mlp_dim=96", "base_num_decoder_layers=1",
                           f"max_target_length={LENGTH}", "sa_block_q=32", "sa_block_kv=32")
MESHES = {  # name: (data, fsdp, tensor)
    "dp": (8, 1, 1),
    "fsdp": (1, 8, 1),
    "tp": (2, 1, 4),
    "fsdp_x_tp": (1, 4, 2),
}
GLOBAL_BATCH = 8


def _config(devices, mesh, attention_name):
    data, fsdp, tensor = mesh
    return with_devices(load_config([BASE_YML, *with_overrides(
        OVERRIDES, f"attention={attention_name}", f"per_device_batch_size={GLOBAL_BATCH / devices}",
        f"ici_data_parallelism={data}", f"ici_fsdp_parallelism={fsdp}", f"ici_tensor_parallelism={tensor}")]),
        devices)


def _batch(cfg):
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, cfg.vocab_size, (GLOBAL_BATCH, LENGTH + 1), dtype=np.int32)
    seg = np.where(np.arange(LENGTH) < 40, 1, 2) * np.ones((GLOBAL_BATCH, 1), np.int32)  # two documents a row
    positions = np.where(seg == 1, np.arange(LENGTH), np.arange(LENGTH) - 40)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg.astype(np.int32),
            "positions": positions.astype(np.int32), "loss_weights": np.ones((GLOBAL_BATCH, LENGTH), np.float32)}


def _loss(params, batch, cfg, rt):
    """Mean token loss; the only call into the model."""
    logits, _ = Model.bind(cfg).forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], rt)
    return ops.cross_entropy(logits, batch["targets"], batch["loss_weights"]) / GLOBAL_BATCH / LENGTH


def _compile(mesh_name, attention_name, devices):
    """(compiled loss-and-grad step, params, batch) on `devices` with the named mesh."""
    cfg = _config(len(devices), MESHES[mesh_name] if len(devices) > 1 else (1, 1, 1), attention_name)
    rt = Runtime.from_config(cfg, "cpu")
    mesh = sharding.create_mesh(cfg, devices)
    rules = cfg.logical_axis_rules
    param_shardings = jax.tree.map(lambda s: sharding.named_sharding(mesh, s.axes, rules), Model.bind(cfg).param_specs,
                                   is_leaf=is_spec)
    batch_sharding = sharding.named_sharding(mesh, ("batch", "length"), rules)
    params = jax.device_put(Model.bind(cfg).init_params(jax.random.key(0)), param_shardings)
    batch = jax.device_put(_batch(cfg), batch_sharding)
    with sharding.activation_sharding(mesh, rules):
        step = jax.jit(jax.value_and_grad(lambda p, b: _loss(p, b, cfg, rt)),
                       in_shardings=(param_shardings, batch_sharding)).lower(params, batch).compile()
    return step, params, batch


def gathers_of_qkv(hlo: str) -> list[str]:
    """All-gathers whose result has both a length and a head_dim axis: q, k, v (or their blocks)."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= \w+\[([\d,]*)\][^=]*? all-gather(-start)?\(", line)
        if match:
            dims = [int(d) for d in match.group(1).split(",") if d]
            if LENGTH in dims and HEAD_DIM in dims:
                found.append(line.strip()[:160])
    return found


@pytest.fixture(scope="module")
def reference():
    step, params, batch = _compile("dp", "dot_product", jax.devices()[:1])
    loss, grads = step(params, batch)
    return float(loss), jax.device_get(grads)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_flash_under_shard_map_matches_one_device(mesh_name, reference):
    step, params, batch = _compile(mesh_name, "flash", jax.devices())
    assert gathers_of_qkv(step.as_text()) == [], "q, k or v is gathered for the kernel"
    loss, grads = step(params, batch)
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    for path, got in jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]:
        want = _at(ref_grads, path)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.slow
def test_without_shard_map_q_k_v_are_gathered(monkeypatch):
    """The control: the same kernel left to GSPMD (no shard_map) is partitioned by gathering its inputs,
    so the check above can fail."""
    monkeypatch.setattr(sharding, "run_in_shards", lambda fn, args, *_: fn(*args))
    step, _, _ = _compile("fsdp_x_tp", "flash", jax.devices())
    assert gathers_of_qkv(step.as_text())


# ----------------------------------------------------------------------------------------------
# The TPU splash kernel (interpreted) under the same meshes, at the attention level.


def _qkv(seed=0, batch=GLOBAL_BATCH, length=128, heads=8, kv_heads=4, head_dim=32):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, length, heads, head_dim))
    k = jax.random.normal(kk, (batch, length, kv_heads, head_dim))
    v = jax.random.normal(kv, (batch, length, kv_heads, head_dim))
    seg = jnp.asarray(np.where(np.arange(length) < 70, 1, 2) * np.ones((batch, 1), np.int32))
    return q, k, v, seg, jax.random.normal(kw, q.shape)


def _attention_loss(implementation, platform):
    def loss(q, k, v, seg, w):
        out = attention.attention(q, k, v, seg, implementation=implementation, platform=platform,
                                  interpret=True, sliding_window=50, logits_soft_cap=20.0)
        return jnp.sum(out * w)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.slow
def test_splash_under_shard_map_matches_one_device():
    q, k, v, seg, w = _qkv()
    ref_loss, ref_grads = jax.jit(_attention_loss("dot_product", "cpu"))(q, k, v, seg, w)
    for mesh_name, (data, fsdp, tensor) in MESHES.items():
        mesh = sharding.mesh_of(jax.devices(), data=data, fsdp=fsdp, tensor=tensor)
        rules = [["batch", ["data", "fsdp"]], ["heads", "tensor"], ["kv_heads", "tensor"]]
        put = lambda x, axes: jax.device_put(x, sharding.named_sharding(mesh, axes, rules))  # noqa: E731
        args = (put(q, ("batch", None, "heads", None)), put(k, ("batch", None, "kv_heads", None)),
                put(v, ("batch", None, "kv_heads", None)), put(seg, ("batch", None)),
                put(w, ("batch", None, "heads", None)))
        with sharding.activation_sharding(mesh, rules):
            step = jax.jit(_attention_loss("flash", "tpu")).lower(*args).compile()
        assert "all-gather" not in step.as_text(), mesh_name
        loss, grads = step(*args)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, err_msg=mesh_name)
        for name, got, want in zip("qkv", grads, ref_grads):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=f"{mesh_name}: d{name}")


def test_heads_and_kv_heads_on_different_axes_is_a_clear_error():
    mesh = sharding.mesh_of(jax.devices(), data=2, tensor=4)
    rules = [["batch", ["data", "fsdp"]], ["heads", "tensor"], ["kv_heads", None]]
    q, k, v, seg, _ = _qkv(length=16, head_dim=16)
    with sharding.activation_sharding(mesh, rules), pytest.raises(
            ValueError, match=r"'heads' on tensor but 'kv_heads' on None.*same mesh axes"):
        attention.attention(q, k, v, seg, implementation="flash", platform="cpu")
