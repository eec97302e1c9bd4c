"""Host sharding and padding: every JAX process feeds its own rows; none may stop before the others.

Pax semantics: shard index = process index, shard count = process count, set automatically. Each
process builds host batches of `per_device_batch_size x local devices` rows; the global batch is
their concatenation, assembled with `jax.make_array_from_process_local_data`.

A step is a collective: if one host ran out of data and stopped, the others would wait for it
forever. So a host whose data is exhausted emits padding batches (every loss weight 0, segment id
0) for as long as the others still have data (`generate_padding_batch_train` /
`generate_padding_batch_eval`); without them it stops with an error that says so.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import numpy as np

from maxtrain.config.batch import rows as batch_rows
from maxtrain.data.errors import DataError
from maxtrain.parallel.sharding import named_sharding

BATCH_AXES = (None, "batch", "length")   # train host batch [A, b, T]
EVAL_BATCH_AXES = ("batch", "length")    # eval host batch [b, T]
KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_weights")


def host_micro_batch(config) -> int:
    """Rows per micro-batch on this host: per_device_batch_size x this process' devices (whole: a fraction
    that makes a part of a row is refused by config_lib.with_devices)."""
    return batch_rows(config.per_device_batch_size, jax.local_device_count())


def padding_batch(leading: tuple[int, ...], length: int) -> dict:
    """A batch that changes nothing: all tokens 0 (pad), segment 0, loss weight 0."""
    shape = tuple(leading) + (length,)
    batch = {k: np.zeros(shape, np.int32) for k in KEYS}
    batch["loss_weights"] = np.zeros(shape, np.float32)
    return batch


def fill_rows(batch: dict, rows: int) -> dict:
    """Pads a short last batch [n < rows, T] with padding rows (other keys, e.g. a row's images or positions
    [T, streams], with zeros)."""
    n = batch["inputs"].shape[0]
    if n == rows:
        return batch
    pad = padding_batch((rows - n,), batch["inputs"].shape[-1])

    def padding(k):
        v = batch[k]
        return pad[k].astype(v.dtype) if k in pad and pad[k].shape[1:] == v.shape[1:] else \
            np.zeros((rows - n,) + v.shape[1:], v.dtype)
    return {k: np.concatenate([batch[k], padding(k)]) for k in batch}


def agree(count: int, process_count: int) -> list[int]:
    """Every process' `count`, on every process (one small cross-process gather)."""
    if process_count == 1 or jax.process_count() == 1:
        return [count]
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    return [int(c) for c in np.asarray(multihost_utils.process_allgather(np.asarray(count, np.int64)))]


def file_shards(files: list[str], process_index: int, process_count: int) -> list[str]:
    """File-based sharding for sequential sources: host i reads files i, i + count, ..."""
    return files[process_index::process_count]


# --------------------------------------------------------------------------------------------
# Padding after the data runs out (checkpointable: the state says how far it got)
# --------------------------------------------------------------------------------------------


class _PadIterator(grain.DatasetIterator):
    def __init__(self, parent, ds: "PadWhenExhausted"):
        super().__init__(parent)
        self._ds = ds
        self._real = 0       # real batches emitted
        self._padding = 0    # padding batches emitted after the data ran out

    def __next__(self):
        if self._padding == 0:
            try:
                batch = next(self._parent)
                self._real += 1
                return batch
            except StopIteration:
                if not self._ds.allow:
                    raise DataError(self._ds.exhausted_message(self._real)) from None
                self._ds.log(f"host {self._ds.process_index}: {self._ds.what} ran out after {self._real} batches; "
                             "zero-weight padding batches follow so that the other hosts can finish")
        self._padding += 1
        return self._ds.padding

    def get_state(self) -> dict:
        return {"parent": self._parent.get_state(), "real": self._real, "padding": self._padding}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._real, self._padding = state["real"], state["padding"]


class PadWhenExhausted(grain.IterDataset):
    """Batches of `parent`, then (allow=True) padding batches forever; allow=False: a DataError."""

    def __init__(self, parent: grain.IterDataset, padding: dict, allow: bool, process_index: int, what: str,
                 fix: str, log=print):
        super().__init__(parent)
        self.padding, self.allow, self.process_index, self.what, self.fix, self.log = (
            padding, allow, process_index, what, fix, log)

    def exhausted_message(self, real: int) -> str:
        return f"host {self.process_index}: {self.what} ran out after {real} batches. {self.fix}"

    def __iter__(self) -> _PadIterator:
        return _PadIterator(self._parent.__iter__(), self)


# --------------------------------------------------------------------------------------------
# Host batch -> global array
# --------------------------------------------------------------------------------------------


def to_global(host_batch: dict, mesh, rules, axes=BATCH_AXES) -> dict[str, Any]:
    """Assembles every process' rows into global arrays sharded over the batch mesh axes."""
    sharding = named_sharding(mesh, axes, rules)
    batch_dim = axes.index("batch")
    out = {}
    for key, local in host_batch.items():
        global_shape = list(local.shape)
        global_shape[batch_dim] *= jax.process_count()
        out[key] = jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))
    return out
