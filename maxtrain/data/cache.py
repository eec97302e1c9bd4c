"""Online cached preprocessing: train on raw jsonl/parquet while it is being tokenized, once.

With `dataset_type=jsonl|parquet` and `dataset_cache_dir=DIR`, each training source is cut into
the work units of scripts/prepare_data.py (a file, a byte range of a large .jsonl, a run of
parquet row groups; about `dataset_cache_shard_mb` each) and `dataset_cache_workers` background
processes tokenize them with prepare_data's own worker into the prepared format:

    DIR/text-<fingerprint>/plan.json                        the inputs, the settings and the units
    DIR/text-<fingerprint>/train-00003-of-00012.arrayrecord one unit's documents, [bos, ..., eos]
    DIR/text-<fingerprint>/.prepare/unit-00003-of-00012.json  written after its shard: "finished"
    DIR/text-<fingerprint>/metadata.json                    once every unit is finished (then the
                                                            directory is also a dataset_type=arrayrecord input)

Training starts as soon as the first unit it reads is finished, and only ever reads finished
units; later runs (and resumes) find the units finished and tokenize nothing.

The fingerprint is a hash of the tokenizer's checksum, the text field, the unit size and every
input's path and version: size and modification time (ns) for a local file, size and the CRC32C
that GCS keeps for a gs:// object. Not a hash of local content: that would read every input in
full before the first step, which is what this cache exists to avoid; size + mtime changes when a
file is rewritten or appended to (a `touch` re-tokenizes, which is safe). A cache made with another
tokenizer or other inputs has another fingerprint, so it is never read.

Order (independent of the number of workers and of how far the cache had got):
    units      shuffled once (seed), then dealt to hosts: host h owns units h, h + hosts, ...
               of that order; its builder tokenizes them in the order it reads them
    epoch e    the host's units in a permutation drawn from (seed, e); within a unit, the
               documents in a permutation drawn from (seed, e, unit)
The iterator state is (epoch, unit position, document position), so a resume reads on exactly.
"""

from __future__ import annotations

import argparse
import hashlib
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
import json
import multiprocessing
import os
import tempfile
import threading
import time

import grain
import numpy as np

from maxtrain import storage
from maxtrain.data import prepare, prepared
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data.errors import DataError

VERSION = 1
_POLL_SECONDS = {True: 0.5, False: 0.05}  # remote, local
_PROGRESS_SECONDS = 10.0


def fingerprint(files: list[str], tokenizer, field: str, shard_bytes: int) -> tuple[str, dict]:
    """(16 hex digits, what they were computed from)."""
    what = {"version": VERSION, "tokenizer_checksum": tokenizer.checksum, "text_field": field,
            "shard_bytes": shard_bytes, "token_dtype": prepared.token_dtype(tokenizer.vocab_size),
            "inputs": [{"path": f, **storage.signature(f)} for f in files]}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return digest, what


