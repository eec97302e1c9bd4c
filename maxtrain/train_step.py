"""The train and eval steps: pure functions of (state, batch), compiled once with jit.

The state is a plain dict:
    {"step": int32, "params": ..., "opt_state": ..., "loss_scale": {...}, "rng": PRNG key data}

A batch holds `inputs`, `targets`, `positions`, `segment_ids` and `loss_weights`, each
[accumulation steps, micro batch, T]. Gradients from the micro-batches are summed in float32 and
divided by the number of real (weighted) tokens, so every real token counts the same however the
batch is split.

The model's aux scalars (summed over its layers; empty for dense families) reach the objective and
the metrics here and nowhere else: `*_loss` entries are added to the objective (models.objective),
and every entry is reported as `aux/<name>`, averaged over the micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxtrain import models, precision
from maxtrain.optimizer import make_schedule


def init_state(config, rt: models.Runtime, tx: optax.GradientTransformation, key) -> dict:
    init_key, rng = jax.random.split(key)
    params = models.init_params(config, init_key)
    return {
        "step": jnp.asarray(0, jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "loss_scale": precision.init_loss_scale(config, rt.dtype),
        "rng": jax.random.key_data(rng),
    }


def make_train_step(config, rt: models.Runtime, tx: optax.GradientTransformation):
    scaling = precision.uses_loss_scaling(rt.dtype)
    lr_at = make_schedule(config)

    def train_step(state: dict, batch: dict):
        params, scale = state["params"], state["loss_scale"]["scale"]
        # The loss is a sum over tokens. float16 scales it per token slot of a micro-batch (a
        # static count), so loss_scale_* have their usual meaning for a mean loss; float32 and
        # bfloat16 multiply by their fixed scale of 1.
        unit = scale / batch["inputs"][0].size if scaling else scale

        def micro_step(carry, micro_batch):
            grad_sum, loss_sum, weight_sum = carry

            def scaled_loss(p):
                loss, weight, aux = models.loss_fn(p, micro_batch, config, rt)
                return models.objective(loss, weight, aux) * unit, (loss, weight, aux)

            grads, (loss, weight, aux) = jax.grad(scaled_loss, has_aux=True)(params)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
            return (grad_sum, loss_sum + loss, weight_sum + weight), aux

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grad_sum, loss_sum, weight_sum), aux = jax.lax.scan(micro_step, (zeros, 0.0, 0.0), batch)
        denom = jnp.maximum(weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / (denom * unit), grad_sum)

        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_params = jax.tree.map(lambda new, old: new.astype(old.dtype), new_params, params)
        loss_scale = state["loss_scale"]
        if scaling:
            finite = precision.all_finite(grads)
            new_params = precision.select_tree(finite, new_params, params)
            opt_state = precision.select_tree(finite, opt_state, state["opt_state"])
            loss_scale = precision.update_loss_scale(loss_scale, finite, config)

        new_state = {**state, "step": state["step"] + 1, "params": new_params, "opt_state": opt_state,
                     "loss_scale": loss_scale}
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))),
            # The schedule advances with applied updates only (a skipped float16 step leaves the
            # optimizer's count untouched), so the rate used was the one at step - skipped.
            "learning_rate": lr_at(state["step"] - state["loss_scale"]["skipped_steps"]),
            "tokens": weight_sum,
            "loss_scale": loss_scale["scale"],
            "skipped_steps": loss_scale["skipped_steps"],
            **{f"aux/{name}": jnp.mean(value) for name, value in aux.items()},
        }
        return new_state, metrics

    return train_step


def make_eval_step(config, rt: models.Runtime):
    def eval_step(params, batch):
        """(sum of token losses x weights, sum of weights) for one eval batch [B, T]."""
        return models.loss_fn(params, batch, config, rt)[:2]

    return eval_step
