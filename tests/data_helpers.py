"""Tiny corpora for the data tests, written to a temporary directory.

Every document starts with a tag "doc <source>-<n>:" so that a test can tell, from decoded text,
which document (and which source) a row came from.
"""

from __future__ import annotations

import gzip
import json
import os
import random

import numpy as np

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud tree "
         "north south east west light dark quick slow bright quiet loud small large red green blue").split()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")
TINY_MODEL = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=1", "base_mlp_dim=64",
              "base_num_decoder_layers=2", "head_dim=16", "vocab_size=320"]
_cache: dict = {}


def texts(n: int, source: str = "a", seed: int = 0, min_words: int = 4, max_words: int = 40) -> list[str]:
    rng = random.Random(f"{source}/{seed}")
    return [f"doc {source}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for i in range(n)]


def doc_tag(text: str) -> str | None:
    """'a-17' from a decoded piece that starts a document ("doc a-17: ...")."""
    if not text.startswith("doc "):
        return None
    return text[4:].split(":", 1)[0]


def write_jsonl(path: str, docs: list[str], field: str = "text", compression: str | None = None) -> str:
    body = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(docs)).encode()
    if compression == "gzip":
        body = gzip.compress(body)
    elif compression == "zstd":
        import zstandard  # pylint: disable=import-outside-toplevel

        body = zstandard.ZstdCompressor().compress(body)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(body)
    return path


def write_parquet(path: str, docs: list[str], field: str = "text", row_group_size: int = 16) -> str:
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path, row_group_size=row_group_size)
    return path


def tokenizer_path(tmp_path_factory, name: str = "tok", seed: int = 0, kind: str = "sentencepiece") -> str:
    """A 320-piece tokenizer trained on the test words (cached for the session): a sentencepiece .model,
    or (kind="hf") a directory with a byte-level BPE tokenizer.json and its config files."""
    key = ("tokenizer", name, seed, kind)
    if key not in _cache:
        from maxtrain.data import tokenizer_training  # pylint: disable=import-outside-toplevel

        directory = tmp_path_factory.mktemp(name)
        corpus = texts(400, "t", seed) + texts(50, "u", seed + 1)
        if seed:  # a different tokenizer: other text, so other merges
            corpus = [t.upper() + " " + t[::-1] for t in corpus]
        path = str(directory / (f"{name}.model" if kind == "sentencepiece" else name))
        tokenizer_training.train(kind, corpus, 320).write(path)
        _cache[key] = path
    return _cache[key]


def prepared(tmp_path_factory, name: str, docs: list[str], tok: str, extra: tuple = (), files: int = 2) -> str:
    """A prepared dataset directory from `docs` split over `files` jsonl inputs (cached)."""
    key = ("prepared", name, tok, extra)
    if key not in _cache:
        from maxtrain.data import prepare  # pylint: disable=import-outside-toplevel

        directory = tmp_path_factory.mktemp(name)
        raw = directory / "raw"
        for i in range(files):
            write_jsonl(str(raw / f"part{i}.jsonl"), docs[i::files])
        prepare.main(["--input", str(raw / "*.jsonl"), "--tokenizer", tok, "--output-dir", str(directory / "out"),
                      "--workers", "1", *extra])
        _cache[key] = str(directory / "out")
    return _cache[key]


def config(*overrides: str, devices: int = 1, processes: int = 1):
    from maxtrain import config as config_lib  # pylint: disable=import-outside-toplevel

    argv = [BASE]
    for override in overrides:  # a later override replaces an earlier one of the same key
        argv = config_lib.with_overrides(argv, override)
    return config_lib.with_devices(config_lib.load_config(argv), devices, processes)


def decode_segments(batch: dict, tok) -> list[str]:
    """Decoded text of every packed segment (by segment id and restart of positions) of every row."""
    out = []
    inputs = batch["inputs"].reshape(-1, batch["inputs"].shape[-1])
    seg = batch["segment_ids"].reshape(inputs.shape)
    pos = batch["positions"].reshape(inputs.shape)
    for row, s, p in zip(inputs, seg, pos):
        start = 0
        for end in range(1, len(row) + 1):
            if end == len(row) or s[end] != s[start] or p[end] == 0:
                if s[start] != 0:
                    out.append(tok.decode(row[start:end]))
                start = end
    return out


def bos_documents(batch: dict, tok) -> list[str]:
    """Tags of the documents that start (with BOS at position 0) in a batch."""
    tags = []
    inputs = batch["inputs"].reshape(-1, batch["inputs"].shape[-1])
    seg = batch["segment_ids"].reshape(inputs.shape)
    pos = batch["positions"].reshape(inputs.shape)
    for row, s, p in zip(inputs, seg, pos):
        starts = np.flatnonzero((p == 0) & (s != 0) & (row == tok.bos_id))
        for start in starts:
            end = start + 1
            while end < len(row) and s[end] == s[start] and p[end] != 0:
                end += 1
            tags.append(doc_tag(tok.decode(row[start + 1:end])))
    return tags
