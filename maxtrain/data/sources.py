"""Where documents come from, and which host reads which.

    dataset_type   access       order                                          host sharding
    default        random       global shuffle by seed, a new order each epoch document i -> host i % hosts
    arrayrecord    random       (same)                                         (same)
    jsonl/parquet  sequential   file order shuffled per epoch, then documents  file j -> host j % hosts
                                shuffled within windows of grain_shuffle_window
    jsonl/parquet  cached       units (~dataset_cache_shard_mb of input) in a  unit j of a seeded order
    + dataset_cache_dir         seeded order per epoch, documents shuffled    -> host j % hosts
                                within each unit (cache.py: tokenized once, in the background)
    synthetic      no documents (pipeline.synthetic_iterator)

`grain_train_files` / `grain_eval_files` name the files: globs separated by commas, and several
weighted sources separated by semicolons, e.g. "a/*.arrayrecord:0.7;b/*.arrayrecord:0.3". A
mixture draws documents from its sources in proportion to the weights (Grain's deterministic
mix, so the proportion holds in every stretch of the stream, and after a resume). Eval reads the
union of its sources once, in order.

`open_sources` lists and checks everything before training starts (missing paths, empty globs and
shards, metadata, the tokenizer); `train_documents` / `eval_documents` build this host's Grain
dataset of documents, each int32 [bos, tokens..., eos].
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
from typing import Any

import grain
import numpy as np

from maxtrain import storage
from maxtrain.data import cache as cache_lib
from maxtrain.data import default_corpus, elastic, hosts, prepared, text_files
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data.errors import DataError

RANDOM_ACCESS = ("default", "arrayrecord")
SEQUENTIAL = ("jsonl", "parquet")
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=256)


@dataclasses.dataclass
class Component:
    spec: str                    # the glob(s) as written in the config
    weight: float
    files: list[str]
    documents: Any = None        # PreparedDocuments (arrayrecord) or a list of arrays (default)
    cache: Any = None            # cache.TextCache (jsonl/parquet with dataset_cache_dir)


@dataclasses.dataclass
class Sources:
    dataset_type: str
    tokenizer: tokenizer_lib.Tokenizer
    train: list[Component]
    eval: list[Component]        # [] when there is no eval data
    eval_pool: Any = None        # random access: all eval documents as one source, opened once
    builders: list = dataclasses.field(default_factory=list)  # cache.Builder: background tokenizing

    def close(self) -> None:
        """Stops background cache building (what is finished stays for the next run)."""
        for builder in self.builders:
            builder.close()


def data_seed(config, salt: str) -> int:
    """A 32-bit seed for the data, split from the root seed by name."""
    return int.from_bytes(hashlib.sha256(f"{config.seed}/data/{salt}".encode()).digest()[:4], "little")


# --------------------------------------------------------------------------------------------
# Listing and checking (before training)
# --------------------------------------------------------------------------------------------


def _matches(pattern: str) -> bool:
    try:
        return any(storage.glob(p.strip()) for p in pattern.split(",") if p.strip())
    except OSError:  # gs:// that cannot be listed: parse_files reports it
        return False


def _split_weight(part: str, key: str) -> tuple[str, float]:
    """"glob:0.7" -> ("glob", 0.7); a colon that is part of a path is left alone."""
    head, sep, tail = part.rpartition(":")
    if not sep or "/" in tail or (_matches(part) and not _matches(head)):
        return part, 1.0  # no weight, or a colon inside a path
    if not head.strip():
        raise DataError(f"{key}: {part!r} has a weight but no files before it; write <glob>:<weight>, "
                        "e.g. a/*.arrayrecord:0.7;b/*.arrayrecord:0.3")
    try:
        weight = float(tail)
    except ValueError:
        raise DataError(f"{key}: the weight of {head!r} is {tail.strip()!r}, which is not a number; write "
                        "<glob>:<weight> with a number > 0, e.g. a/*.arrayrecord:0.7;b/*.arrayrecord:0.3") from None
    if not (math.isfinite(weight) and weight > 0):
        raise DataError(f"{key}: the weight of {head!r} is {tail.strip()}; weights must be finite and > 0")
    return head, weight


def parse_files(spec: str, key: str, dataset_type: str = "") -> list[Component]:
    """"a/*,b/x:0.7;c/*:0.3" -> components with their files (sorted, duplicates removed). `dataset_type`: the
    files' format, for the glob suggested when a pattern names a directory."""
    components = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        pattern, weight = _split_weight(part, key)
        files = []
        for one in (p.strip() for p in pattern.split(",") if p.strip()):
            try:
                matched = storage.glob(one)
            except OSError as e:  # gs://: no such bucket, no credentials, no network
                raise DataError(f"{key}: cannot list {one!r} ({type(e).__name__}: {e}). Check the bucket name and "
                                "your credentials (gcloud auth application-default login).") from None
            if not matched:
                formats = (dataset_type,) if dataset_type in (*SEQUENTIAL, "arrayrecord") else ()
                prefix = "eval-" if key == "grain_eval_files" else "train-"
                problem = text_files.unmatched(one, formats, prefix)
                fix = "" if storage.isdir(one.rstrip("/") or one) else (
                    ". Check the path, or prepare the data with scripts/prepare_data.py --output-dir DIR and use "
                    f"DIR/{prefix}*.arrayrecord.")
                raise DataError(f"{key}: {one!r} {problem}{fix}")
            files.extend(m for m in matched if m not in files)
        components.append(Component(pattern, weight, files))
    if not components:
        raise DataError(f"{key} is empty; set it to a glob of data files")
    return components


