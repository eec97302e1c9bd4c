"""The grouped GEMM of dropless MoE on GPUs (kernels/grouped_matmul.py), in Pallas interpret mode on CPU: forward
and both gradients against jax.lax.ragged_dot (the dense reference XLA:CPU runs), with empty groups, rows past the
groups and sizes that are not whole tiles; the MoE block and a train step with moe_grouped_matmul=pallas against
xla; and which form `autoselected` picks per platform. Its H100 compile is in tests/kernels/test_kernel_lowering.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import load_config, with_overrides
from maxtrain.kernels import grouped_matmul
from maxtrain.models.moe import expert_matmuls
from maxtrain.training import builder

SMALL_TILES = grouped_matmul.Tiles(block_m=16, block_k=16, block_n=16, t_block_m=16, t_block_k=16, t_block_n=32)


@pytest.mark.parametrize("sizes, m, k, n", [
    ([10, 0, 23, 1, 30], 70, 48, 40),   # an empty group, 6 rows past the groups, N not a multiple of 16
    ([0, 0, 33, 0], 33, 20, 16),        # all rows in one group, every tile boundary off; K padded to 32
])
def test_kernel_matches_ragged_dot_forward_and_both_gradients(sizes, m, k, n):
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k))
    w = jax.random.normal(kw, (len(sizes), k, n))
    dy = jax.random.normal(ky, (m, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(implementation):
        def f(x, w):
            y = grouped_matmul.grouped_matmul(x, w, group_sizes, implementation=implementation, interpret=True,
                                              tiles=SMALL_TILES)
            return jnp.sum(y * dy), y
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)

    with jax.default_matmul_precision("highest"):
        (_, y), (dx, dw) = loss("pallas")
        (_, y_ref), (dx_ref, dw_ref) = loss("xla")
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[sum(sizes):], 0.0)  # rows past the groups
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(dw)[sizes.index(0)]).max() == 0.0  # an empty group's gradient


def test_tile_table_covers_every_row_once_per_group():
    sizes = jnp.asarray([5, 0, 40, 3], jnp.int32)
    group, block, lo, hi = (np.asarray(a) for a in grouped_matmul.tile_table(sizes, 64, 16))
    covered = np.zeros(64, int)
    for g, b, l, h in zip(group, block, lo, hi):
        rows = np.arange(b * 16, b * 16 + 16)
        covered[rows[(rows >= l) & (rows < h)]] += 1
    np.testing.assert_array_equal(covered, 1)  # 48 routed rows and 16 past the groups (group 4), each stored once
    assert len(group) == 64 // 16 + 4 + 1


MOE = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
       "base_num_decoder_layers=2", "per_device_batch_size=1"]


@pytest.mark.slow  # 7 s; the kernel's own checks above run by default
def test_moe_model_with_the_kernel_matches_xla_loss_and_gradients():
    """The whole model (two MoE layers, padding tokens) with moe_grouped_matmul=pallas, in interpret mode: loss
    and every parameter's gradient as with XLA's ragged_dot."""
    results = []
    for implementation in ("pallas", "xla"):
        config = load_config(with_overrides([BASE_YML, *TINY], *MOE, f"moe_grouped_matmul={implementation}"))
        rt = Runtime.from_config(config)
        assert rt.grouped_matmul == implementation
        params = Model.bind(config).init_params(jax.random.key(0))
        t = config.max_target_length
        tokens = jax.random.randint(jax.random.key(1), (2, t), 0, config.vocab_size)
        segment_ids = jnp.ones((2, t), jnp.int32).at[1, t - 5:].set(0)
        positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)

        def loss(p):
            logits = Model.bind(config).forward(p, tokens, positions, segment_ids, rt)[0]
            return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) * segment_ids)

        with jax.default_matmul_precision("highest"):
            results.append(jax.jit(jax.value_and_grad(loss))(params))
    (loss_k, grads_k), (loss_x, grads_x) = results
    np.testing.assert_allclose(float(loss_k), float(loss_x), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_autoselected_is_the_kernel_on_gpus_and_xla_elsewhere():
    assert expert_matmuls.resolve_grouped_matmul("autoselected", "gpu") == "pallas"
    assert expert_matmuls.resolve_grouped_matmul("autoselected", "cpu") == "xla"
    assert expert_matmuls.resolve_grouped_matmul("autoselected", "tpu") == "xla"
    assert expert_matmuls.resolve_grouped_matmul("pallas", "cpu") == "pallas"
    run = builder.build(load_config(with_overrides([BASE_YML, *TINY], *MOE)), devices=jax.devices()[:1])
    assert "grouped matmul xla (XLA:CPU computes its ragged_dot over every expert" in builder.moe_line(run)