class TextCache:
    """One training source's cache directory: its plan, and which units are finished."""

    def __init__(self, root: str, files: list[str], tokenizer, field: str, shard_mb: float):
        self.files = [storage.abspath(f) for f in files]
        self.field = field
        shard_bytes = int(shard_mb * 1e6)
        self.key, self.inputs = fingerprint(self.files, tokenizer, field, shard_bytes)
        self.directory = storage.join(storage.abspath(root), f"text-{self.key}")
        self.remote = storage.is_remote(self.directory)
        plan_path = storage.join(self.directory, "plan.json")
        if storage.isfile(plan_path):  # planning parquet files reads their footers: do it once
            self.units = json.loads(storage.read_text(plan_path))["units"]
        else:
            self.units = prepare.plan_units(self.files, shard_bytes, "file")
            storage.makedirs(self.directory)
            storage.write_text(plan_path, json.dumps({"fingerprint": self.inputs, "units": self.units}, indent=1))
        self.count = len(self.units)
        self.settings = {"tokenizer_checksum": tokenizer.checksum, "text_field": field, "txt_documents": "file",
                         "eval_fraction": 0.0, "token_dtype": prepared.token_dtype(tokenizer.vocab_size)}
        self.dtype = np.dtype(self.settings["token_dtype"]).newbyteorder("<")

    def marker_path(self, unit: int) -> str:
        return storage.join(self.directory, ".prepare", f"unit-{unit:05d}-of-{self.count:05d}.json")

    def failure_path(self, unit: int) -> str:
        return storage.join(self.directory, ".prepare", f"failed-{unit:05d}-of-{self.count:05d}.txt")

    def marker(self, unit: int) -> dict | None:
        """The unit's marker when it is finished (and its shard is there), else None."""
        path = self.marker_path(unit)
        if not storage.isfile(path):
            return None
        marker = json.loads(storage.read_text(path))
        if marker.get("settings") != self.settings or marker.get("unit") != self.units[unit]:
            return None
        if not all(storage.isfile(storage.join(self.directory, name)) for name in marker["shards"]):
            return None
        return marker

    def finished(self) -> list[int]:
        return [i for i in range(self.count) if self.marker(i) is not None]

    def job(self, unit: int, staging: str) -> dict:
        """prepare.process_unit's job for one unit (written locally, then published here if remote)."""
        return {"index": unit, "count": self.count, "unit": self.units[unit], "settings": self.settings,
                "field_key": "train_data_columns",  # a cache is a training source's
                "output_dir": staging if self.remote else self.directory, "marker": self.marker_path(unit),
                "publish_dir": self.directory if self.remote else None}

    def write_metadata(self, tokenizer) -> None:
        """metadata.json of the prepared format, once every unit is finished."""
        markers = [self.marker(i) for i in range(self.count)]
        if any(m is None for m in markers) or storage.isfile(storage.join(self.directory, prepared.METADATA)):
            return
        args = argparse.Namespace(text_field=self.field, txt_documents="file", eval_fraction=0.0,
                                  tokenizer=tokenizer.path)
        copy = storage.join(self.directory, prepared.tokenizer_copy_name(tokenizer))
        if not storage.is_remote(copy):
            tokenizer.write(copy)
        elif tokenizer.single_file:
            storage.write_bytes(copy, tokenizer.files[tokenizer_lib.SP_MODEL])
        else:
            for name, data in tokenizer.files.items():
                storage.write_bytes(storage.join(copy, name), data)
        meta = prepare.make_metadata(args, tokenizer, self.files, markers, self.settings)
        storage.write_text(storage.join(self.directory, prepared.METADATA), json.dumps(meta, indent=1))


def unit_order(count: int, seed: int, shuffle: bool, index: int, hosts: int) -> list[int]:
    """The units host `index` owns, in the order its builder tokenizes them (epoch 0's order)."""
    order = np.random.default_rng([seed, 0]).permutation(count) if shuffle else np.arange(count)
    return [int(u) for u in order[index::hosts]]