def load_tokenizer(config, prepared_with: dict | None, prepared_dir: str | None, log=print) -> tokenizer_lib.Tokenizer:
    copy = os.path.join(prepared_dir, prepared_with.get("file", prepared.TOKENIZER)) if prepared_with else None
    if config.tokenizer_path:
        tok = tokenizer_lib.load(config.tokenizer_path)
        given = "tokenizer_path" in getattr(config, "given_keys", ["tokenizer_path"])
        if prepared_with and tok.checksum != prepared_with["checksum"] and given:
            raise DataError(f"the prepared data in {prepared_dir} was tokenized with tokenizer {prepared_with['checksum']}"
                            f" ({prepared_with.get('prepared_with')}), but tokenizer_path={config.tokenizer_path!r} "
                            f"has checksum {tok.checksum}. Set tokenizer_path={copy} "
                            "(or leave it empty to use that one), or re-run prepare_data.py with this tokenizer.")
        if prepared_with and tok.checksum != prepared_with["checksum"]:  # the checkpoint's, adopted with its model
            raise DataError(f"the prepared data in {prepared_dir} was tokenized with tokenizer {prepared_with['checksum']}"
                            f" ({prepared_with.get('prepared_with')}), but the model's tokenizer, {config.tokenizer_path} "
                            f"(adopted from its checkpoint), has checksum {tok.checksum}: its token ids would mean "
                            f"other words to the model. Prepare the data again with prepare_data.py --tokenizer "
                            f"{config.tokenizer_path}")
    elif prepared_with:
        tok = tokenizer_lib.load(copy)
        if tok.checksum != prepared_with["checksum"]:
            raise DataError(f"{copy} does not match the checksum in its metadata.json; re-run prepare_data.py")
    else:
        raise DataError(f"dataset_type={config.dataset_type} tokenizes text as it reads it and needs "
                        f"tokenizer_path=<{tokenizer_lib.ACCEPTS}>; train one with scripts/train_tokenizer.py "
                        f"--input '<your files>' --output tok.model --vocab-size {config.vocab_size}")
    tokenizer_lib.check_vocab(tok, config.vocab_size)
    tokenizer_lib.warn_if_no_eos(tok, log)
    return tok


def _check_text_files(components: list[Component], dataset_type: str, key: str, field: str, field_key: str) -> None:
    for component in components:
        for path in component.files:
            fmt, _ = text_files.file_format(path)
            if fmt != dataset_type:
                raise DataError(f"{key}: {path} is a {fmt} file but dataset_type={dataset_type}; list only "
                                f"{dataset_type} files (or set dataset_type={fmt})")
            if storage.size(path) == 0:
                raise DataError(f"{path} is empty: an empty shard. Delete it or narrow the glob in {key}.")
            text_files.check(path, field, field_key)  # a missing field or bad first line fails now, not mid-run


def _column(config, split: str) -> str:
    columns = config.train_data_columns if split == "train" else config.eval_data_columns
    key = f"{split}_data_columns"
    if not (isinstance(columns, list) and len(columns) == 1 and isinstance(columns[0], str)):
        raise DataError(f"{key}={columns!r} must name exactly one text field, e.g. {key}=[text]")
    return columns[0]


