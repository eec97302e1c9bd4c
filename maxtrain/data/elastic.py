"""Elastic resume: where the input continues when a run resumes on a different number of processes.

Every process reads its own share of one global document order (sources.py: the seeded shuffle
of a random-access source, repeated per epoch), and a checkpoint keeps each process' Grain
iterator state: how many of its documents it has read, and how far into the one being packed.
Saved by P processes and resumed by Q, those states cannot be restored one to one. `merge` turns
the P saved states into Q new ones so that over the rest of the epoch every document nobody has
read is read exactly once, and the one a process was cutting into rows continues where it stopped.

Layout. A process reads the global order through `HostDocuments`, as its layout says:

    leftovers   global positions (each with a token offset) to read first
    tail        then positions start + index, start + index + count, start + index + 2 count, ...

A fresh run has no leftovers and start 0: process i of P reads i, i + P, i + 2P, ..., as before
(the same documents in the same order, so an unchanged run is bitwise unchanged). The layout is
part of the iterator's state, so a later resume rebuilds the same reader.

Merging P states into Q. Process i has read its leftovers and its tail up to round j_i (it reads
position start + i + P j in round j). From round J = max_i j_i on, nobody has read anything:
the new tail starts at start + P J and is split Q ways. The positions before it that someone has
not read (rounds j_i .. J - 1 of each process, and unread leftovers) become the new leftovers,
in global order, dealt out to the Q processes in turn; the document a process was in the middle
of is a leftover with its token offset (concat_then_split: the tokens already emitted; packing
false: the pieces already emitted, T tokens each). Which process reads what changes, and so do
the batches: bitwise equality with an unchanged run is not expected across an elastic resume.

What merges: random-access sources (`default`, `arrayrecord`) with one training source, packed
with concat_then_split or not packed, and synthetic data. Anything else (first_fit bins holding
documents across the checkpoint, mixtures, jsonl/parquet read by file, Grain worker processes)
is refused before any work (`check`), with what to do instead.
"""

from __future__ import annotations

import json
import os
import re

import grain

from maxtrain import storage
from maxtrain.config import MESH_AXES, parallelism_key
from maxtrain.data.errors import DataError

_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")


# --------------------------------------------------------------------------------------------
# The reader whose state carries its layout
# --------------------------------------------------------------------------------------------


def fresh_layout(index: int, count: int) -> dict:
    return {"index": index, "count": count, "start": 0, "leftovers": []}


class _Lookup:
    """Element k of a layout: a leftover (from its token offset on), then the tail (picklable)."""

    def __init__(self, stream, layout: dict):
        self.stream, self.leftovers = stream, layout["leftovers"]
        self.first, self.step = layout["start"] + layout["index"], layout["count"]

    def __call__(self, k: int):
        if k < len(self.leftovers):
            position, offset = self.leftovers[k]
            return self.stream[position][offset:]
        return self.stream[self.first + self.step * (k - len(self.leftovers))]


def _reader(stream, layout: dict, read_options):
    # With num_epoch set the order ends: positions past it (another process' rounds) are dropped.
    layout = {**layout, "leftovers": [x for x in layout["leftovers"] if x[0] < len(stream)]}
    tail = len(range(layout["start"] + layout["index"], len(stream), layout["count"]))
    positions = grain.MapDataset.range(len(layout["leftovers"]) + tail)
    return iter(positions.map(_Lookup(stream, layout)).to_iter_dataset(read_options))


class _HostDocumentsIterator(grain.DatasetIterator):
    def __init__(self, ds: "HostDocuments"):
        super().__init__()
        self._ds = ds
        self._layout = fresh_layout(ds.index, ds.count)
        self._inner = _reader(ds.stream, self._layout, ds.read_options)

    def __next__(self):
        return next(self._inner)

    def get_state(self) -> dict:
        return {**self._inner.get_state(), "layout": self._layout}

    def set_state(self, state: dict) -> None:
        # A state saved before layouts existed ({"next_index": n}) is the fresh layout's.
        layout = state.get("layout", fresh_layout(self._ds.index, self._ds.count))
        if (layout["index"], layout["count"]) != (self._ds.index, self._ds.count):
            raise DataError(f"the data-iterator state is process {layout['index']}'s of {layout['count']}, but this is "
                            f"process {self._ds.index} of {self._ds.count}; merge the saved states (elastic.merge)")
        if layout != self._layout:
            self._layout = layout
            self._inner = _reader(self._ds.stream, layout, self._ds.read_options)
        self._inner.set_state({k: v for k, v in state.items() if k != "layout"})


