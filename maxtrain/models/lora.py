"""LoRA (Hu et al. 2021): low-rank adapters on chosen projections; only the adapters train.

For a projection W [in..., out...] (e.g. wq [D, N, H], wo [N, H, D]) the model computes with

    W' = W + (lora_alpha / lora_rank) * A @ B        A [in..., r] (random), B [r, out...] (zeros)

so at the start W' = W exactly. Adapters are declared with ParamSpecs, like the parameters, so
sharding (A follows W's input axes, B its output axes) and initialization are generic. They live
in the train state beside the frozen params as `state["lora"]`, a dict shaped like the params:
{"layers": {"decoder": {"wq": {"a": ..., "b": ...}, ...}}}. The optimizer sees only them.

W' is formed once per step outside the layer scan (`merge`), which keeps the model code unaware
of LoRA; it costs one extra copy of the targeted weights in memory, and r x in x out FLOPs per
target per step, small next to the model's own.

Export: `merge` bakes the adapters into the weights (scripts/convert_hf.py export does so for a
LoRA checkpoint); checkpointing/peft.py writes a PEFT adapter directory for transformers + peft.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from maxtrain.models.model import Model
from maxtrain.models import params as params_lib
from maxtrain.models.params import ParamSpec

# lora_target_modules name -> the parameter it adapts (every family names its projections alike)
TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
# the input axes of each projection (after "layers"); a parameter of that name with other axes (a
# mixture of experts' stacked experts) is not a projection LoRA knows how to adapt
INPUT_AXES = {"wq": ("embed",), "wk": ("embed",), "wv": ("embed",), "wo": ("heads", "head_dim"),
              "w_gate": ("embed",), "w_up": ("embed",), "w_down": ("mlp",)}
IN_AXES = {name: len(axes) for name, axes in INPUT_AXES.items()}


class LoraError(ValueError):
    """LoRA settings that do not fit the model; the message says what to change."""


def enabled(config) -> bool:
    return config.lora_rank > 0


def scale(config) -> float:
    return config.lora_alpha / config.lora_rank


def adapter_specs(model: Model) -> dict:
    """{"layers": {kind: {param: {"a": ParamSpec, "b": ParamSpec}}}} for every targeted projection of the model
    (its config's lora_rank and lora_target_modules)."""
    config = model.config
    wanted = {TARGETS[t] for t in config.lora_target_modules}
    r = config.lora_rank
    out: dict = {}
    found = set()
    for kind, layer in model.param_specs.get("layers", {}).items():
        for pname, spec in layer.items():
            if (pname not in wanted or not isinstance(spec, ParamSpec) or spec.axes[:1] != ("layers",)
                    or spec.axes[1:1 + IN_AXES[pname]] != INPUT_AXES[pname]):
                continue
            n_in = IN_AXES[pname]
            in_shape, out_shape = spec.shape[1:1 + n_in], spec.shape[1 + n_in:]
            in_axes, out_axes = spec.axes[1:1 + n_in], spec.axes[1 + n_in:]
            layers = spec.shape[0]
            out.setdefault("layers", {}).setdefault(kind, {})[pname] = {
                "a": ParamSpec((layers, *in_shape, r), ("layers", *in_axes, None), "normal", math.prod(in_shape) ** -0.5),
                "b": ParamSpec((layers, r, *out_shape), ("layers", None, *out_axes), "zeros"),
            }
            found.add(pname)
    missing = sorted(t for t in config.lora_target_modules if TARGETS[t] not in found)
    if missing:  # what the model has that LoRA can adapt, for the message
        found |= {p for layer in model.param_specs.get("layers", {}).values() for p, spec in layer.items()
                  if p in INPUT_AXES and isinstance(spec, ParamSpec) and spec.axes[1:1 + IN_AXES[p]] == INPUT_AXES[p]}
    if missing:
        have = sorted(t for t, p in TARGETS.items() if p in found)
        raise LoraError(f"lora_target_modules {missing} match no module of the {config.decoder_block} model (it has "
                        f"{', '.join(have) or 'none of q, k, v, o, gate, up, down'}); set lora_target_modules="
                        f"[{','.join(t for t in config.lora_target_modules if t not in missing) or ','.join(have)}]")
    return out


def num_adapter_params(model: Model) -> int:
    return params_lib.count(adapter_specs(model))


def _delta(a, b, w_shape, n_in: int):
    """A @ B reshaped as W (without its leading layer axis in w_shape[0])."""
    layers = a.shape[0]
    a2 = a.reshape(layers, math.prod(w_shape[1:1 + n_in]), a.shape[-1])
    b2 = b.reshape(layers, b.shape[1], -1)
    return jnp.einsum("LIR,LRO->LIO", a2.astype(jnp.float32), b2.astype(jnp.float32)).reshape(w_shape)


def merge(params: dict, adapters: dict, lora_scale: float) -> dict:
    """The params with W + scale * A @ B for every adapted projection (differentiable in the adapters)."""
    layers = dict(params["layers"])
    for kind, targets in adapters.get("layers", {}).items():
        stack = dict(layers[kind])
        for pname, ab in targets.items():
            w = stack[pname]
            stack[pname] = (w.astype(jnp.float32) + lora_scale * _delta(ab["a"], ab["b"], w.shape, IN_AXES[pname])
                            ).astype(w.dtype)
        layers[kind] = stack
    return {**params, "layers": layers}


def merge_numpy(params: dict, adapters: dict, lora_scale: float) -> dict:
    """merge() on host numpy arrays (export), computed in float64 and cast back."""
    layers = dict(params["layers"])
    for kind, targets in adapters.get("layers", {}).items():
        stack = dict(layers[kind])
        for pname, ab in targets.items():
            w = np.asarray(stack[pname])
            a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
            delta = np.einsum("LIR,LRO->LIO", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
            stack[pname] = (w.astype(np.float64) + lora_scale * delta.reshape(w.shape)).astype(w.dtype)
        layers[kind] = stack
    return {**params, "layers": layers}


def init(model: Model, key) -> dict:
    return params_lib.init_params(adapter_specs(model), key, model.config.weight_dtype)
