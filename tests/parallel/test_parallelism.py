"""Context parallelism, pipeline parallelism and the multi-slice hybrid mesh on 8 simulated CPU devices:
each gives the loss and gradients of one device.

Every layout computes, with the same initial parameters and batch, the loss and the gradient of every
parameter (one jitted value_and_grad of models.loss_fn under the layout's mesh and rules), and the
combined layouts also train three steps with the builder's train step. Tolerances are those of
test_sharding.py: different meshes add the same float32 numbers in different orders (measured
differences ~1e-7 relative); a wrong mask, a lost micro-batch or a stage applied twice changes the
loss at the 1e-2 level.
"""

import functools

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain.training import builder
from maxtrain.parallel import context as context_parallel
from maxtrain.parallel import sharding

from maxtrain.models.model import Model
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.parallel import stages as pipeline_stages
from sharded_batches import GLOBAL_BATCH, batches

LAYERS = ["base_num_decoder_layers=4"]   # 4 layers: 4 stages of 1, 2 stages of 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6


def build(devices, overrides, accumulation=1):
    per_device = GLOBAL_BATCH // len(devices) // accumulation
    argv = with_overrides([BASE_YML, *TINY], *LAYERS, f"per_device_batch_size={per_device}",
                          f"gradient_accumulation_steps={accumulation}", *overrides)
    return builder.build(load_config(argv), devices=devices)


@functools.lru_cache(maxsize=None)
def loss_and_grads(n_devices: int, *overrides):
    """(loss, grads as numpy) of the first batch, computed on the first n_devices devices."""
    run = build(tuple(jax.devices()[:n_devices]), overrides)
    batch = jax.tree.map(lambda a: a[0], next(batches(run.config)))  # [B, T]
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        params = run.init(jax.random.key(0))["params"]
        batch = jax.device_put(batch, run.eval_batch_sharding)

        def mean_loss(p):
            loss, weight, _ = Model.bind(run.config).loss_fn(p, batch, run.rt)
            return loss / weight
        loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params, )
    return float(loss), jax.tree.map(np.asarray, grads)


