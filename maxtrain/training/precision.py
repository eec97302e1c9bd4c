"""Mixed precision: dynamic loss scaling for float16 compute, for any parameter tree.

Parameters stay in `weight_dtype` (float32 master weights) and are cast to the compute dtype at use
(model.py). float16 has a narrow exponent range, so small gradients underflow: the loss is multiplied
by `scale` before differentiation and the gradients divided by it afterwards. When any gradient is
not finite the step is skipped (params and optimizer state untouched) and the scale halved (never
below `loss_scale_min`); after `loss_scale_period` finite steps in a row it doubles.

bfloat16 and float32 have float32's exponent range and need no scaling: their state carries
scale 1 and is never changed, so every run's state has the same structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def uses_loss_scaling(compute_dtype) -> bool:
    return jnp.dtype(compute_dtype) == jnp.float16


def init_loss_scale(config, compute_dtype) -> dict:
    scale = config.loss_scale_initial if uses_loss_scaling(compute_dtype) else 1.0
    return {"scale": jnp.asarray(scale, jnp.float32), "good_steps": jnp.asarray(0, jnp.int32),
            "skipped_steps": jnp.asarray(0, jnp.int32)}


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def update_loss_scale(state: dict, grads_finite, config) -> dict:
    """Next loss-scale state after a step whose gradients were (or were not) all finite."""
    good = jnp.where(grads_finite, state["good_steps"] + 1, 0)
    grow = good >= config.loss_scale_period
    scale = jnp.where(grads_finite, jnp.where(grow, state["scale"] * 2.0, state["scale"]),
                      jnp.maximum(state["scale"] / 2.0, config.loss_scale_min))
    return {"scale": scale.astype(jnp.float32), "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
            "skipped_steps": state["skipped_steps"] + jnp.where(grads_finite, 0, 1).astype(jnp.int32)}


def select_tree(pred, on_true, on_false):
    """Elementwise tree select on a scalar predicate (keeps the old state when a step is skipped)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
