"""Remat policies and unrolled layers: same loss and gradients as saving everything; less memory.

Memory is a property of the compiled program (XLA's memory_analysis of the gradient), not a timing,
so comparing it is deterministic for a given JAX version.
"""

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.runtime import REMAT_POLICIES
from maxtrain.config import load_config, with_overrides
from maxtrain.models import runtime as runtime_lib


def loss_and_grad(*overrides, seq=32, batch=2):
    """(jitted value_and_grad of the loss, its arguments) for the tiny model with `overrides`."""
    cfg = load_config([BASE_YML, *with_overrides(TINY, f"max_target_length={seq}", *overrides)])
    rt = Runtime.from_config(cfg)
    params = jax.eval_shape(lambda: Model.bind(cfg).init_params(jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
            "loss_weights": np.ones((batch, seq), np.float32)}
    fn = jax.jit(jax.value_and_grad(lambda p, b: Model.bind(cfg).loss_fn(p, b, rt)[0]))
    return fn, params, data, cfg


@pytest.fixture(scope="module")
def reference():
    fn, _, data, cfg = loss_and_grad("remat_policy=none", "scan_layers=true")
    params = Model.bind(cfg).init_params(jax.random.key(0))  # the same for every policy
    return params, fn(params, data)


# Every policy with scanned layers; unrolled layers (scan_layers=false, a different code path:
# jax.checkpoint per layer with prevent_cse) with no remat and with full remat.
CASES = [(p, True) for p in REMAT_POLICIES if p != "none"] + [("none", False), ("full", False)]


@pytest.mark.parametrize("policy, scan", slow_params(CASES, {"save_qkv_proj-True"}, ids=[f"{p}-{s}" for p, s in CASES]))
def test_every_policy_gives_the_same_loss_and_grads(policy, scan, reference):
    params, (ref_loss, ref_grads) = reference
    fn, _, data, _ = loss_and_grad(f"remat_policy={policy}", f"scan_layers={str(scan).lower()}")
    loss, grads = fn(params, data)
    # float32 throughout; recomputation and unrolling only reorder float32 sums.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def temp_bytes(policy):
    fn, params, data, _ = loss_and_grad(f"remat_policy={policy}", "base_num_decoder_layers=4", "base_mlp_dim=256",
                                        seq=256, batch=4)
    return fn.lower(params, data).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_full_remat_needs_less_temporary_memory_than_none():
    """4 layers x [4 x 256] tokens: 'none' keeps every layer's activations (attention probabilities
    [B, N, T, T] among them) for the backward pass; 'full' keeps each layer's input and recomputes."""
    none, full = temp_bytes("none"), temp_bytes("full")
    assert full < 0.5 * none, (full, none)


# --------------------------------------------------------------------------------------------
# remat_policy=autoselected: the layer plan per backend and model size
# --------------------------------------------------------------------------------------------

def plan(*overrides, backend="cpu"):
    cfg = load_config([BASE_YML, *overrides])
    rt = Runtime.from_config(cfg, backend)
    return rt.remat_policy, rt.scan_layers(cfg)


@pytest.mark.parametrize("overrides, backend, expected", [
    ((), "cpu", ("none", False)),                       # the default model: unrolled, nothing recomputed
    ((), "tpu", ("full", True)),
    ((), "gpu", ("full", True)),
    (("scan_layers=true",), "cpu", ("full", True)),     # the user's scan_layers is kept, and so is full
    (("scan_layers=false",), "cpu", ("full", False)),
    (("remat_policy=minimal",), "cpu", ("minimal", True)),  # an explicit policy is kept
    (("base_num_decoder_layers=17",), "cpu", ("full", True)),  # more layers than CPU_UNROLL_MAX_LAYERS
    (("max_target_length=4096",), "cpu", ("full", True)),      # activations over the budget
    (("decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"), "cpu", ("full", True)),
])
def test_autoselected_layer_plan(overrides, backend, expected):
    assert plan("dataset_type=synthetic", *overrides, backend=backend) == expected


def test_activation_estimate_bounds_the_plan():
    """The estimate grows with batch, length, width and depth; the default model is well under the budget."""
    def estimate(*overrides):
        return runtime_lib.saved_activation_bytes(load_config([BASE_YML, "dataset_type=synthetic", *overrides]))
    base = estimate()
    assert base < runtime_lib.CPU_UNROLL_MAX_ACTIVATION_BYTES
    assert estimate("per_device_batch_size=32") == 2 * base
    assert estimate("base_num_decoder_layers=8") == 2 * base
    assert estimate("max_target_length=512") > 2 * base  # attention rows grow with T^2