def _epoch_units(owned: list[int], seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle or epoch == 0:
        return list(owned)
    return [owned[i] for i in np.random.default_rng([seed, 1, epoch]).permutation(len(owned))]


# --------------------------------------------------------------------------------------------
# Building (background worker processes, started from the training process)
# --------------------------------------------------------------------------------------------


class Builder:
    """Tokenizes this host's unfinished units in `order` with `workers` processes, in the background."""

    def __init__(self, cache: TextCache, order: list[int], tokenizer, workers: int, log=print):
        self.cache, self.order, self.tokenizer, self.workers, self.log = cache, order, tokenizer, workers, log
        self.error: BaseException | None = None
        self._executor = None
        self._thread = None
        self._stop = threading.Event()
        done = set(cache.finished())
        self.pending = [u for u in order if u not in done]
        self.total_bytes = sum(cache.units[u]["bytes"] for u in self.pending)

    def start(self) -> "Builder":
        c = self.cache
        if not self.pending:
            self.log(f"dataset cache {c.directory}: the {len(self.order)} shards this host reads are finished; "
                     "nothing to tokenize")
            c.write_metadata(self.tokenizer)
            return self
        self.log(f"dataset cache {c.directory}: tokenizing {len(self.pending)} of this host's {len(self.order)} shards "
                 f"({self.total_bytes / 1e6:,.1f} MB) with {self.workers} worker process(es) in the background; "
                 "training reads each shard as soon as it is finished")
        self._thread = threading.Thread(target=self._run, name="dataset-cache", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        c = self.cache
        staging = tempfile.mkdtemp(prefix=f"maxtrain-cache-{c.key}-") if c.remote else c.directory
        context = multiprocessing.get_context("spawn")  # never fork a process that holds JAX's threads
        counter = context.Value("q", 0)
        start, last, done, unit = time.time(), time.time(), 0, None
        # A process pool that notices a worker dying (killed, out of memory): multiprocessing.Pool
        # would lose its task and wait forever.
        executor = futures.ProcessPoolExecutor(min(self.workers, len(self.pending)), mp_context=context,
                                               initializer=prepare.init_worker, initargs=(self.tokenizer, counter))
        self._executor = executor
        try:
            running = {executor.submit(prepare.process_unit, c.job(u, staging)): u for u in self.pending}
            while running and not self._stop.is_set():
                finished, _ = futures.wait(running, timeout=0.5, return_when=futures.FIRST_COMPLETED)
                for future in finished:
                    unit = running.pop(future)
                    future.result()  # a worker's DataError (file, line, fix) or a dead worker, raised here
                    done += 1
                if time.time() - last >= _PROGRESS_SECONDS or not running:
                    last = time.time()
                    self.log(_progress_line(c, done, len(self.pending), counter.value, self.total_bytes, start))
            if not self._stop.is_set():
                c.write_metadata(self.tokenizer)
        except Exception as e:  # pylint: disable=broad-except  (recorded for the reader, which raises it)
            if not self._stop.is_set():
                if isinstance(e, BrokenProcessPool):
                    e = DataError(f"a tokenizing worker process died ({e}); was it killed, or out of memory? "
                                  "Fewer dataset_cache_workers or a smaller dataset_cache_shard_mb need less memory")
                self.error = e
                storage.write_text(c.failure_path(unit if unit is not None else self.pending[0]),
                                   f"{type(e).__name__}: {e}")
                self.log(f"dataset cache {c.directory}: tokenizing failed: {e}")
        finally:
            self._stop_workers()
            self._executor = None

    def _stop_workers(self) -> None:
        executor = self._executor
        if executor is None:
            return
        executor.shutdown(wait=False, cancel_futures=True)
        # ProcessPoolExecutor cannot stop a task that is running; its workers are ended directly.
        for process in list((getattr(executor, "_processes", None) or {}).values()):
            if process.is_alive():
                process.terminate()
            process.join(timeout=10)

    def wait(self) -> None:
        """Blocks until every unit of this host is tokenized; raises the builder's error if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise DataError(f"dataset cache {self.cache.directory}: tokenizing failed: {self.error}")

    def close(self) -> None:
        """Stops the workers (a shard being written is dropped; finished shards stay for the next run)."""
        if self._thread is None:
            return
        if self._thread.is_alive():
            self._stop.set()
            self._stop_workers()
            self._thread.join()
            left = len(self.pending) - sum(1 for u in self.pending if self.cache.marker(u) is not None)
            if left:
                self.log(f"dataset cache {self.cache.directory}: {left} shards not tokenized yet; the next run "
                         "with the same inputs and tokenizer goes on from here")
        self._thread = None


def _progress_line(cache: TextCache, done: int, total: int, done_bytes: int, total_bytes: int, start: float) -> str:
    elapsed = max(time.time() - start, 1e-6)
    rate = done_bytes / elapsed
    eta = (total_bytes - done_bytes) / rate if rate > 0 and done < total else 0
    return (f"dataset cache: {done}/{total} shards, {min(done_bytes, total_bytes) / 1e6:,.1f}/{total_bytes / 1e6:,.1f} MB"
            f" ({100 * min(done_bytes / max(total_bytes, 1), 1):.0f}%), {rate / 1e6:,.2f} MB/s, "
            + (f"ETA {eta:,.0f}s" if done < total else f"done in {elapsed:,.1f}s") + f"  [{cache.directory}]")


# --------------------------------------------------------------------------------------------
# Reading (finished units only, in the deterministic order)
# --------------------------------------------------------------------------------------------


class _CachedIterator(grain.DatasetIterator):
    """State: epoch, position in that epoch's unit list, position in that unit's document order."""

    def __init__(self, ds: "CachedTextIterDataset"):
        super().__init__()
        self._ds = ds
        self._epoch, self._unit, self._doc = 0, 0, 0
        self._records, self._order = None, None

    def _load(self, unit: int) -> None:
        ds, cache = self._ds, self._ds.cache
        marker, waited, told = cache.marker(unit), 0.0, False
        while marker is None:
            if storage.isfile(cache.failure_path(unit)) or ds.builder_error():
                reason = (storage.read_text(cache.failure_path(unit)) if storage.isfile(cache.failure_path(unit))
                          else f"{type(ds.builder_error()).__name__}: {ds.builder_error()}")
                raise DataError(f"dataset cache {cache.directory}: unit {unit} ({cache.units[unit]['path']}) could not "
                                f"be tokenized: {reason}")
            if waited >= 30 and not told:
                told = True
                print(f"waiting for dataset cache shard {unit} of {cache.count} ({cache.directory}); "
                      "is its builder running? (each host tokenizes the shards it reads)", flush=True)
            time.sleep(_POLL_SECONDS[cache.remote])
            waited += _POLL_SECONDS[cache.remote]
            marker = cache.marker(unit)
        records = []
        for name in sorted(marker["shards"]):  # one train shard per unit (eval_fraction is 0)
            records.extend(_read_shard(cache, name))
        self._records = records
        n = len(records)
        self._order = (np.random.default_rng([ds.seed, 2, self._epoch, unit]).permutation(n) if ds.shuffle
                       else np.arange(n))

    def __next__(self) -> np.ndarray:
        ds = self._ds
        while ds.units and (ds.num_epochs is None or self._epoch < ds.num_epochs):
            units = _epoch_units(ds.units, ds.seed, self._epoch, ds.shuffle)
            if self._records is None:
                self._load(units[self._unit])
            if self._doc < len(self._records):
                data = self._records[self._order[self._doc]]
                self._doc += 1
                return np.frombuffer(data, ds.cache.dtype).astype(np.int32)
            self._records, self._doc, self._unit = None, 0, self._unit + 1
            if self._unit == len(units):
                self._epoch, self._unit = self._epoch + 1, 0
        raise StopIteration

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "unit": self._unit, "doc": self._doc}

    def set_state(self, state: dict) -> None:
        self._epoch, self._unit, self._doc = state["epoch"], state["unit"], state["doc"]
        self._records = None


def _read_shard(cache: TextCache, name: str) -> list[bytes]:
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel

    path = storage.join(cache.directory, name)
    local = path
    if cache.remote:
        local = os.path.join(tempfile.gettempdir(), f"maxtrain-cache-read-{os.getpid()}-{cache.key}-{name}")
        storage.download(path, local)
    try:
        reader = array_record_module.ArrayRecordReader(local)
        records = list(reader.read_all())
        reader.close()
    except Exception as e:  # pylint: disable=broad-except  (array_record raises RuntimeError variants)
        raise DataError(f"dataset cache shard {path} cannot be read ({e}); delete {cache.directory} and run again "
                        "to re-tokenize it") from None
    finally:
        if cache.remote and os.path.exists(local):
            os.remove(local)
    return records


class CachedTextIterDataset(grain.IterDataset):
    """The documents of a source's cache (int32 [bos, ..., eos]) for num_epochs (None: forever)."""

    def __init__(self, cache: TextCache, units: list[int], num_epochs: int | None, seed: int, shuffle: bool,
                 builder: Builder | None = None):
        super().__init__()
        self.cache, self.units, self.num_epochs, self.seed, self.shuffle = cache, units, num_epochs, seed, shuffle
        self._builder = builder

    def builder_error(self) -> BaseException | None:
        return self._builder.error if self._builder is not None else None

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain worker processes (grain_worker_count) each read a slice of the units."""
        del sequential_slice
        self.units = self.units[sl]

    def __getstate__(self):  # Grain workers: the builder stays in the training process
        return {**self.__dict__, "_builder": None}

    def __iter__(self) -> _CachedIterator:
        return _CachedIterator(self)