def open_sources(config, log=print) -> Sources:
    """Lists and checks the train and eval data and resolves the tokenizer."""
    kind = config.dataset_type
    if kind == "default":
        tok, train_docs, eval_docs = default_corpus.documents(config, log=log)
        return Sources(kind, tok, [Component("<default corpus>", 1.0, [], train_docs)],
                       [Component("<default corpus, held out>", 1.0, [], eval_docs)], eval_docs)
    train = parse_files(config.grain_train_files, "grain_train_files", kind)
    evals = parse_files(config.grain_eval_files, "grain_eval_files", kind) if config.grain_eval_files else []
    if kind == "arrayrecord":
        remote = [f for c in train + evals for f in c.files if storage.is_remote(f)]
        if remote:
            raise DataError(f"dataset_type=arrayrecord reads shards from local disk, not {remote[0]}. For data on "
                            "gs://, train on the raw jsonl/parquet with dataset_cache_dir=gs://... (tokenized once "
                            "into a cache there), or copy the prepared directory to local disk.")
        for c in train + evals:
            c.documents = prepared.PreparedDocuments(c.files)
        first = train[0].documents
        tok = load_tokenizer(config, first.tokenizer, first.directories[0], log)
        for key, components in (("grain_train_files", train), ("grain_eval_files", evals)):
            for c in components:
                if c.documents.tokenizer["checksum"] != tok.checksum:
                    what = "train and eval inputs" if key == "grain_eval_files" else "the train sources"
                    raise DataError(f"{what} use different tokenizers: {c.spec} was prepared with "
                                    f"{c.documents.tokenizer['checksum']}, {train[0].spec} with {tok.checksum}. "
                                    "Prepare every source with the same --tokenizer.")
        pool = prepared.PreparedDocuments([f for c in evals for f in c.files]) if evals else None
        return Sources(kind, tok, train, evals, pool)
    if kind in SEQUENTIAL:
        tok = load_tokenizer(config, None, None, log)
        _check_text_files(train, kind, "grain_train_files", _column(config, "train"), "train_data_columns")
        if evals:  # eval_data_columns matters only with eval files
            _check_text_files(evals, kind, "grain_eval_files", _column(config, "eval"), "eval_data_columns")
        if config.dataset_cache_dir:  # tokenize once into a cache, in the background (cache.py)
            for c in train:
                try:
                    c.cache = cache_lib.TextCache(config.dataset_cache_dir, c.files, tok, _column(config, "train"),
                                                  config.dataset_cache_shard_mb)
                except OSError as e:
                    raise DataError(f"dataset_cache_dir={config.dataset_cache_dir!r} cannot be used ({type(e).__name__}:"
                                    f" {e}); point it at a writable directory or bucket") from None
        return Sources(kind, tok, train, evals)
    raise DataError(f"dataset_type={kind} has no document source")


# --------------------------------------------------------------------------------------------
# Sequential text files as a checkpointable Grain dataset
# --------------------------------------------------------------------------------------------


class _TextFilesIterator(grain.DatasetIterator):
    """State: (epoch, file in this epoch's order, records read from it); resuming skips records."""

    def __init__(self, ds: "TextFilesIterDataset"):
        super().__init__()
        self._ds = ds
        self._epoch, self._file, self._record, self._docs = 0, 0, 0, 0
        self._texts = None

    def _path(self) -> str:
        files = self._ds.files
        if not self._ds.shuffle_files:
            return files[self._file]
        order = np.random.default_rng([self._ds.seed, self._epoch]).permutation(len(files))
        return files[order[self._file]]

    def __next__(self) -> str:
        ds = self._ds
        while ds.files and (ds.num_epochs is None or self._epoch < ds.num_epochs):
            if self._texts is None:
                self._texts = text_files.read_texts(self._path(), ds.field, skip=self._record, field_key=ds.field_key)
            for text in self._texts:
                self._record += 1
                if text.strip():
                    self._docs += 1
                    return text
            self._texts, self._file, self._record = None, self._file + 1, 0
            if self._file == len(ds.files):
                if self._docs == 0:
                    raise DataError(f"{ds.what}: the files {', '.join(ds.files[:3])}{' ...' if len(ds.files) > 3 else ''}"
                                    f" hold no documents (every record is empty). Remove them or fix the text field.")
                self._epoch, self._file, self._docs = self._epoch + 1, 0, 0
        raise StopIteration

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "file": self._file, "record": self._record, "docs": self._docs}

    def set_state(self, state: dict) -> None:
        self._epoch, self._file, self._record, self._docs = (state["epoch"], state["file"], state["record"],
                                                             state["docs"])
        self._texts = None


