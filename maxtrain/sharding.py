"""The device mesh and the logical-axis rules.

Model code names what an axis *is* ("batch", "embed", "heads", ...); `logical_axis_rules` in the
config say *where* it goes on the mesh axes ("data", "fsdp", "tensor"). Switching between FSDP and
tensor parallelism is a config change only.

Rules are applied in order and each mesh axis is used at most once per array: with
`batch -> [data, fsdp]` and `embed -> fsdp`, a parameter [embed, heads] is sharded over fsdp on
embed, while an activation [batch, length, embed] uses fsdp for batch and leaves embed whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("maxtrain_sharding", default=None)


class MeshError(UserError, ValueError):
    """A mesh that does not fit the devices or the model. The message says what to change."""


def _fill(parallelism: dict[str, int], total: int, what: str) -> dict[str, int]:
    """Replaces a -1 entry with whatever is left of `total`; checks the product."""
    known = math.prod(v for v in parallelism.values() if v != -1)
    out = dict(parallelism)
    for axis, value in parallelism.items():
        if value == -1:
            if total % known:
                fixed = ", ".join(f"{what}_{a}_parallelism={v}" for a, v in parallelism.items() if v != -1)
                unit = "devices per slice" if what == "ici" else "slices"
                raise MeshError(f"{fixed} need a multiple of {known} {unit}, but there are {total}. Lower them so "
                                f"that their product divides {total}, or run on more devices.")
            out[axis] = total // known
    if math.prod(out.values()) != total:
        desc = " x ".join(f"{what}_{a}_parallelism={v}" for a, v in out.items())
        raise MeshError(f"{desc} = {math.prod(out.values())}, but there are {total} "
                        f"{'devices per slice' if what == 'ici' else 'slices'}. Make the product equal {total}, "
                        f"or set one of them to -1 to take what is left.")
    return out


def mesh_shape(config, num_devices: int, num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(ici, dcn) parallelism per mesh axis with -1 resolved."""
    if num_devices % num_slices:
        raise MeshError(f"{num_devices} devices do not split evenly into {num_slices} slices")
    ici = _fill({a: getattr(config, f"ici_{a}_parallelism") for a in MESH_AXES}, num_devices // num_slices, "ici")
    dcn = _fill({a: getattr(config, f"dcn_{a}_parallelism") for a in MESH_AXES}, num_slices, "dcn")
    return ici, dcn


def _num_slices(devices) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def create_mesh(config, devices: Sequence | None = None) -> Mesh:
    """The Mesh over all devices (of all processes) with axes ("data", "fsdp", "tensor")."""
    devices = list(devices if devices is not None else jax.devices())
    num_slices = _num_slices(devices)
    ici, dcn = mesh_shape(config, len(devices), num_slices)
    ici_shape = [ici[a] for a in MESH_AXES]
    if num_slices > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(ici_shape, [dcn[a] for a in MESH_AXES], devices)
    else:
        try:
            device_array = mesh_utils.create_device_mesh(ici_shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            # Devices without a known physical topology (e.g. CPU): any order is as good.
            device_array = np.asarray(devices).reshape(ici_shape)
    return Mesh(device_array, MESH_AXES)


def _rule_axes(rules) -> dict[str, tuple[str, ...]]:
    out = {}
    for name, axes in rules:
        if name in out:
            continue
        out[name] = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return out


def logical_to_spec(logical_axes: Sequence[str | None], rules) -> PartitionSpec:
    """PartitionSpec for an array whose dims are named `logical_axes` (None = replicated)."""
    table = _rule_axes(rules)
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        mesh_axes = tuple(a for a in table.get(name, ()) if a not in used) if name else ()
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes, rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def check_divisible(name: str, shape, logical_axes, mesh: Mesh, rules) -> None:
    """Raises a MeshError naming the parameter when a sharded dimension does not divide evenly."""
    spec = logical_to_spec(logical_axes, rules)
    for dim, (size, axes, logical) in enumerate(zip(shape, spec, logical_axes)):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            raise MeshError(
                f"{name} has {size} along its '{logical}' axis (dim {dim}), which the mesh splits {ways} ways "
                f"over {'x'.join(axes)}; {size} is not divisible by {ways}. Change the parallelism "
                f"(ici_*_parallelism) so that it divides {size}, or map '{logical}' elsewhere in logical_axis_rules.")


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules):
    """Within this context, `shard(x, axes)` constrains activations on `mesh` by `rules`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def shard(x, logical_axes: Sequence[str | None]):
    """Constrains activation `x` to the sharding its logical axes map to; a no-op without a mesh."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, logical_axes, rules))


def active_devices():
    """The devices of the mesh set by activation_sharding, or None outside it."""
    active = _ACTIVE.get()
    return None if active is None else list(active[0].devices.flat)


def active_specs(axes_list: Sequence[Sequence[str | None]]):
    """PartitionSpecs of arrays with these logical axes under the active rules, or None outside activation_sharding."""
    active = _ACTIVE.get()
    return None if active is None else [logical_to_spec(axes, active[1]) for axes in axes_list]


def run_in_shards(fn, args: Sequence, in_axes: Sequence[Sequence[str | None]], out_axes: Sequence[str | None]):
    """fn(*args) on each device's own shards: shard_map over the active mesh.

    Each argument is split along the mesh axes its logical axes map to (None: whole on every
    device), and the result is assembled from `out_axes`. For what GSPMD cannot partition (Pallas
    and cuDNN kernels): with specs that match the arrays' shardings, nothing is gathered. Outside
    activation_sharding this is fn(*args). check_vma is off because a Pallas call's output types
    carry no record of which mesh axes they vary over.
    """
    active = _ACTIVE.get()
    if active is None:
        return fn(*args)
    mesh, rules = active
    in_specs = tuple(logical_to_spec(axes, rules) for axes in in_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=logical_to_spec(out_axes, rules),
                         check_vma=False)(*args)
