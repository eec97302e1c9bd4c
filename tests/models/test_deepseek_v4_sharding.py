"""DeepSeek-V4's parameters beyond the experts (attention, compressors, indexer, hyper-connections, grouped output
projections, shared expert, router) declare logical axes, so FSDP and tensor parallelism split them.

On 8 simulated devices, FSDP 8 and FSDP 2 x TP 4: no parameter of more than LARGE elements is whole on every
device (the control: the same check flags a projection whose axes are taken away), and under FSDP 2 x TP 4 (both
axes at once: FSDP 8 alone is no other code path) three training steps give the losses and gradient norms of one
device (within 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import load_config, with_overrides
from maxtrain.models import decoder
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.parallel import sharding
from maxtrain.training import builder
from sharded_batches import GLOBAL_BATCH, batches

# 3 layers (hash-routed HCA, then top-k CSA and sliding), 8 experts; every size divisible by 8 devices.
V4 = ["decoder_block=deepseek_v4", "base_num_decoder_layers=3", "num_experts=8", "num_experts_per_tok=2",
      "base_moe_mlp_dim=16", "q_lora_rank=16", "index_n_heads=4", "index_head_dim=16", "index_topk=2", "o_groups=2",
      "o_lora_rank=16", "hc_mult=2", "hc_sinkhorn_iters=3", "compress_rate_hca=8", "num_hash_layers=1",
      "partial_rotary_factor=0.5", "sliding_window_size=8",
      "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention,sliding_attention]"]
LAYOUTS = {"fsdp8": ["ici_fsdp_parallelism=8"],
           "fsdp2xtp4": ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"]}
LARGE = 256  # elements: larger than every norm, sink and bias of this model, smaller than every projection


def tiny(*overrides):
    return load_config(with_overrides([BASE_YML, *TINY], *V4, *overrides))


def replicated(specs, mesh, rules) -> list[str]:
    """The trained parameters of more than LARGE elements that no mesh axis of the mesh splits (the hash layers' fixed
    token -> experts table, vocab x top_k, follows the vocabulary over tensor parallelism only)."""
    trivial = sharding.trivial_axes(mesh)
    whole = []
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        named = sharding.logical_to_spec(spec.axes, rules)
        used = {a for entry in named if entry for a in ((entry,) if isinstance(entry, str) else entry)} - trivial
        if np.prod(spec.shape[1:]) > LARGE and not used and not spec.fixed:  # [1:]: the per-layer size (the layers axis is not split)
            whole.append(jax.tree_util.keystr(path))
    return whole


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_large_parameter_is_whole_on_every_device(layout):
    config = tiny(f"per_device_batch_size={GLOBAL_BATCH // 8}", *LAYOUTS[layout])
    mesh = sharding.create_mesh(config, jax.devices())
    specs = Model.bind(config).param_specs
    assert replicated(specs, mesh, config.logical_axis_rules) == []
    # the control: a projection whose axes are taken away is caught
    attn = specs["layers"]["csa_moe"]["self_attn"]
    attn["o_a_proj"]["weight"] = dataclasses.replace(attn["o_a_proj"]["weight"], axes=("layers", None, None))
    assert replicated(specs, mesh, config.logical_axis_rules) == ["['layers']['csa_moe']['self_attn']['o_a_proj']['weight']"]


def test_the_gpu_tiled_loss_gathers_the_nested_hyper_head():
    """On GPUs the tiled loss casts and gathers the head's weights once, before its chunks (decoder._head_for_chunks):
    V4's head holds the hyper head, a nested {fn, base, scale}, which goes through as the flat ones (the H100
    compile of deepseek4-flash raised 'dict' object has no attribute 'ndim' before)."""
    config = tiny(f"per_device_batch_size={GLOBAL_BATCH // 8}", *LAYOUTS["fsdp8"])
    model, rt = Model.bind(config), dataclasses.replace(Runtime.from_config(config), dtype=jax.numpy.bfloat16)
    mesh = sharding.create_mesh(config, jax.devices())
    params = model.init_params(jax.random.key(0))
    head = {k: v for k, v in params.items() if k != "layers"}
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        cast = jax.jit(lambda h: decoder._head_for_chunks(h, model.param_specs, rt)[0])(head)  # pylint: disable=protected-access
    assert cast["hc_head"]["fn"].dtype == jax.numpy.bfloat16 and cast["hc_head"]["base"].dtype == head["hc_head"]["base"].dtype
    np.testing.assert_array_equal(cast["hc_head"]["fn"], head["hc_head"]["fn"].astype(jax.numpy.bfloat16))
    assert cast["hc_head"]["fn"].sharding.is_fully_replicated  # gathered over FSDP ("embed"), whole for the chunks


@functools.lru_cache(maxsize=None)
def train(devices, *overrides):
    r = builder.build(tiny(f"per_device_batch_size={GLOBAL_BATCH // len(devices)}", *overrides), devices=devices)
    history = []
    with sharding.activation_sharding(r.mesh, r.config.logical_axis_rules):
        state = r.init(jax.random.key(0))
        for batch in batches(r.config):
            state, m = r.train_step(state, jax.device_put(batch, r.batch_sharding))
            history.append([float(m[k]) for k in ("loss", "grad_norm")])
    q_b = state["params"]["layers"]["csa_moe"]["self_attn"]["q_b_proj"]["weight"]
    return np.array(history), q_b.sharding.shard_shape(q_b.shape)


@pytest.mark.slow
def test_sharded_training_matches_one_device():
    ref, whole = train(tuple(jax.devices()[:1]), "ici_fsdp_parallelism=1")
    history, shard = train(tuple(jax.devices()), *LAYOUTS["fsdp2xtp4"])
    np.testing.assert_allclose(history, ref, rtol=1e-5)
    assert np.prod(shard) * 8 == np.prod(whole)  # the query projection is split over all 8 devices