class HostDocuments(grain.IterDataset):
    """Process `index` of `count`'s documents of the global order `stream` (a MapDataset), read as
    its layout says (fresh: positions index, index + count, ...), with `read_options`' threads."""

    def __init__(self, stream: grain.MapDataset, index: int, count: int, read_options):
        super().__init__()
        self.stream, self.index, self.count, self.read_options = stream, index, count, read_options

    def __iter__(self) -> _HostDocumentsIterator:
        return _HostDocumentsIterator(self)


# --------------------------------------------------------------------------------------------
# Which runs can merge, and reading what was saved
# --------------------------------------------------------------------------------------------


def unsupported(config) -> str | None:
    """Why the input of `config` cannot be merged across process counts, or None if it can."""
    if config.dataset_type == "synthetic":
        return None
    if config.dataset_type not in ("default", "arrayrecord"):
        return (f"dataset_type={config.dataset_type} shards by file (each process reads whole files), so a different "
                "number of processes would read other files. Prepare the data with scripts/prepare_data.py and use "
                "dataset_type=arrayrecord (documents are dealt out one by one), or resume on the same process count")
    if ";" in config.grain_train_files.strip().strip(";"):
        return ("a mixture of training sources (grain_train_files with ';') interleaves per-process streams; "
                "resume on the same process count")
    if config.packing and config.grain_packing_type != "concat_then_split":
        return (f"grain_packing_type={config.grain_packing_type} holds documents in open bins across the checkpoint; "
                "resume on the same process count (or train with concat_then_split)")
    if config.grain_worker_count > 0:
        return (f"grain_worker_count={config.grain_worker_count}: each worker process keeps its own position; "
                "resume with grain_worker_count=0, or on the same process count")
    return None


def saved_states(data_dir: str) -> list[dict]:
    """The per-process iterator states of a checkpoint's data/ directory, in process order."""
    found = {}
    listing = storage.listdir(data_dir) if storage.isdir(data_dir) else []
    for name in listing:
        match = _FILE.match(name)
        if match:
            found[int(match.group(1))] = (int(match.group(2)), os.path.join(data_dir, name))
    counts = {count for count, _ in found.values()}
    if len(counts) != 1 or sorted(found) != list(range(counts.pop())):
        raise DataError(f"{data_dir} does not hold one data-iterator state per process of one run "
                        f"(found {sorted(listing) or 'nothing'})")
    states = []
    for i in sorted(found):
        states.append(json.loads(storage.read_text(found[i][1])))
    return states


def saved_process_count(step_dir: str) -> int | None:
    """How many processes saved the data-iterator states of a checkpoint (None without any)."""
    data_dir = os.path.join(step_dir, "data")
    names = [n for n in storage.listdir(data_dir) if _FILE.match(n)] if storage.isdir(data_dir) else []
    return int(_FILE.match(names[0]).group(2)) if names else None


# --------------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------------


def _unwrap(state: dict, config) -> tuple[dict, dict, int, dict | None]:
    """(documents state, packer state, token offset into the current document, padding state) of
    one saved state of train_iterator's pipeline (pipeline.py)."""
    try:
        pad = state if config.num_epoch != -1 else None
        packer = state["parent"] if pad is not None else state
        docs = packer["parent"]
        offset = packer["offset"] if config.packing else packer["next_index_in_buffer"] * config.max_target_length
        docs["next_index"]  # pylint: disable=pointless-statement
    except (KeyError, TypeError):
        raise DataError("the saved data-iterator state does not have the shape this config's input pipeline writes "
                        f"({json.dumps(state)[:200]}); resume with the settings it was saved with") from None
    return docs, packer, offset, pad


def _remaining(layout: dict, next_index: int, offset: int) -> tuple[list, int]:
    """(unread leftovers with offsets, first unread tail round) of one process."""
    leftovers = [list(x) for x in layout["leftovers"][next_index:]]
    if leftovers and offset:
        leftovers[0][1] += offset
    round_ = max(0, next_index - len(layout["leftovers"]))
    position = layout["start"] + layout["index"] + layout["count"] * round_
    if next_index >= len(layout["leftovers"]) and offset:
        leftovers.append([position, offset])
        round_ += 1
    return leftovers, round_


