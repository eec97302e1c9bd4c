"""The device mesh and the logical-axis rules.

Model code names what an axis *is* ("batch", "length", "embed", "heads", "layers", "exp", ...);
`logical_axis_rules` in the config say *where* it goes on the mesh axes, which config.MESH_AXES
declares once ("data", "stage", "fsdp", "context", "expert", "tensor"). Switching between FSDP,
tensor, expert, context and pipeline parallelism is a config change only.

Rules are applied in order and each mesh axis is used at most once per array: with
`batch -> [data, fsdp]` and `embed -> fsdp`, a parameter [embed, heads] is sharded over fsdp on
embed, while an activation [batch, length, embed] uses fsdp for batch.
A mesh axis of size 1 splits nothing and is left out of the shardings built on a mesh.

Activations may be placed apart from parameters: a rule for `activation_<axis>` applies to the
activations `shard()` constrains, in place of the rule for `<axis>`. base.yml's
`activation_embed -> tensor` splits the residual stream [batch, length, embed] over the tensor
axis, where the `embed` rule would leave it whole on every tensor-parallel device (the layer
gathers it before its projections and reduce-scatters after them, instead of an all-reduce).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.config import MESH_AXES, parallelism_key  # the one declaration of the mesh axes
from maxtrain.errors import UserError

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
                fixed = ", ".join(f"{parallelism_key(what, a)}={v}" for a, v in parallelism.items() if v not in (-1, 1))
                unit = "devices per slice" if what == "ici" else "slices"
                raise MeshError(f"{fixed} need a multiple of {known} {unit}, but there are {total}. Lower them so "
                                f"that their product divides {total}, or run on more devices.")
            out[axis] = total // known
    if math.prod(out.values()) != total:
        desc = " x ".join(f"{parallelism_key(what, a)}={v}" for a, v in out.items() if v != 1) or f"every {what}_*_parallelism=1"
        raise MeshError(f"{desc} = {math.prod(out.values())}, but there are {total} "
                        f"{'devices per slice' if what == 'ici' else 'slices'}. Make the product equal {total}, "
                        f"or set one of them to -1 to take what is left.")
    return out


def mesh_shape(config, num_devices: int, num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(ici, dcn) parallelism per mesh axis with -1 resolved."""
    if num_devices % num_slices:
        raise MeshError(f"{num_devices} devices do not split evenly into {num_slices} slices")
    ici = _fill({a: getattr(config, parallelism_key("ici", a)) for a in MESH_AXES}, num_devices // num_slices, "ici")
    dcn = _fill({a: getattr(config, parallelism_key("dcn", a)) for a in MESH_AXES}, num_slices, "dcn")
    return ici, dcn


def slices_of(devices, num_slices: int = -1) -> list[list]:
    """The devices grouped by slice. Devices that know their slice (TPU `slice_index`) are grouped by
    it; others form one slice, or, with num_slices > 1, that many simulated slices of consecutive
    devices (ordered by process, then id: a slice never splits a host unless a host spans slices). NVIDIA GPUs report
    one slice however many hosts they span (slice_index 0): there a "slice" is a host's NVLink domain, and
    num_slices > 1 groups them by host as for devices that report none (MaxText's DCN axes on GPUs)."""
    gpus_in_one_slice = (num_slices > 1 and all(getattr(d, "platform", "") in ("gpu", "cuda") for d in devices)
                         and len({getattr(d, "slice_index", 0) for d in devices}) == 1)
    if any(hasattr(d, "slice_index") for d in devices) and not gpus_in_one_slice:
        groups: dict[int, list] = {}
        for d in devices:
            groups.setdefault(getattr(d, "slice_index", 0), []).append(d)
        found = [groups[k] for k in sorted(groups)]
        if num_slices not in (-1, len(found)):
            raise MeshError(f"num_slices={num_slices}, but the devices report {len(found)} slice(s) (slice_index). "
                            "Leave num_slices=-1 to use what the devices report.")
        return found
    if num_slices in (-1, 1):
        return [list(devices)]
    if len(devices) % num_slices:
        raise MeshError(f"num_slices={num_slices} does not divide the {len(devices)} devices evenly; "
                        f"use a divisor of {len(devices)}")
    ordered = sorted(devices, key=lambda d: (getattr(d, "process_index", 0), d.id))
    size = len(ordered) // num_slices
    return [ordered[i * size:(i + 1) * size] for i in range(num_slices)]


def _slice_mesh(shape: list[int], devices) -> np.ndarray:
    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Devices without a known physical topology (e.g. CPU): any order is as good.
        return np.asarray(devices).reshape(shape)


def hybrid_device_array(ici_shape: list[int], dcn_shape: list[int], slices: list[list]) -> np.ndarray:
    """Devices arranged so that mesh axis i spans dcn_shape[i] slices x ici_shape[i] devices of a slice,
    the slice index the major part: the collectives of an axis with dcn 1 stay inside a slice."""
    per_slice = np.stack([_slice_mesh(ici_shape, s) for s in slices])          # [slices, *ici]
    grid = per_slice.reshape(list(dcn_shape) + list(ici_shape))                # [*dcn, *ici]
    n = len(ici_shape)
    interleaved = grid.transpose([j for i in range(n) for j in (i, n + i)])     # [dcn0, ici0, dcn1, ici1, ...]
    return interleaved.reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def create_mesh(config, devices: Sequence | None = None) -> Mesh:
    """The Mesh over all devices (of all processes) with the axes of config.MESH_AXES."""
    devices = list(devices if devices is not None else jax.devices())
    slices = slices_of(devices, getattr(config, "num_slices", -1))
    ici, dcn = mesh_shape(config, len(devices), len(slices))
    ici_shape, dcn_shape = [ici[a] for a in MESH_AXES], [dcn[a] for a in MESH_AXES]
    if len(slices) == 1:
        device_array = _slice_mesh(ici_shape, devices)
    elif len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
    else:
        device_array = hybrid_device_array(ici_shape, dcn_shape, slices)
    return Mesh(device_array, tuple(MESH_AXES))


def mesh_of(devices, **sizes: int) -> Mesh:
    """A Mesh with every axis of config.MESH_AXES over `devices` in their order, the axes not named
    of size 1: mesh_of(devices, data=2, tensor=4) (tests and tools that need a given split)."""
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; mesh axes are {', '.join(MESH_AXES)}")
    shape = [sizes.get(a, 1) for a in MESH_AXES]
    return Mesh(np.asarray(devices).reshape(shape), tuple(MESH_AXES))


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
    """The sharding on `mesh` of an array with these logical axes. Mesh axes of size 1 split nothing
    and are left out: a rule naming `stage` or `context` on a mesh without them gives the same
    sharding as a rule without them."""
    return NamedSharding(mesh, _without(logical_to_spec(logical_axes, rules), trivial_axes(mesh)))


def trivial_axes(mesh) -> set[str]:
    return {a for a, n in mesh.shape.items() if n == 1}


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


def active_mesh():
    """(mesh, rules) set by activation_sharding, or None outside it (for blocks that run in shard_map)."""
    return _ACTIVE.get()


def mesh_axes_of(logical: str, rules) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to under `rules` (first rule wins)."""
    return _rule_axes(rules).get(logical, ())


def ways(logical: str) -> int:
    """How many ways the active mesh splits logical axis `logical` (1 outside activation_sharding):
    ways("length") is the context parallelism, ways("layers") the number of pipeline stages."""
    active = _ACTIVE.get()
    return 1 if active is None else ways_on(active[0], logical, active[1])


def ways_on(mesh, logical: str, rules) -> int:
    """How many ways `mesh` splits logical axis `logical` under `rules`."""
    return math.prod(mesh.shape[a] for a in mesh_axes_of(logical, rules))


def activation_spec(logical_axes: Sequence[str | None], rules) -> PartitionSpec:
    """PartitionSpec of an activation: `activation_<axis>` rules, where given, replace `<axis>` rules."""
    table = _rule_axes(rules)
    return logical_to_spec([f"activation_{a}" if a and f"activation_{a}" in table else a for a in logical_axes],
                           rules)


def shard(x, logical_axes: Sequence[str | None]):
    """Constrains activation `x` to the sharding its logical axes map to; a no-op without a mesh.

    Inside shard_map (a pipeline stage), the constraint is on the remaining automatic axes: the
    mesh axes shard_map made manual are left out of the spec.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = _without(activation_spec(logical_axes, rules), trivial_axes(mesh))
    inner = jax.sharding.get_abstract_mesh()
    manual = set(getattr(inner, "manual_axes", ())) if not inner.empty else set()
    if manual:
        mesh, spec = inner, _without(spec, manual)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _without(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    def keep(entry):
        if entry is None:
            return None
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return PartitionSpec(*(keep(e) for e in spec))


def shard_like_params(tree, specs):
    """Constrains a tree shaped like the parameters (their gradients) to the parameters' shardings,
    from their declarations `specs`; a no-op without a mesh. Without it the partitioner may keep a
    whole gradient on every device, and all-reduce it, where the parameter is sharded."""
    active = _ACTIVE.get()
    if active is None:
        return tree
    mesh, rules = active
    return jax.tree.map(lambda x, spec: jax.lax.with_sharding_constraint(x, named_sharding(mesh, spec.axes, rules)),
                        tree, specs)


def gather_params(tree, specs, logical: str):
    """Parameters (sharded by their declarations `specs`) gathered over the mesh axes of their logical
    axis `logical`, the other axes kept split; their gradient goes back in the parameters' sharding
    (the constraint's own transpose would gather the gradient as well). A no-op without a mesh."""
    gathered = jax.tree.map(lambda s: dataclasses.replace(s, axes=tuple(None if a == logical else a for a in s.axes)),
                            specs)  # (a ParamSpec is a leaf: nested trees, DeepSeek-V4's hc_head, map too)

    @jax.custom_vjp
    def gather(t):
        return shard_like_params(t, gathered)

    gather.defvjp(lambda t: (gather(t), None), lambda _, g: (shard_like_params(g, specs),))
    return gather(tree)


def shard_for_table(rows, tokens):
    """Constrains the rows of a [vocab, embed] table's scatter-add (rows [B, T, D], tokens [B, T]) so that
    D splits as the table's embed axis does, B over the batch's other mesh axes and T over the context axes (as
    the tokens arrive: gathering them would put every token's row on every device): the layout in which each
    device adds its tokens' rows into its own shard of the table. A no-op without a mesh."""
    active = _ACTIVE.get()
    if active is None:
        return rows, tokens
    mesh, rules = active
    table = _rule_axes(rules)
    embed = tuple(a for a in table.get("embed", ()) if mesh.shape[a] > 1)
    batch = tuple(a for a in table.get("batch", ()) if a not in embed and mesh.shape[a] > 1)
    length = tuple(a for a in table.get("length", ()) if a not in embed + batch and mesh.shape[a] > 1)
    lead = [batch or None, length or None][:tokens.ndim] + [None] * (tokens.ndim - 2)
    return (jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, PartitionSpec(*lead, embed or None))),
            jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, PartitionSpec(*lead))))


