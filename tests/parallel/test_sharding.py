"""DP, FSDP, TP and FSDP x TP on 8 simulated CPU devices train exactly like one device."""

import functools
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import BASE_YML, TINY, slow_params
from sharded_batches import GLOBAL_BATCH, batches
from maxtrain.training import builder
from maxtrain.models.model import Model
from maxtrain.parallel import sharding
from maxtrain.config import load_config, with_overrides


@functools.lru_cache(maxsize=None)
def run(devices, *overrides, accumulation=1):
    per_device = GLOBAL_BATCH // len(devices) // accumulation
    r = builder.build(load_config([BASE_YML, *with_overrides(TINY, f"per_device_batch_size={per_device}",
                                   f"gradient_accumulation_steps={accumulation}", *overrides)]), devices=devices)
    losses = []
    with sharding.activation_sharding(r.mesh, r.config.logical_axis_rules):
        state = r.init(jax.random.key(0))
        for batch in batches(r.config):
            state, m = r.train_step(state, jax.device_put(batch, r.batch_sharding))
            losses.append(float(m["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def single_device():
    return run(tuple(jax.devices()[:1]), "ici_fsdp_parallelism=1")


# Different meshes reduce in different orders; float32 results agree to ~1e-6 relative.
# 1e-5 on the loss and 1e-4 on the params after 3 AdamW steps leaves margin while catching any real error
# (a wrong sharding or a missing reduction changes the loss at the 1e-2 level).
@pytest.mark.parametrize("overrides", slow_params([
    ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"],
    ["ici_fsdp_parallelism=8"],
    ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=1", "ici_data_parallelism=4"],
    ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
], {"dp8"}, ids=["dp8", "fsdp8", "dp4xtp2", "fsdp4xtp2"]))
def test_parallelism_matches_single_device(single_device, overrides):
    ref_losses, ref_state = single_device
    losses, state = run(tuple(jax.devices()), *overrides)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for ref, got in zip(jax.tree.leaves(ref_state["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-6)


def test_params_carry_the_rule_shardings():
    _, state = run(tuple(jax.devices()), "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    params, opt_state = state["params"], state["opt_state"]
    assert params["layers"]["decoder"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert params["layers"]["decoder"]["wo"].sharding.spec == P(None, "tensor", None, "fsdp")
    assert params["layers"]["decoder"]["w_down"].sharding.spec == P(None, "tensor", "fsdp")
    assert params["token_embedding"].sharding.spec == P("tensor", "fsdp")
    assert params["output"].sharding.spec == P("fsdp", "tensor")
    assert params["final_norm"].sharding.spec == P("fsdp")
    shard_shape = params["layers"]["decoder"]["w_gate"].addressable_shards[0].data.shape
    assert shard_shape == (2, 32 // 4, 64 // 2)
    # Adam moments follow their parameter.
    mu = opt_state[1][0].mu
    assert mu["layers"]["decoder"]["wq"].sharding.spec == params["layers"]["decoder"]["wq"].sharding.spec


def test_switching_rules_moves_parameters():
    rules = '[["batch", ["data", "fsdp"]], ["embed", "tensor"], ["mlp", "fsdp"]]'
    cfg = load_config([BASE_YML, *TINY, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                       f"logical_axis_rules={rules}"])
    assert sharding.logical_to_spec(("embed", "mlp"), cfg.logical_axis_rules) == P("tensor", "fsdp")
    assert sharding.logical_to_spec(("batch", "length", "embed"), cfg.logical_axis_rules) == P(("data", "fsdp"), None, "tensor")


def test_a_mesh_that_does_not_fit_the_devices_or_model():
    cfg = load_config([BASE_YML, *TINY, "ici_fsdp_parallelism=3"])
    with pytest.raises(sharding.MeshError, match="ici_fsdp_parallelism=3 .* there are 8 devices per slice"):
        sharding.create_mesh(cfg, jax.devices())
    cfg = load_config([BASE_YML, *TINY, "ici_tensor_parallelism=2"])
    with pytest.raises(sharding.MeshError, match="ici_tensor_parallelism=2 need a multiple of 2 devices per slice, "
                                                 "but there are 1"):
        sharding.create_mesh(cfg, jax.devices()[:1])
    cfg = load_config([BASE_YML, *with_overrides(TINY, "base_emb_dim=36", "ici_fsdp_parallelism=8")])
    mesh = sharding.create_mesh(cfg, jax.devices())
    spec = Model.bind(cfg).param_specs["layers"]["decoder"]["wq"]
    with pytest.raises(sharding.MeshError, match="'embed' axis .* 36 is not divisible by 8"):
        sharding.check_divisible("wq", spec.shape, spec.axes, mesh, cfg.logical_axis_rules)


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(single_device):
    """4 micro-batches of 2 give the same update as one batch of 8 (losses are token-weighted sums)."""
    ref_losses, ref_state = single_device
    losses, state = run(tuple(jax.devices()[:1]), "ici_fsdp_parallelism=1", accumulation=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for ref, got in zip(jax.tree.leaves(ref_state["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-6)


def test_gpus_that_report_one_slice_are_grouped_by_host_when_num_slices_asks():
    """JAX's NVIDIA devices say slice_index 0 on every host; num_slices=2 makes each host's 8 a slice (the DCN axes
    of usp and MaxText's GPU meshes), while TPU devices' own slices stay authoritative."""
    gpus = [types.SimpleNamespace(id=i, platform="gpu", slice_index=0, process_index=i // 8) for i in range(16)]
    slices = sharding.slices_of(list(reversed(gpus)), 2)
    assert [[d.id for d in s] for s in slices] == [list(range(8)), list(range(8, 16))]
    assert len(sharding.slices_of(gpus, -1)) == 1
    tpus = [types.SimpleNamespace(id=i, platform="tpu", slice_index=0, process_index=i // 4) for i in range(16)]
    with pytest.raises(sharding.MeshError, match="num_slices=2, but the devices report 1 slice"):
        sharding.slices_of(tpus, 2)
