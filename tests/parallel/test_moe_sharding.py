"""Expert parallelism on 8 simulated CPU devices trains exactly like one device.

A tiny mixtral (8 experts, 2 per token) runs 3 AdamW steps on the same batches (two documents per
row, rows ending in padding) on one device and on EP 8, EP 4 x FSDP 2 and FSDP 8 meshes, with both dispatch
strategies; capacity dispatch at factor 1 drops tokens, the same ones on every mesh (capacity is
counted per sequence). Losses, grad norms, aux losses and the first step's gradients are compared,
and the params after 3 steps (which carry every step's gradients through AdamW).

Tolerances: different meshes reduce in different orders; float32 results agree to ~1e-6 relative.
1e-5 on losses, and 1e-4 on gradients and params (elementwise, with an absolute floor of 1e-5 of
the tensor's largest gradient, 1e-6 for params: an entry that is a near-cancelling sum moves by a
few 1e-6 with the order of its terms), leave margin while a wrong routing, a missing psum or a
token sent to the wrong expert changes them at the 1e-2 level.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import BASE_YML, TINY
from maxtrain.training import builder
from maxtrain.models import decoder
from maxtrain.models.model import Model
from maxtrain.parallel import sharding
from maxtrain.config import load_config, with_overrides
from sharded_batches import GLOBAL_BATCH, batches

MOE = ["decoder_block=mixtral", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=32",
       "load_balance_loss_weight=0.01", "router_z_loss_weight=0.001", "capacity_factor=1.0"]
LAYOUTS = {"ep8": ["ici_expert_parallelism=8", "ici_fsdp_parallelism=1"],
           "ep4xfsdp2": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
           "fsdp8": ["ici_expert_parallelism=1", "ici_fsdp_parallelism=8"],
           # the experts' hidden axis (32) in 4 chunks, each gathered and reduce-scattered in turn
           "ep4xfsdp2-chunks4": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "num_moe_hidden_tiling=4"],
           # the Pallas grouped GEMM GPUs run (kernels/grouped_matmul.py), here in interpret mode, inside shard_map
           "ep4xfsdp2-pallas": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "moe_grouped_matmul=pallas"]}


@functools.lru_cache(maxsize=None)
def run(devices, dispatch, *overrides):
    r = builder.build(load_config(with_overrides(
        [BASE_YML, *TINY], f"per_device_batch_size={GLOBAL_BATCH // len(devices)}", *MOE, f"moe_dispatch={dispatch}",
        *overrides)), devices=devices)
    history, grads = [], None
    with sharding.activation_sharding(r.mesh, r.config.logical_axis_rules):
        state = r.init(jax.random.key(0))
        for batch in batches(r.config):
            batch = jax.device_put(batch, r.batch_sharding)
            if grads is None:
                grads = jax.device_get(jax.jit(jax.grad(
                    lambda p, b: decoder.objective(*Model.bind(r.config).loss_fn(p, b, r.rt))))(
                        state["params"], jax.tree.map(lambda a: a[0], batch)))
                lowered = r.train_step.lower(state, batch).as_text()
            state, m = r.train_step(state, batch)
            history.append([float(m[k]) for k in ("loss", "grad_norm", "aux/moe_lb_loss", "aux/moe_z_loss")])
    return np.array(history), grads, state, lowered


@pytest.mark.slow
@pytest.mark.parametrize("layout, dispatch", [  # both dispatches where experts are split; FSDP alone and the
    ("ep8", "dropless"), ("ep8", "capacity"),   # hidden chunks do the same for both (the gathers come first)
    ("ep4xfsdp2", "dropless"), ("ep4xfsdp2", "capacity"), ("fsdp8", "dropless"), ("ep4xfsdp2-chunks4", "dropless"),
    ("ep4xfsdp2-pallas", "dropless")])
def test_expert_parallelism_matches_one_device(layout, dispatch):
    ref_history, ref_grads, ref_state, _ = run(tuple(jax.devices()[:1]), dispatch, "ici_fsdp_parallelism=1")
    history, grads, state, lowered = run(tuple(jax.devices()), dispatch, *LAYOUTS[layout])
    np.testing.assert_allclose(history, ref_history, rtol=1e-5)
    for ref, got in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5 * np.max(np.abs(ref)))
    for ref, got in zip(jax.tree.leaves(ref_state["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-6)
    # Tokens travel to their experts' devices, and FSDP-sharded experts are gathered (their gradients
    # reduce-scattered, not all-reduced whole), by the collectives moe.py writes out in shard_map.
    expert_parallel = "ici_expert_parallelism=1" not in LAYOUTS[layout]
    if dispatch == "capacity" and expert_parallel:
        assert "all_to_all" in lowered
    if dispatch == "dropless" or "ici_fsdp_parallelism=1" not in LAYOUTS[layout]:
        assert "all_gather" in lowered and "reduce_scatter" in lowered


def _shapes_made_by(kind: str, hlo: str) -> list[list[int]]:
    """The sorted dims of every array a collective of `kind` produces in a compiled program."""
    shapes = []
    for line in hlo.splitlines():
        head, found, _ = line.partition(f" {kind}(")
        if found and "=" in head:
            shapes += [sorted(int(n) for n in dims.split(",")) for dims in re.findall(r"\w+\[([\d,]+)\]", head.split("=", 1)[1])]
    return shapes


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [1, 4])
def test_fsdp_sharded_experts_are_gathered_and_their_gradients_reduce_scattered(chunks):
    """Under FSDP the block gathers each expert weight in shard_map; its gradient is reduce-scattered
    back to the shards. Passed in whole (replicated), the gradient of every expert weight was
    all-reduced whole on every device: 3 x 0.9 GiB per layer and chip for Mixtral 8x7B. In chunks of
    the hidden axis (num_moe_hidden_tiling), only chunks are gathered and reduce-scattered, never a
    whole expert weight."""
    r = builder.build(load_config(with_overrides([BASE_YML, *TINY], f"per_device_batch_size={GLOBAL_BATCH // 8}", *MOE,
                                                 "moe_dispatch=dropless", *LAYOUTS["fsdp8"],
                                                 f"num_moe_hidden_tiling={chunks}")), devices=tuple(jax.devices()))
    with sharding.activation_sharding(r.mesh, r.config.logical_axis_rules):
        state = r.init(jax.random.key(0))
        batch = jax.device_put(next(iter(batches(r.config))), r.batch_sharding)
        hlo = r.train_step.lower(state, batch).compile().as_text()
    c = r.config
    e, d, f = c.num_experts, c.base_emb_dim, c.base_moe_mlp_dim
    assert sorted((e, d, f)) not in _shapes_made_by("all-reduce", hlo)
    gathered, scattered = _shapes_made_by("all-gather", hlo), _shapes_made_by("reduce-scatter", hlo)
    whole, shard = sorted((e, d, f // chunks)), sorted((e, d // 8, f // chunks))  # the embed axis split 8 ways
    if chunks == 1:
        assert scattered.count(shard) == 3  # gate, up, down
    else:  # the first chunk's gate, up and down, then the scan's, each reduce-scattered in its own pass
        assert scattered.count(shard) == 6 and sorted((e, d // 8, f)) not in scattered
        assert gathered.count(whole) >= 6 and sorted((e, d, f)) not in gathered


@pytest.mark.slow
def test_expert_weights_carry_the_expected_sharding():
    """Experts split over `expert`, their embed axis over `fsdp`; dense weights (attention, router,
    embedding) split over fsdp x expert like FSDP; the batch over every axis but tensor."""
    layer = lambda s: s["params"]["layers"]["moe"]  # noqa: E731
    _, _, ep8, _ = run(tuple(jax.devices()), "capacity", *LAYOUTS["ep8"])
    assert layer(ep8)["w_gate"].sharding.spec == P(None, "expert", None, None)
    assert layer(ep8)["w_down"].sharding.spec == P(None, "expert", None, None)
    assert layer(ep8)["router"].sharding.spec == P(None, "expert", None)
    _, _, mixed, _ = run(tuple(jax.devices()), "capacity", *LAYOUTS["ep4xfsdp2"])
    assert layer(mixed)["w_gate"].sharding.spec == P(None, "expert", "fsdp", None)
    assert layer(mixed)["w_down"].sharding.spec == P(None, "expert", None, "fsdp")
    assert layer(mixed)["wq"].sharding.spec == P(None, ("fsdp", "expert"), None, None)
    assert mixed["opt_state"][1][0].mu["layers"]["moe"]["w_up"].sharding.spec == P(None, "expert", "fsdp", None)
    # Each device holds 2 of the 8 experts: a quarter of each expert stack.
    shard = layer(mixed)["w_gate"].addressable_shards[0].data
    assert shard.shape == (2, 2, 16, 32)


def test_a_16_bit_product_with_a_replicated_weight_has_its_gradient_summed_inside_shard_map():
    """ops.dense of 16-bit operands into float32 (the MoE router's logits) inside shard_map, tokens
    split over `fsdp` and the weight replicated: the weight's gradient is the sum over the shards, as
    for a plain matmul. The custom rule's gradient used to vary over `fsdp`, which JAX refuses (every
    16-bit mixtral under a mesh failed to compile)."""
    from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel

    from maxtrain.models import ops  # pylint: disable=import-outside-toplevel

    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    x = jax.random.normal(jax.random.key(0), (8, 16)).astype(jax.numpy.bfloat16)
    w = jax.random.normal(jax.random.key(1), (16, 4)).astype(jax.numpy.bfloat16)

    def sharded(x, w):
        local = lambda x, w: jax.lax.psum(jax.numpy.sum(ops.dense(x, w, 1, jax.numpy.float32) ** 2), "fsdp")  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=P())(x, w)

    def whole(x, w):
        return jax.numpy.sum(jax.numpy.dot(x, w, preferred_element_type=jax.numpy.float32) ** 2)

    got, want = jax.grad(sharded, argnums=(0, 1))(x, w), jax.grad(whole, argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype == jax.numpy.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-2, atol=0.1)


@pytest.mark.slow
def test_a_bfloat16_mixtral_trains_on_an_expert_and_fsdp_mesh_like_one_device():
    """The same 3 steps in bfloat16 on EP 4 x FSDP 2 and on one device: losses within bfloat16's
    rounding (2e-2 relative; a missing reduction of the router's gradient moves them further)."""
    bf16 = ("dtype=bfloat16",)
    ref, _, _, _ = run(tuple(jax.devices()[:1]), "dropless", "ici_fsdp_parallelism=1", *bf16)
    got, _, _, _ = run(tuple(jax.devices()), "dropless", *LAYOUTS["ep4xfsdp2"], *bf16)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:, :2], ref[:, :2], rtol=2e-2)  # loss and grad norm


