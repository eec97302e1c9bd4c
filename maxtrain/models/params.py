"""Parameter declarations: each parameter declared once, with its shape, logical axes and initializer.

A family's `param_specs(config)` returns a nested dict of ParamSpec. Everything that needs to know the
parameters reads that one declaration: sharded initialization (`init_params`), the sharding of the
train state (the logical `axes` and the config's rules), checkpoint fit checks, the Hugging Face
converter and the parameter count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, the logical name of each axis, and how to initialize it.

    init: "normal" (mean 0, `stddev`), "ones" or "zeros" (norm scales in the `1 + scale` form, biases), "lowest"
    or "highest" (the dtype's finite extremes: a clipping bound that clips nothing until a checkpoint sets it).
    fixed: a buffer (transformers' fixed tensors: Gemma 4's layer scalars, its vision tower's clipping bounds): the
    model reads it under stop_gradient and the optimizer leaves it as loaded (no weight decay: fixed_paths).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    stddev: float = 0.0
    fixed: bool = False

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec shape {self.shape} and axes {self.axes} differ in rank")
        if self.init not in ("normal", "ones", "zeros", "lowest", "highest"):
            raise ValueError(f"ParamSpec init {self.init!r} is not normal, ones, zeros, lowest or highest")


def dense(shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> ParamSpec:
    """A projection weight, drawn with stddev fan_in ** -0.5."""
    return ParamSpec(tuple(shape), tuple(axes), "normal", fan_in**-0.5)


def stacked(specs: Params, num_layers: int) -> Params:
    """One layer's specs with a leading "layers" axis of num_layers: the layers run under lax.scan."""
    return jax.tree.map(lambda s: dataclasses.replace(s, shape=(num_layers,) + s.shape, axes=("layers",) + s.axes),
                        specs, is_leaf=is_spec)


def fixed_paths(specs: Params) -> frozenset[str]:
    """The key paths (jax.tree_util.keystr) of the fixed parameters (ParamSpec.fixed) of a spec tree."""
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    return frozenset(jax.tree_util.keystr(path) for path, spec in flat if spec.fixed)


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def count(specs: Params) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def init_params(specs: Params, key, dtype) -> Params:
    """Draws every parameter from its spec. Under jit with out_shardings, each is created sharded.

    Each parameter's key is `fold_in(key, i)` with i its position in the flattened (sorted) tree,
    so values do not depend on the mesh.
    """
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    dtype = jnp.dtype(dtype)
    out = []
    for i, spec in enumerate(leaves):
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dtype))
        elif spec.init == "zeros":
            out.append(jnp.zeros(spec.shape, dtype))
        elif spec.init in ("lowest", "highest"):
            extreme = jnp.finfo(dtype).max
            out.append(jnp.full(spec.shape, -extreme if spec.init == "lowest" else extreme, dtype))
        else:
            draw = jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)
            out.append((spec.stddev * draw).astype(dtype))
    return jax.tree.unflatten(treedef, out)