def merge_layouts(layouts: list[tuple[dict, int, int]], new_count: int) -> list[dict]:
    """Q = new_count layouts that read exactly what the P saved ones (layout, next_index, token
    offset) have not read. (With num_epoch set, positions past the end are dropped when read.)"""
    starts = {(layout["start"], layout["count"]) for layout, _, _ in layouts}
    if len(starts) != 1 or sorted(layout["index"] for layout, _, _ in layouts) != list(range(len(layouts))):
        raise DataError("the saved data-iterator states are not the processes of one run; they cannot be merged")
    start, count = starts.pop()
    leftovers, rounds = [], []
    for layout, next_index, offset in sorted(layouts, key=lambda x: x[0]["index"]):
        unread, round_ = _remaining(layout, next_index, offset)
        leftovers += unread
        rounds.append((layout["index"], round_))
    last = max(r for _, r in rounds)
    for index, round_ in rounds:  # tail positions some processes reached and others did not
        leftovers += [[p, 0] for p in range(start + index + count * round_, start + index + count * last, count)]
    leftovers.sort()
    new_start = start + count * last
    return [{"index": q, "count": new_count, "start": new_start, "leftovers": leftovers[q::new_count]}
            for q in range(new_count)]


def merge(states: list[dict], config, new_count: int) -> list[dict]:
    """The Q = new_count iterator states that continue the P saved `states` (train_iterator's
    pipeline of `config`), reading every unread document exactly once."""
    reason = unsupported(config)
    if reason:
        raise DataError(f"cannot resume the input on {new_count} processes after {len(states)}: {reason}")
    if config.dataset_type == "synthetic":  # every process is at the same batch index; rows follow the global index
        indices = {s["next_index"] for s in states}
        if len(indices) != 1:
            raise DataError(f"the saved synthetic-data states disagree on the batch index: {sorted(indices)}")
        return [dict(states[0]) for _ in range(new_count)]
    parts = [_unwrap(s, config) for s in states]
    layouts = [(docs.get("layout", fresh_layout(i, len(states))), docs["next_index"], offset)
               for i, (docs, _, offset, _) in enumerate(parts)]
    out = []
    for layout in merge_layouts(layouts, new_count):
        docs = {"next_index": 0, "layout": layout}
        packer = {"parent": docs, "offset": 0} if config.packing else {"parent": docs, "next_index_in_buffer": 0}
        if config.num_epoch != -1:  # how many real batches came before: the most any process emitted
            packer = {"parent": packer, "real": max(p[3]["real"] for p in parts), "padding": 0}
        out.append(packer)
    return out


def restore(data_dir: str, iterator, config, process_index: int, process_count: int) -> int:
    """Sets `iterator` (this process' train iterator) to its share of the merged saved states;
    returns how many processes saved them."""
    states = saved_states(data_dir)
    iterator.set_state(merge(states, config, process_count)[process_index])
    return len(states)


def describe_change(saved_meta: dict, config, process_count: int) -> str:
    """The start-up summary's line when a run resumes on other processes, devices or mesh ("" if none)."""
    saved = saved_meta.get("config", {})
    keys = [parallelism_key(p, a) for p in ("ici", "dcn") for a in MESH_AXES] + ["num_slices"]
    mesh = [f"{k} {saved[k]} -> {getattr(config, k)}" for k in keys if k in saved and saved[k] != getattr(config, k)]
    before = (saved_meta.get("num_processes"), saved_meta.get("num_devices"))
    after = (process_count, config.num_devices)
    if before == after and not mesh:
        return ""
    merged = (f"the {before[0]} saved data-iterator states merged into {after[0]} (every unread document read once)"
              if before[0] != after[0] else "the data-iterator states restored as saved")
    return (f"elastic resume: saved by {before[0]} process(es) x {before[1]} devices, now {after[0]} x {after[1]}"
            + (f" ({'; '.join(mesh)})" if mesh else "") + f": Orbax reshards the state, {merged}. Bitwise equality "
            "with an unchanged run is not expected across this resume (other reduction orders; other batches "
            "when the process count changed).")