@pytest.mark.parametrize("layout, line", [("ep4xfsdp2-chunks4", "hidden chunks 4 "),
                                          ("ep4xfsdp2", "hidden chunks 1 (autoselected)")])
def test_the_summary_names_the_hidden_chunks_the_block_runs(layout, line):
    """The start-up summary resolves num_moe_hidden_tiling as the block does, on the run's mesh."""
    r = builder.build(load_config(with_overrides([BASE_YML, *TINY], "per_device_batch_size=1", *MOE,
                                                 *LAYOUTS[layout])), devices=tuple(jax.devices()[:8]))
    assert line in builder.moe_line(r)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_the_summary_says_where_dropless_computes_every_expert(dispatch):
    """XLA:CPU (and XLA:GPU) compute ragged_dot over every expert: the summary says so, and names the fix."""
    r = builder.build(load_config(with_overrides([BASE_YML, *TINY], "per_device_batch_size=1", *MOE,
                                                 f"moe_dispatch={dispatch}")), devices=tuple(jax.devices()[:1]))
    assert r.rt.backend == "cpu"
    said = "XLA:CPU computes its ragged_dot over every expert" in builder.moe_line(r)
    assert said == (dispatch == "dropless") and (not said or "moe_dispatch=capacity" in builder.moe_line(r))
