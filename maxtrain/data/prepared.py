"""Prepared datasets: tokenized documents in ArrayRecord shards, described by a metadata.json.

A directory written by scripts/prepare_data.py holds

    train-00000-of-00008.arrayrecord ...   one record per document: [bos, tokens..., eos] as
    eval-00003-of-00008.arrayrecord  ...   little-endian `token_dtype` (uint16 when the vocabulary fits)
    tokenizer.model  or  tokenizer/        a copy of the tokenizer that made them (a sentencepiece model, or
                                           a directory with tokenizer.json and its config files)
    metadata.json                          tokenizer checksum, document and token counts per shard, sources

Documents are stored whole, so `max_target_length` and the packing can change without
re-tokenizing. Shards are written with group_size 1, so any record is one read away: training
shuffles globally by index. `PreparedDocuments` checks every shard against the metadata when it is
opened (before training), and names the file and record of any read that fails later.
"""

from __future__ import annotations

import json
import os

import numpy as np

from maxtrain.data.errors import DataError

METADATA = "metadata.json"
TOKENIZER = "tokenizer.model"      # the copy of a bare sentencepiece model
TOKENIZER_DIR = "tokenizer"        # the copy of any other tokenizer (metadata.json's tokenizer.file names which)
FORMAT = "maxtrain.tokenized_documents"
VERSION = 1
WRITER_OPTIONS = "group_size:1,zstd:3"  # random access: one record per chunk, each zstd-compressed
_REPREPARE = "Delete it and re-run scripts/prepare_data.py with the same arguments (it rewrites missing shards)."


def tokenizer_copy_name(tok) -> str:
    return TOKENIZER if tok.single_file else TOKENIZER_DIR


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def encode_record(tokens: list[int], dtype: str) -> bytes:
    return np.asarray(tokens, dtype="<" + np.dtype(dtype).str[1:]).tobytes()


def _array_record():
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel

    return array_record_module


def write_shard(path: str, records: list[bytes]) -> None:
    """Writes records to `path` atomically (a temporary name, then a rename)."""
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    writer = _array_record().ArrayRecordWriter(tmp, WRITER_OPTIONS)
    for record in records:
        writer.write(record)
    writer.close()
    os.replace(tmp, path)


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, METADATA)
    if not os.path.isfile(path):
        raise DataError(f"{directory} has no {METADATA}: dataset_type=arrayrecord reads directories written by "
                        "scripts/prepare_data.py. Prepare the raw text with it (or point grain_train_files at one).")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); re-run scripts/prepare_data.py for {directory}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path} is not a maxtrain prepared-data description (format {meta.get('format')!r} version "
                        f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}); re-run prepare_data.py")
    return meta


def shard_count(path: str) -> int:
    """Records in an ArrayRecord file; DataError if it cannot be opened or is truncated."""
    try:
        reader = _array_record().ArrayRecordReader(path)
    except Exception as e:  # array_record raises RuntimeError / ValueError variants
        raise DataError(f"{path} is not a readable ArrayRecord file ({e}). {_REPREPARE}") from None
    ok = reader.ok()
    count = reader.num_records() if ok else 0
    try:
        reader.close()
    except Exception:  # pylint: disable=broad-except  (closing a damaged file complains again)
        ok = False
    if not ok:
        raise DataError(f"{path} is truncated or corrupt (its index cannot be read). {_REPREPARE}")
    return count


class PreparedDocuments:
    """Random-access source over prepared shards: item i is document i as int32 [bos, ..., eos]."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self.directories = sorted({os.path.dirname(os.path.abspath(p)) for p in self.paths})
        self.metadata = {d: read_metadata(d) for d in self.directories}
        first = self.metadata[self.directories[0]]
        self.dtype = np.dtype(first["token_dtype"]).newbyteorder("<")
        self.tokenizer = first["tokenizer"]
        self.counts, self.tokens = [], 0
        for path in self.paths:
            if not path.endswith(".arrayrecord"):
                raise DataError(f"{path} is not an .arrayrecord file; match only the shards, e.g. "
                                f"{os.path.join(os.path.dirname(path), 'train-*.arrayrecord')}")
            directory = os.path.dirname(os.path.abspath(path))
            meta = self.metadata[directory]
            if meta["tokenizer"]["checksum"] != self.tokenizer["checksum"]:
                raise DataError(f"{path} was tokenized with tokenizer {meta['tokenizer']['checksum']} but "
                                f"{self.paths[0]} with {self.tokenizer['checksum']}: one dataset cannot mix "
                                "tokenizers. Prepare every source with the same tokenizer (--tokenizer).")
            count = shard_count(path)
            if count == 0:
                raise DataError(f"{path} holds no records: an empty shard. {_REPREPARE}")
            entry = meta["shards"].get(os.path.basename(path))
            if entry is None:
                raise DataError(f"{path} is not listed in {os.path.join(directory, METADATA)}: a shard left over "
                                "from an earlier preparation? Delete it, or narrow the glob in grain_train_files.")
            if entry["documents"] != count:
                raise DataError(f"{path} holds {count} records but {METADATA} says {entry['documents']}: the file is "
                                f"truncated or was replaced. {_REPREPARE}")
            self.counts.append(count)
            self.tokens += entry["tokens"]
        self.starts = np.cumsum([0] + self.counts)
        self._source = None

    def tokenizer_file(self) -> str:
        return os.path.join(self.directories[0], self.tokenizer.get("file", TOKENIZER))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _open(self):
        if self._source is None:
            import grain  # pylint: disable=import-outside-toplevel

            self._source = grain.sources.ArrayRecordDataSource(self.paths)
        return self._source

    def locate(self, index: int) -> tuple[str, int]:
        """(file, record within it) of document `index`."""
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        return self.paths[shard], index - int(self.starts[shard])

    def _decode(self, index: int, data: bytes) -> np.ndarray:
        if len(data) % self.dtype.itemsize:
            path, record = self.locate(index)
            raise DataError(f"{path} record {record}: {len(data)} bytes is not a whole number of {self.dtype.name} "
                            f"tokens; the file is corrupt. {_REPREPARE}")
        return np.frombuffer(data, self.dtype).astype(np.int32)

    def __getitem__(self, index: int) -> np.ndarray:
        try:
            data = self._open()[index]
        except DataError:
            raise
        except Exception as e:  # a damaged chunk: riegeli reports a hash mismatch
            path, record = self.locate(index)
            raise DataError(f"{path} record {record} cannot be read ({e}). The file is damaged. {_REPREPARE}") from None
        return self._decode(index, data)

    def __getstate__(self):  # grain worker processes reopen the files themselves
        return {**self.__dict__, "_source": None}
