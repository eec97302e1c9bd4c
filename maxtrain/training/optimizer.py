"""The optimizer: gradient clipping -> AdamW with masked weight decay (or, opt_type=muon, Muon on the
hidden weight matrices and that AdamW on the rest: training/muon.py), driven by a schedule. With
indexer_training=dense_warmup only DeepSeek-V3.2's indexer weights train (the others' updates are zero); vision_freeze's
parts of an image-and-text model get no update either (training/freeze.py).

Gradient accumulation happens in the train step (a scan over micro-batches that sums gradients
weighted by real tokens), so the optimizer sees exactly one update per step.
"""

from __future__ import annotations

import jax
import optax

from maxtrain.models import params as params_lib
from maxtrain.training import freeze, muon


def make_schedule(config) -> optax.Schedule:
    """Learning rate as a function of the step.

    All schedules warm up linearly from 0 over `warmup_steps`, then:
      cosine:   cosine decay to `cosine_learning_rate_final_fraction` x peak at `schedule_steps`;
      wsd:      stay at the peak, then decay linearly to 0 over the last `wsd_decay_steps_fraction`;
      constant: stay at the peak.
    After `schedule_steps` the last value is held.
    """
    peak, total, warmup = config.learning_rate, config.schedule_steps, config.warmup_steps
    warmup_fn = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if config.lr_schedule_type == "cosine":
        decay = optax.cosine_decay_schedule(peak, max(total - warmup, 1), alpha=config.cosine_learning_rate_final_fraction)
        return optax.join_schedules([warmup_fn, decay], [warmup])
    if config.lr_schedule_type == "wsd":
        decay_steps = int(config.wsd_decay_steps_fraction * total)
        stable_steps = max(total - warmup - decay_steps, 0)
        return optax.join_schedules(
            [warmup_fn, optax.constant_schedule(peak), optax.linear_schedule(peak, 0.0, max(decay_steps, 1))],
            [warmup, warmup + stable_steps])
    return optax.join_schedules([warmup_fn, optax.constant_schedule(peak)], [warmup])


def weight_decay_mask(params, config, fixed: frozenset = frozenset()):
    """True for parameters that get weight decay: everything but norm scales (and, optionally, the embedding) and
    the model's fixed tensors (`fixed`: models/params.fixed_paths), which no gradient reaches either."""

    def decays(path, _):
        name = jax.tree_util.keystr(path)
        if name in fixed:
            return False
        if config.weight_decay_exclude_norms and "norm" in name:
            return False
        if config.weight_decay_exclude_embeddings and "token_embedding" in name:
            return False
        return True

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config, model) -> optax.GradientTransformation:
    """AdamW, or Muon on `model`'s hidden matrices (the bound model, models/model.py) with AdamW on the rest."""
    adamw = optax.adamw(
        learning_rate=make_schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.adam_weight_decay,
        mask=lambda params: weight_decay_mask(params, config, params_lib.fixed_paths(model.param_specs)),
    )
    tx = muon.partitioned(config, model, make_schedule(config), adamw) if config.opt_type == "muon" else adamw
    if config.gradient_clipping_threshold > 0:
        tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), tx)
    if config.indexer_training == "dense_warmup":  # DeepSeek-V3.2's warm-up: the indexer trains, the rest is frozen
        return optax.multi_transform({"indexer": tx, "frozen": optax.set_to_zero()}, indexer_labels)
    if config.vision_freeze:  # an image-and-text model's frozen parts (training/freeze.py)
        return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                     lambda params: freeze.labels(params, config, model))
    return tx


def indexer_labels(params):
    """params -> the same tree of "indexer" (DeepSeek-V3.2's indexer weights, index_*) / "frozen"."""
    def label(path, _):
        return "indexer" if str(getattr(path[-1], "key", "")).startswith("index_") else "frozen"
    return jax.tree_util.tree_map_with_path(label, params)


def opt_state_shardings(abstract_opt_state, param_shardings, replicated):
    """Optimizer-state shardings: a leaf at a parameter's path (AdamW's moments, Muon's momentum) is sharded
    like that parameter; the rest (counts, Newton-Schulz coefficients) is replicated.

    A parameter's path is the run of dict keys that ends the leaf's path (optax's states are tuples and
    named tuples; only the parameter trees in them are dicts). optax.tree_map_params cannot be used:
    it inits the optimizer with one placeholder for all the params, and Muon's partition into Muon and
    AdamW parameters needs the params' tree.
    """
    by_path = {_dict_keys(path): s for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

    def sharding(path, _):
        return by_path.get(_dict_keys(path), replicated)

    return jax.tree_util.tree_map_with_path(sharding, abstract_opt_state)


def _dict_keys(path) -> tuple:
    """The dict keys that end a key path."""
    keys = []
    for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
            break
        keys.append(entry.key)
    return tuple(reversed(keys))
