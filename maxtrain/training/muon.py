"""Muon on the hidden weight matrices, AdamW on everything else (opt_type=muon).

Muon keeps a Nesterov momentum M of each hidden weight matrix W and steps along an orthogonalised
M: five Newton-Schulz iterations take M = U S V^T to about U V^T, so every direction of the update
has about the same size. The update of W [fan_in, fan_out] is then

    -learning_rate * (scale * NS(M) + muon_weight_decay * W)
    scale = muon_consistent_rms * sqrt(max(fan_in, fan_out))   (the update's RMS is about
            muon_consistent_rms, as AdamW's: learning_rate and weight decay carry over; Moonlight, MaxText)
          = sqrt(max(1, fan_out / fan_in))                     (muon_consistent_rms = -1: Keller Jordan's)

The matrix is the logical one of one layer and one expert, read off the parameter's logical axes
(models/params.py): "layers" and "exp" are batch axes (each layer's, each expert's matrix apart); the
others are the model width "embed" at one end and hidden axes (heads, head_dim, mlp) at the other, so
wq [L, D, N, H] is L matrices of [D, N*H] and wo [L, N, H, D] L matrices of [N*H, D]. Everything else
goes to the AdamW of the adam_* keys: embeddings and the output head (a "vocab" axis), norm scales and
biases (no "embed" and hidden axis pair), routers (an unnamed expert axis). Under FSDP and tensor
parallelism the same global arrays go through jit, so Newton-Schulz sees whole matrices.

optax.contrib.scale_by_muon does the momentum and the orthogonalisation. optax.contrib.muon (the
whole optimizer) is not used: its AdamW half takes Muon's Nesterov flag and eps and no weight-decay
mask, so it would not be maxtrain's AdamW (make_optimizer's) on the other parameters.
"""

from __future__ import annotations

import math

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from maxtrain.models.model import Model
from maxtrain.models.params import ParamSpec
from maxtrain.models.params import is_spec

BATCH_AXES = ("layers", "exp")
HIDDEN_AXES = ("heads", "kv_heads", "head_dim", "mlp")


def dimension_numbers(spec: ParamSpec) -> MuonDimensionNumbers | None:
    """Which axes of a parameter are its matrix's rows (reduction) and columns (output); None for AdamW."""
    axes = [i for i, name in enumerate(spec.axes) if name not in BATCH_AXES]
    names = [spec.axes[i] for i in axes]
    if len(axes) < 2 or names.count("embed") != 1 or not all(n in HIDDEN_AXES for n in names if n != "embed"):
        return None
    if names[0] == "embed":
        return MuonDimensionNumbers(reduction_axis=(axes[0],), output_axis=tuple(axes[1:]))
    if names[-1] == "embed":
        return MuonDimensionNumbers(reduction_axis=tuple(axes[:-1]), output_axis=(axes[-1],))
    return None


def _is_dims(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def muon_dimension_numbers(model: Model) -> dict:
    """The params tree of dimension_numbers: a MuonDimensionNumbers where Muon trains, None where AdamW does."""
    return jax.tree.map(dimension_numbers, model.param_specs, is_leaf=is_spec)


def labels(model: Model):
    """params -> the same tree of "muon" / "adamw" (optax.partition's labels)."""
    dims = muon_dimension_numbers(model)
    return lambda params: jax.tree.map(lambda d, _: "adamw" if d is None else "muon", dims, params, is_leaf=_is_dims)


def _scale(dims: MuonDimensionNumbers, shape, consistent_rms: float) -> float:
    fan_in = math.prod(shape[a] for a in dims.reduction_axis)
    fan_out = math.prod(shape[a] for a in dims.output_axis)
    if consistent_rms > 0:
        return consistent_rms * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def scale_by_shape(dims_of, consistent_rms: float) -> optax.GradientTransformation:
    """Multiplies each orthogonalised update by its matrix's shape factor (the module docstring's scale)."""

    def update(updates, state, params=None):
        del params
        scaled = jax.tree.map(lambda u, d: u * _scale(d, u.shape, consistent_rms), updates, dims_of(updates))
        return scaled, state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def partitioned(config, model: Model, schedule: optax.Schedule,
                adamw: optax.GradientTransformation) -> optax.GradientTransformation:
    """Muon on the hidden weight matrices of `model`, `adamw` on the rest."""
    dims = muon_dimension_numbers(model)

    def dims_of(masked_updates):  # the Muon half sees the AdamW parameters as optax.MaskedNode
        return jax.tree.map(lambda d, _: optax.MaskedNode() if d is None else d, dims, masked_updates,
                            is_leaf=_is_dims)

    muon = optax.chain(
        scale_by_muon(ns_steps=config.muon_ns_steps, beta=config.muon_beta, nesterov=True,
                      weight_dimension_numbers=dims_of),
        scale_by_shape(dims_of, config.muon_consistent_rms),
        optax.add_decayed_weights(config.muon_weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": muon, "adamw": adamw}, labels(model))