@functools.lru_cache(maxsize=None)
def train_losses(n_devices: int, *overrides):
    """Losses of three train steps and the final params (as numpy)."""
    run = build(tuple(jax.devices()[:n_devices]), overrides)
    losses = []
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        state = run.init(jax.random.key(0))
        for batch in batches(run.config):
            state, m = run.train_step(state, jax.device_put(batch, run.batch_sharding))
            losses.append(float(m["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state["params"])


def assert_same_loss_and_grads(n_devices, overrides):
    ref_loss, ref_grads = loss_and_grads(1, "ici_fsdp_parallelism=1")
    loss, grads = loss_and_grads(n_devices, *overrides)
    assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    for (path, ref), got in zip(jax.tree_util.tree_flatten_with_path(ref_grads)[0], jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, ref, rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=jax.tree_util.keystr(path))


LAYOUTS = {
    "cp2": (2, ["ici_context_parallelism=2", "ici_fsdp_parallelism=1"]),
    "cp4": (4, ["ici_context_parallelism=4", "ici_fsdp_parallelism=1"]),
    "cp2xfsdp2xtp2": (8, ["ici_context_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]),
    "pp2": (2, ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1", "num_pipeline_microbatches=4"]),
    "pp4": (4, ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=1"]),
    "pp2xfsdp4": (8, ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]),
    "pp4xfsdp2": (8, ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2"]),
    "pp2xcp2xtp2": (8, ["ici_pipeline_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2",
                        "ici_fsdp_parallelism=1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_gives_the_loss_and_gradients_of_one_device(name):
    n_devices, overrides = LAYOUTS[name]
    assert_same_loss_and_grads(n_devices, overrides)


@pytest.mark.parametrize("name", slow_params(["cp2xfsdp2xtp2", "pp2xfsdp4"], {"pp2xfsdp4"}))
def test_training_steps_match_one_device(name):
    n_devices, overrides = LAYOUTS[name]
    ref_losses, ref_params = train_losses(1, "ici_fsdp_parallelism=1")
    losses, params = train_losses(n_devices, *overrides)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    for ref, got in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, ref, rtol=GRAD_RTOL, atol=GRAD_ATOL)


@pytest.mark.slow
def test_multi_slice_hybrid_mesh_trains_like_the_flat_mesh():
    """dcn_data_parallelism=2 x ici_fsdp_parallelism=4 over 2 simulated slices of 4 devices."""
    hybrid = ("num_slices=2", "dcn_data_parallelism=2", "ici_fsdp_parallelism=4")
    run = build(tuple(jax.devices()), hybrid)
    assert dict(run.mesh.shape)["data"] == 2 and dict(run.mesh.shape)["fsdp"] == 4
    slices = sharding.slices_of(jax.devices(), 2)
    for row, devices in zip(run.mesh.devices.reshape(2, 4), slices):  # each data replica is one slice
        assert sorted(d.id for d in row) == sorted(d.id for d in devices)
    ref_losses, ref_params = train_losses(1, "ici_fsdp_parallelism=1")
    losses, params = train_losses(8, *hybrid)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    for ref, got in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, ref, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# --------------------------------------------------------------------------------------------
# The pieces: layouts, schedules and the errors of layouts that cannot run
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_load_balanced_layout_gives_every_device_the_same_causal_work(cp):
    length = 64
    order = context_parallel.layout(length, cp)
    assert sorted(order) == list(range(length))                     # a permutation
    per_device = order.reshape(cp, length // cp)
    work = [int(np.sum(block + 1)) for block in per_device]         # keys a causal query at index t sees: t + 1
    assert len(set(work)) == 1, work
    chunk = length // (2 * cp)
    assert list(per_device[0][:chunk]) == list(range(chunk))        # device 0: the first chunk and the last
    assert list(per_device[0][chunk:]) == list(range(length - chunk, length))
    restored = np.asarray(context_parallel.from_layout(context_parallel.to_layout(np.arange(length)[None], cp), cp))
    assert list(restored[0]) == list(range(length))


def test_pipeline_schedule_and_its_bubble():
    sched = pipeline_stages.Schedule(stages=4, microbatches=8, layers_per_stage=2)
    assert sched.iterations == 11 and sched.bubble == pytest.approx(3 / 11)
    line = sched.describe(rows=16)
    assert "4 stages x 2 layers" in line and "8 micro-batches of 2 rows" in line and "bubble 3/11 = 27.3%" in line


def test_summary_prints_the_pipeline_schedule():
    run = build(tuple(jax.devices()), ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"])
    compiled = run.compile()
    text = builder.summarize(run, compiled, 0.0)
    assert "pipeline: 2 stages x 2 layers, GPipe schedule, 2 micro-batches of 4 rows, 3 iterations, bubble 1/3" in text
    assert "'stage': 2" in text


def test_stages_must_hold_the_same_layer_types():
    """Gemma 3's pattern (5 sliding, 1 full) does not repeat within 2 stages of 3 layers."""
    overrides = ["decoder_block=gemma3", "base_num_decoder_layers=6", "sliding_window_size=8",
                 "local_rope_max_timescale=10000", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]
    with pytest.raises(pipeline_stages.PipelineError, match="stage 0 has .*sliding.* and stage 1 has .*full"):
        builder.build(load_config(with_overrides([BASE_YML, *TINY], *overrides)), devices=tuple(jax.devices()))


@pytest.mark.parametrize("overrides, message", [
    (["ici_pipeline_parallelism=3", "base_num_decoder_layers=4"],
     "pipeline parallelism 3 .* must divide base_num_decoder_layers=4"),
    (["ici_context_parallelism=4", "max_target_length=36"],
     "splits each sequence into 8 chunks .* max_target_length=36 must be a multiple of 8"),
    (["num_pipeline_microbatches=0"], "num_pipeline_microbatches=0 is not allowed: it must be -1 or >= 1"),
    (["ici_context_parallelism=-1", "ici_fsdp_parallelism=-1"], "only one ici_\\*_parallelism may be -1"),
    (["num_slices=0"], "num_slices=0 is not allowed: it must be -1 or >= 1"),
])
def test_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(with_overrides([BASE_YML, *TINY], *overrides))


def test_mesh_errors_name_the_fix():
    with pytest.raises(pipeline_stages.PipelineError, match="micro-batch of 8 sequences .* num_pipeline_microbatches=3"):
        build(tuple(jax.devices()[:2]), ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1",
                                         "num_pipeline_microbatches=3"])
    with pytest.raises(sharding.MeshError, match="num_slices=3 does not divide the 8 devices"):
        build(tuple(jax.devices()), ["num_slices=3"])
    with pytest.raises(sharding.MeshError, match="ici_context_parallelism=3 need a multiple of 3 devices"):
        build(tuple(jax.devices()), ["ici_context_parallelism=3", "max_target_length=48"])