class TextFilesIterDataset(grain.IterDataset):
    """The non-empty documents of `files` (jsonl or parquet), file after file, for num_epochs (None: forever)."""

    def __init__(self, files: list[str], field: str, num_epochs: int | None, seed: int, shuffle_files: bool,
                 what: str, field_key: str = "train_data_columns"):
        super().__init__()
        self.files, self.field, self.num_epochs, self.seed, self.shuffle_files, self.what = (
            files, field, num_epochs, seed, shuffle_files, what)
        self.field_key = field_key  # the setting that names `field`, for messages

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain worker processes (grain_worker_count) each read a slice of the files."""
        del sequential_slice
        self.files = self.files[sl]

    def __iter__(self) -> _TextFilesIterator:
        return _TextFilesIterator(self)


class _WindowShuffleIterator(grain.DatasetIterator):
    """Reads `window` elements, yields them in a seeded random order. State: the parent's state at
    the window's start and the position in it (a resume re-reads the window)."""

    def __init__(self, parent, window: int, seed: int):
        super().__init__(parent)
        self._size, self._seed = window, seed
        self._index, self._pos, self._buffer = 0, 0, []
        self._start = parent.get_state()

    def _fill(self) -> None:
        self._start = self._parent.get_state()
        self._buffer = list(itertools.islice(self._parent, self._size))
        order = np.random.default_rng([self._seed, self._index]).permutation(len(self._buffer))
        self._buffer = [self._buffer[i] for i in order]

    def __next__(self):
        if self._pos == len(self._buffer):
            if self._buffer:
                self._index += 1
            self._pos = 0
            self._fill()
            if not self._buffer:
                raise StopIteration
        self._pos += 1
        return self._buffer[self._pos - 1]

    def get_state(self) -> dict:
        return {"parent": self._start, "window": self._index, "position": self._pos}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._index = state["window"]
        self._fill()
        self._pos = state["position"]


class WindowShuffleIterDataset(grain.IterDataset):
    """Shuffles within consecutive windows of `window` elements (numpy permutation per window:
    Grain's own window shuffle costs milliseconds per element for small windows)."""

    def __init__(self, parent: grain.IterDataset, window: int, seed: int):
        super().__init__(parent)
        self.window, self.seed = window, seed

    def __iter__(self):
        return _WindowShuffleIterator(self._parent.__iter__(), self.window, self.seed)


class _Encode:
    """text -> int32 [bos, tokens..., eos] (a class, not a lambda, so Grain workers can pickle it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> np.ndarray:
        return np.asarray(tokenizer_lib.document(self.tokenizer, self.tokenizer.encode(text)), np.int32)


# --------------------------------------------------------------------------------------------
# This host's documents
# --------------------------------------------------------------------------------------------


def _global_order(documents, *, seed: int, shuffle: bool, num_epochs: int | None) -> grain.MapDataset:
    """Every host's documents in one global order, shuffled with a new permutation every epoch."""
    ds = grain.MapDataset.source(documents)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(num_epochs)


def _random_access(documents, *, seed: int, shuffle: bool, num_epochs: int | None, index: int, count: int):
    """The global order, every count-th document for this host."""
    return _global_order(documents, seed=seed, shuffle=shuffle, num_epochs=num_epochs)[index::count]


def host_files(component: Component, key: str, index: int, count: int, log, required: bool) -> list[str]:
    files = hosts.file_shards(component.files, index, count)
    if len(component.files) % count:
        log(f"warning: {key} {component.spec!r} has {len(component.files)} files for {count} hosts, not a multiple: "
            f"hosts read {len(component.files) // count + 1} or {len(component.files) // count} files, so some run "
            "out of data sooner (set generate_padding_batch_train / _eval so they do not stop the others)")
    if required and not files:
        raise DataError(f"{key} {component.spec!r} has {len(component.files)} files for {count} hosts, so host "
                        f"{index} has none: jsonl/parquet shard by file. Split the data into at least {count} files, "
                        "or prepare it with scripts/prepare_data.py and use dataset_type=arrayrecord (shards by document).")
    return files


