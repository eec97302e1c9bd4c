"""A vision tower's parameters to and from transformers' tensors, by its name table: what every tower's
`to_maxtrain` and `to_hf` do alike.

A tower's table maps each parameter path ("blocks/wq") to (the tensor's full name, a models/hf.py Layout); a
name holding "{i}" is one tensor per index along the stacked parameter's first axis (a block, a merger).
`read` refuses a missing tensor, a tensor of the wrong shape and, under the tower's prefixes, a tensor it has no
place for; `write` refuses a parameter whose shape is not the declared one.
"""

from __future__ import annotations

import jax
import numpy as np

from maxtrain.models.hf import ConversionError
from maxtrain.models.params import is_spec


def entries(specs: dict, names: dict):
    """(path, spec, full name pattern, layout, indices along the stacked axis or None) of every parameter."""
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        key = "/".join(str(k.key) for k in path)
        name, layout = names[key]
        yield key, spec, name, layout, (range(spec.shape[0]) if "{i}" in name else None)


def read(tensors: dict, specs: dict, names: dict, prefixes: tuple[str, ...], what: str, hint: str = "",
         dtype=np.float32) -> dict:
    """The params (a nested dict of numpy arrays) from `tensors` by the table `names`; tensors outside
    `prefixes` are left alone. `what` names the tower in errors ("the vision tower"); `hint` says which config
    fields decide what the checkpoint holds."""
    params, used = {}, set()
    for key, spec, name, layout, indices in entries(specs, names):
        shape = spec.shape[1:] if indices is not None else spec.shape

        def one(full, shape=shape, layout=layout, key=key):
            if full not in tensors:
                raise ConversionError(f"the checkpoint has no tensor {full} (for {what}'s {key})")
            w = np.asarray(tensors[full])
            if tuple(w.shape) != tuple(layout.hf_shape(shape)):
                raise ConversionError(f"{full} has shape {list(w.shape)}, but the vision config implies "
                                      f"{list(layout.hf_shape(shape))}")
            used.add(full)
            return layout.to_maxtrain(w, shape).astype(dtype)
        value = np.stack([one(name.format(i=i)) for i in indices]) if indices is not None else one(name)
        node = params
        for part in key.split("/")[:-1]:
            node = node.setdefault(part, {})
        node[key.split("/")[-1]] = value
    unused = sorted(n for n in tensors if n.startswith(prefixes) and n not in used)
    if unused:
        raise ConversionError(f"vision tensors {what} has no place for (does vision_config describe these "
                              f"weights{': ' + hint if hint else ''}?): {unused[:8]}"
                              + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
    return params


def write(params: dict, specs: dict, names: dict, what: str, dtype=np.float32) -> dict:
    """transformers' tensors (numpy, by the table `names`) from the params."""
    out = {}
    for key, spec, name, layout, indices in entries(specs, names):
        value = params
        for part in key.split("/"):
            value = value[part]
        value = np.asarray(value).astype(np.float32)
        if tuple(value.shape) != tuple(spec.shape):
            raise ConversionError(f"{what}'s {key} has shape {list(value.shape)}, its config declares "
                                  f"{list(spec.shape)}")
        for i, w in (zip(indices, value) if indices is not None else [(None, value)]):
            layout.export(w, out, name.format(i=i), dtype)
    return out
