"""The train and eval steps: pure functions of (state, batch), compiled once with jit.

The state is a plain dict:
    {"step": int32, "params": ..., "opt_state": ..., "loss_scale": {...}, "rng": PRNG key data}
and, for post-training,
    "lora":      LoRA adapters (lora_rank > 0): then they alone train, and "params" stay frozen
    "reference": DPO's frozen reference model, the starting params (without LoRA; with LoRA the
                 frozen "params" are the reference)
    "teacher":   distillation's frozen teacher, a model of its own (training/distillation.py)
Which leaves train is `trainable_key(state)`; what the objective minimizes is losses.make's
choice (the `objective` key's row). The step itself is the same for all of them.

A batch holds `inputs`, `targets`, `positions`, `segment_ids` and `loss_weights`, each
[accumulation steps, micro batch, T]. Gradients from the micro-batches are summed in float32 and
divided by the number of real (weighted) tokens, so every real token counts the same however the
batch is split.

The objective's metrics (the model's aux scalars, summed over its layers; DPO's rewards) reach the
train step here and nowhere else: `*_loss` entries are added to what is minimized
(models/decoder.objective), and every entry is reported as `aux/<name>`, averaged over the micro-batches
by their weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxtrain import config as config_lib
from maxtrain.models import lora

from maxtrain.models.model import Model
from maxtrain.models import aux_names, decoder
from maxtrain.models.runtime import Runtime
from maxtrain.training import distillation, freeze, losses, precision
from maxtrain.parallel import sharding
from maxtrain.training.optimizer import make_schedule


def state_specs(config, model: Model) -> dict:
    """ParamSpec trees of the state's parameter-like entries: params (of `model`, the run's bound model), and
    lora / reference / teacher when present."""
    specs = {"params": model.param_specs}
    if lora.enabled(config):
        specs["lora"] = lora.adapter_specs(model)
    elif losses.needs_reference(config):
        specs["reference"] = specs["params"]
    if config_lib.objectives.of(config).frozen == "teacher":  # the objective's row: its frozen model is a teacher
        specs["teacher"] = distillation.teacher_model(config).param_specs
    return specs


def trainable_key(state: dict) -> str:
    """The entry of the state that gets gradients and optimizer state."""
    return "lora" if "lora" in state else "params"


def model_params(state: dict, config, trainable=None) -> dict:
    """The weights the model computes with: params, with the LoRA adapters merged in (when present)."""
    if "lora" not in state:
        return state["params"] if trainable is None else trainable
    return lora.merge(state["params"], state["lora"] if trainable is None else trainable, lora.scale(config))


def reference_params(state: dict):
    """The objective's frozen model: distillation's teacher; DPO's reference, its own copy or (LoRA) the
    frozen params; None when the run has none."""
    if "teacher" in state:
        return state["teacher"]
    return state.get("reference", state["params"] if "lora" in state else None)


def init_state(config, model: Model, rt: Runtime, tx: optax.GradientTransformation, key,
               teacher: bool = True) -> dict:
    """A fresh state; a distillation teacher is randomly initialized here (its shapes; `teacher=False`
    leaves it out for the caller to load: builder.Run.init)."""
    init_key, rng = jax.random.split(key)
    state = {
        "step": jnp.asarray(0, jnp.int32),
        "params": model.init_params(init_key),
        "loss_scale": precision.init_loss_scale(config, rt.dtype),
        "rng": jax.random.key_data(rng),
    }
    specs = state_specs(config, model)
    if "lora" in specs:
        state["lora"] = lora.init(model, jax.random.fold_in(init_key, 0x10A))
    if "reference" in specs:
        state["reference"] = jax.tree.map(jnp.copy, state["params"])
    if "teacher" in specs and teacher:
        state["teacher"] = distillation.teacher_model(config).init_params(jax.random.fold_in(init_key, 0x7EAC))
    state["opt_state"] = tx.init(state[trainable_key(state)])
    return state


def make_train_step(config, model: Model, rt: Runtime, tx: optax.GradientTransformation):
    scaling = precision.uses_loss_scaling(rt.dtype)
    lr_at = make_schedule(config)
    objective = losses.make(config, model, rt)
    specs = model.param_specs

    def train_step(state: dict, batch: dict):
        key = trainable_key(state)
        params, scale = state[key], state["loss_scale"]["scale"]
        reference = reference_params(state)
        # The loss is a sum over tokens. float16 scales it per token slot of a micro-batch (a
        # static count), so loss_scale_* have their usual meaning for a mean loss; float32 and
        # bfloat16 multiply by their fixed scale of 1.
        unit = scale / batch["inputs"][0].size if scaling else scale

        def constrain(tree):  # gradients of the parameters: reduce-scattered, never whole on a device
            return sharding.shard_like_params(tree, specs) if key == "params" else tree

        def micro_gradients(micro_batch):
            def scaled_loss(p):
                p = freeze.stop_gradients(p, config, model) if key == "params" else p  # vision_freeze's parts
                loss, weight, aux = objective(model_params(state, config, p), micro_batch, reference)
                return decoder.objective(loss, weight, aux) * unit, (loss, weight, aux)

            grads, (loss, weight, aux) = jax.grad(scaled_loss, has_aux=True)(params)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), constrain(grads))
            return grads, loss, weight, decoder.split_step_stats(aux)

        def micro_step(carry, micro_batch):
            grad_sum, loss_sum, weight_sum = carry
            grads, loss, weight, (aux, stats) = micro_gradients(micro_batch)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (grad_sum, loss_sum + loss, weight_sum + weight), (aux, stats, weight)

        if batch["inputs"].shape[0] == 1:
            # One micro-batch: its sums without the loop. Starting a sum from zeros costs a
            # zero-filled float32 copy of the model and a pass adding the gradients to it, which
            # XLA does not remove (docs/notes/2026-11-performance-log.md, "a second profile").
            grad_sum, loss_sum, weight_sum, (aux, stats) = micro_gradients(jax.tree.map(lambda a: a[0], batch))
            (aux, stats), weights = jax.tree.map(lambda a: a[None], (aux, stats)), weight_sum[None]
        else:
            zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
            (grad_sum, loss_sum, weight_sum), (aux, stats, weights) = jax.lax.scan(micro_step, (zeros, 0.0, 0.0),
                                                                                  batch)
        denom = jnp.maximum(weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / (denom * unit), grad_sum)

        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_params = jax.tree.map(lambda new, old: new.astype(old.dtype), new_params, params)
        # The optimizer's moments keep the dtype they were created in (weight_dtype): computed from float32
        # gradients they come back float32, which would change the state's types after the first step.
        opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state["opt_state"])
        loss_scale = state["loss_scale"]
        if scaling:
            finite = precision.all_finite(grads)
            new_params = precision.select_tree(finite, new_params, params)
            opt_state = precision.select_tree(finite, opt_state, state["opt_state"])
            loss_scale = precision.update_loss_scale(loss_scale, finite, config)

        new_state = {**state, "step": state["step"] + 1, key: new_params, "opt_state": opt_state,
                     "loss_scale": loss_scale}
        # State outside the gradient (the MoE selection bias), from the step's statistics of all micro-batches.
        stats = {name: aux_names.reduce_over_micro_batches(name, values) for name, values in stats.items()}
        updated = model.update_outside_gradient(new_state["params"], state["params"], stats)
        new_state["params"] = precision.select_tree(finite, updated, new_state["params"]) if scaling else updated
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))),
            # The schedule advances with applied updates only (a skipped float16 step leaves the
            # optimizer's count untouched), so the rate used was the one at step - skipped.
            "learning_rate": lr_at(state["step"] - state["loss_scale"]["skipped_steps"]),
            "tokens": weight_sum,
            "loss_scale": loss_scale["scale"],
            "skipped_steps": loss_scale["skipped_steps"],
            **{f"aux/{name}": weighted_mean(value, weights) for name, value in aux.items()},
            # maxima (QK-clip's largest attention logit per layer): the step's, over its micro-batches and heads
            **{f"aux/{name[len(aux_names.STEP_STATS):]}": jnp.max(value) for name, value in stats.items()
               if name.startswith(aux_names.STEP_MAX)},
        }
        return new_state, metrics

    return train_step


def weighted_mean(values, weights):
    """The micro-batches' metric means, averaged by their weight (their plain mean when all weigh 0)."""
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(values * weights) / jnp.maximum(total, 1e-30), jnp.mean(values))


def make_eval_step(config, model: Model, rt: Runtime):
    objective = losses.make(config, model, rt)

    def eval_step(state, batch):
        """(loss sum, weight sum, metrics) of the objective for one eval batch [B, T]."""
        loss, weight, metrics = objective(model_params(state, config), batch, reference_params(state))
        return loss, weight, decoder.split_step_stats(metrics)[0]

    return eval_step