def active_devices():
    """The devices of the mesh set by activation_sharding, or None outside it."""
    active = _ACTIVE.get()
    return None if active is None else list(active[0].devices.flat)


def active_specs(axes_list: Sequence[Sequence[str | None]]):
    """PartitionSpecs of arrays with these logical axes under the active rules, or None outside activation_sharding."""
    active = _ACTIVE.get()
    return None if active is None else [logical_to_spec(axes, active[1]) for axes in axes_list]


def run_in_shards(fn, args: Sequence, in_axes: Sequence[Sequence[str | None]], out_axes: Sequence[str | None],
                  check_vma: bool = False):
    """fn(*args) on each device's own shards: shard_map over the active mesh.

    Each argument is split along the mesh axes its logical axes map to (None: whole on every
    device), and the result is assembled from `out_axes` (a tuple of them: fn returns that many
    arrays). For what GSPMD cannot partition (Pallas and cuDNN kernels): with specs that match the
    arrays' shardings, nothing is gathered. Inside another shard_map (a pipeline stage) its manual axes are left to it. Outside
    activation_sharding this is fn(*args). check_vma is off by default because a Pallas call's
    output types carry no record of which mesh axes they vary over.
    """
    active = _ACTIVE.get()
    if active is None:
        return fn(*args)
    mesh, rules = active
    skip = trivial_axes(mesh)
    inner = jax.sharding.get_abstract_mesh()
    manual = set(inner.manual_axes) if not inner.empty else set()
    if manual:
        mesh, skip = inner, skip | manual
    in_specs = tuple(_without(logical_to_spec(axes, rules), skip) for axes in in_axes)
    several = bool(out_axes) and isinstance(out_axes[0], (tuple, list))
    out_spec = (tuple(_without(logical_to_spec(axes, rules), skip) for axes in out_axes) if several else
                _without(logical_to_spec(out_axes, rules), skip))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                         axis_names=set(mesh.axis_names) - manual, check_vma=check_vma)(*args)
