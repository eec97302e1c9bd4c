"""GRPO with rollout workers over P >= 1 trainer processes (one JAX multi-controller job): what crosses hosts.

    prompts = Gathering(iterator)          # every read: this host's rows, then all hosts' (the full prompt batch)
    arrays = from_zero(arrays)             # process 0's fixed-shape numpy arrays, on every process
    x = fetch(array)                       # a jitted output's whole value on every process (device_get for P = 1)
    batch = to_global(update, mesh, rules) # the full host batch [A, b, T] -> global arrays (each host its own rows)
    parts = shards(params)                 # this host's replica-0 shards of every leaf, by path (no host holds all)
    params = assemble([parts of every host])   # a worker's: each leaf preallocated at its global shape, slices filled

Every process runs Rollouts in lockstep: the same reads of its own prompt shard at the same points, the prompt batch
gathered so that process 0 (the Ray driver) submits it, its completions broadcast back, and the same rewards,
advantages and update batches computed everywhere (reward functions must be deterministic in their inputs: `agree`
checks the advantages match). With P = 1 nothing here calls a collective: the one-process path is today's.
"""

from __future__ import annotations

import jax
import numpy as np

from maxtrain.data import hosts
from maxtrain.parallel.sharding import named_sharding


def several() -> bool:
    return jax.process_count() > 1


def _gather(value: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def gather_rows(batch: dict) -> dict:
    """Every host's rows of a host batch, in process order (byte strings through a padded uint8 matrix)."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.dtype.kind in "SUO":
            raw = [bytes(x) if not isinstance(x, str) else x.encode() for x in value.reshape(-1)]
            width = int(_gather(np.asarray([max([len(r) for r in raw] + [1])], np.int64)).max())
            codes = np.zeros((len(raw), width), np.uint8)
            lengths = np.asarray([len(r) for r in raw], np.int64)
            for i, r in enumerate(raw):
                codes[i, :len(r)] = np.frombuffer(r, np.uint8)
            codes, lengths = _gather(codes), _gather(lengths)
            out[key] = np.asarray([c[:n].tobytes() for c, n in zip(codes, lengths)], dtype=object).reshape(
                (-1,) + value.shape[1:])
        else:
            out[key] = _gather(value)
    return out


class Gathering:
    """A Position (rollout/position.py) whose reads give the full prompt batch: this host's rows first read from its
    own shard (its checkpointed position stays its own), then all hosts' gathered."""

    def __init__(self, position):
        object.__setattr__(self, "position", position)

    def __getattr__(self, name):
        return getattr(self.position, name)

    def __setattr__(self, name, value):  # Rollouts.begin sets the step a plain next() reads for
        setattr(self.position, name, value)

    def __iter__(self):
        return self

    def __next__(self):
        return gather_rows(next(self.position))

    def read(self, step: int):
        return gather_rows(self.position.read(step))


def prompts(iterator):
    """The iterator GRPO's rollouts read: gathering over hosts when there are several."""
    return Gathering(iterator) if several() else iterator


def from_zero(arrays: dict) -> dict:
    """Process 0's arrays on every process (the others pass arrays of the same shapes and dtypes)."""
    if not several():
        return arrays
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return {k: np.asarray(v) for k, v in multihost_utils.broadcast_one_to_all(arrays).items()}


def barrier(name: str) -> None:
    if several():
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        multihost_utils.sync_global_devices(name)


def text_from_zero(text: str, width: int = 512) -> str:
    raw = np.zeros(width, np.uint8)
    data = text.encode()[:width]
    raw[:len(data)] = np.frombuffer(data, np.uint8)
    got = from_zero({"text": raw})["text"]
    return got.tobytes().rstrip(b"\0").decode()


def fetch(value):
    """A jitted output's whole value as numpy on this process (several hosts: gathered from their shards)."""
    if not several():
        return jax.device_get(value)
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(value, tiled=True))


def total(value: float) -> float:
    """The sum over hosts of a host's figure."""
    return float(_gather(np.asarray([value], np.float64)).sum()) if several() else float(value)


def agree(updates: list, step: int) -> None:
    """Every host computed the same update batches (their advantages and weights compared): a reward function that
    answers differently on two hosts would otherwise train each host's rows on different targets."""
    if not several():
        return
    mine = np.asarray([float(np.sum(u[k], dtype=np.float64)) for u in updates
                       for k in ("advantages", "loss_weights")], np.float64)
    every = _gather(mine[None])
    if not (every == every[0]).all():
        raise RuntimeError(f"at step {step + 1} the trainer's processes computed different GRPO update batches from the "
                           "same completions (advantage sums per process: "
                           f"{every[:, ::2].tolist()}): the reward functions must be deterministic in their inputs")


def to_global(update: dict, mesh, rules) -> dict:
    """The update batch every host holds whole -> global arrays; each host contributes the rows its devices hold."""
    if not several():
        return hosts.to_global(update, mesh, rules)
    sharding = named_sharding(mesh, hosts.BATCH_AXES, rules)
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
            for k, v in update.items()}


def _path(key_path) -> tuple:
    names = []
    for k in key_path:
        if not isinstance(k, jax.tree_util.DictKey):
            raise TypeError(f"the params are nested dicts; {jax.tree_util.keystr(key_path)} is not a dict key")
        names.append(k.key)
    return tuple(names)


def whole_leaves(part: list) -> int:
    """How many leaves a host's part holds whole (every element): 0 on a host that holds only slices."""
    return sum(sum(d.size for _, d in pieces) == int(np.prod(shape)) for _, shape, _, pieces in part)


def shards(params) -> tuple[list, int]:
    """(this host's part of the weights, its bytes): per leaf (path, global shape, dtype, [(index, numpy)]) of the
    addressable shards that are replica 0, so every element is sent by exactly one host."""
    part, size = [], 0
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        pieces = []
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                data = np.asarray(shard.data)
                pieces.append((shard.index, data))
                size += int(data.nbytes)
        part.append((_path(key_path), tuple(leaf.shape), np.dtype(leaf.dtype).str, pieces))
    return part, size


def assemble(parts: list) -> dict:
    """A nested param dict of host numpy arrays from every host's part (`shards`)."""
    leaves: dict = {}
    for part in parts:
        for path, shape, dtype, pieces in part:
            if path not in leaves:
                leaves[path] = np.empty(shape, np.dtype(dtype))
            for index, data in pieces:
                leaves[path][index] = data
    params: dict = {}
    for path, value in leaves.items():
        node = params
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return params