def train_documents(sources: Sources, config, index: int, count: int, log=print) -> grain.IterDataset:
    """This host's training documents: shuffled, repeated num_epoch times (-1: forever), mixed by weight."""
    epochs = None if config.num_epoch == -1 else config.num_epoch
    shuffle = config.enable_data_shuffling
    weights = [c.weight for c in sources.train]
    if sources.dataset_type in RANDOM_ACCESS and len(sources.train) == 1:
        # One source: read through a layout that an elastic resume can change (elastic.py); a fresh
        # one reads exactly _random_access's documents.
        order = _global_order(sources.train[0].documents, seed=data_seed(config, "train/0"), shuffle=shuffle,
                              num_epochs=epochs)
        return elastic.HostDocuments(order, index, count, READ_OPTIONS)
    if sources.dataset_type in RANDOM_ACCESS:
        parts = [_random_access(c.documents, seed=data_seed(config, f"train/{i}"), shuffle=shuffle,
                                num_epochs=epochs, index=index, count=count) for i, c in enumerate(sources.train)]
        mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
        return mixed.to_iter_dataset(READ_OPTIONS)
    parts = []
    for i, c in enumerate(sources.train):
        if c.cache is not None:
            parts.append(_cached(sources, c, i, config, epochs, index, count, log))
            continue
        files = host_files(c, "grain_train_files", index, count, log, required=True)
        part = TextFilesIterDataset(files, _column(config, "train"), epochs, data_seed(config, f"files/{i}"), shuffle,
                                    f"grain_train_files {c.spec!r} on host {index}").map(_Encode(sources.tokenizer))
        if shuffle and config.grain_shuffle_window > 1:
            part = WindowShuffleIterDataset(part, config.grain_shuffle_window, data_seed(config, f"window/{i}"))
        parts.append(part)
    return parts[0] if len(parts) == 1 else grain.IterDataset.mix(parts, weights)


def _cached(sources: Sources, c: Component, i: int, config, epochs, index: int, count: int, log):
    """This host's documents of a cached source; starts the background builder of its unfinished units."""
    shuffle = config.enable_data_shuffling
    seed = data_seed(config, f"cache/{i}")
    owned = cache_lib.unit_order(c.cache.count, seed, shuffle, index, count)
    if not owned:
        raise DataError(f"grain_train_files {c.spec!r} makes {c.cache.count} cache shards for {count} hosts, so host "
                        f"{index} has none: each host reads whole shards. Set dataset_cache_shard_mb below "
                        f"{config.dataset_cache_shard_mb} so that there are at least {count}.")
    builder = cache_lib.Builder(c.cache, owned, sources.tokenizer, config.dataset_cache_workers, log).start()
    sources.builders.append(builder)
    return cache_lib.CachedTextIterDataset(c.cache, owned, epochs, seed, shuffle, builder)


def eval_documents(sources: Sources, config, index: int, count: int) -> grain.IterDataset:
    """This host's share of one pass over the eval data, in order (no shuffle)."""
    if sources.dataset_type in RANDOM_ACCESS:
        return grain.MapDataset.source(sources.eval_pool)[index::count].to_iter_dataset(READ_OPTIONS)
    files = [f for c in sources.eval for f in c.files]
    mine = hosts.file_shards(files, index, count)  # a host without files only pads
    return TextFilesIterDataset(mine, _column(config, "eval"), 1, 0, False, f"grain_eval_files on host {index}",
                                "eval_data_columns").map(_Encode(sources.tokenizer))


# --------------------------------------------------------------------------------------------
# Description (inspect_data)
# --------------------------------------------------------------------------------------------


def describe(sources: Sources, config, count: int) -> list[str]:
    """What each of `count` hosts reads, one line per host and source."""
    lines = []
    for split, components in (("train", sources.train), ("eval", sources.eval)):
        total = sum(c.weight for c in components)
        for i, c in enumerate(components):
            if c.documents is not None:
                n = len(c.documents)
                tokens = getattr(c.documents, "tokens", None) or sum(len(d) for d in c.documents)
                lines.append(f"{split} source {i} {c.spec!r} (weight {c.weight / total:.3f}): {len(c.files)} files, "
                             f"{n:,} documents, {tokens:,} tokens")
                for h in range(count):
                    order = "the seeded global shuffle" if split == "train" and config.enable_data_shuffling else "order"
                    lines.append(f"  host {h}: documents {h}, {h + count}, {h + 2 * count}, ... of {order} "
                                 f"({len(range(h, n, count)):,} per epoch)")
            else:
                lines.append(f"{split} source {i} {c.spec!r} (weight {c.weight / total:.3f}): {len(c.files)} files")
                for h in range(count):
                    mine = hosts.file_shards(c.files, h, count)
                    shown = ", ".join(os.path.basename(f) for f in mine[:4]) + (" ..." if len(mine) > 4 else "")
                    lines.append(f"  host {h}: {len(mine)} files: {shown or '(none)'}")
    return lines
