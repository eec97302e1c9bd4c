"""The embedded default corpus: the Python standard library's own source files.

Every fresh machine with Python has them, so `python -m maxtrain.train configs/base.yml` trains on
real text without a download. Files are read in sorted order of their path relative to the
standard library root (tests and site-packages excluded), up to `max_mb` megabytes; each file is
one document. Which documents are held out for eval depends only on the file's relative path, so
the split is stable however many megabytes are read (reading goes on past `max_mb` until both
splits have a document). `documents(config)` trains (or loads) the
tokenizer and tokenizes the corpus once, caching both under `dataset_cache_dir`; `tokenizer(config)`
is the tokenizer alone (decode, evaluate and export need no tokenized corpus).
"""

from __future__ import annotations

import hashlib
import io
import os
import sysconfig

import numpy as np

from maxtrain import storage
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data import tokenizer_training

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "turtledemo"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _source_files(root: str) -> list[str]:
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def _is_eval(relpath: str, eval_fraction: float) -> bool:
    digest = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "little")
    return digest / 2**64 < eval_fraction


def load_documents(max_mb: float, eval_fraction: float) -> tuple[list[str], list[str], str]:
    """(train documents, eval documents, fingerprint of the exact corpus read)."""
    root = stdlib_root()
    train, evals, fingerprint = [], [], hashlib.sha256()
    total = 0
    for path in _source_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if not text.strip():
            continue
        rel = os.path.relpath(path, root)
        (evals if _is_eval(rel, eval_fraction) else train).append(text)
        fingerprint.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
        total += len(text.encode())
        if total >= max_mb * 1e6 and train and evals:  # read on until both splits have a document
            break
    if not train or not evals:
        raise RuntimeError(f"the standard library at {root} gave {len(train)} train and {len(evals)} eval documents; "
                           "raise default_corpus_max_mb or set dataset_type to your own data")
    return train, evals, fingerprint.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Tokenized and cached
# --------------------------------------------------------------------------------------------


def _atomic_write(path: str, write) -> None:
    """Writes the whole file at once (local: temporary file and rename; gs://: one object), so
    concurrent processes never see half a file."""
    buffer = io.BytesIO()
    write(buffer)
    storage.write_bytes(path, buffer.getvalue())


def _load_tokenizer(path: str):
    if not storage.is_remote(path):
        return tokenizer_lib.load(path)
    return tokenizer_lib.from_files({tokenizer_lib.SP_MODEL: storage.read_bytes(path)}, path)


def _encode_documents(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each document as int32 [BOS, tokens..., EOS]."""
    return [np.asarray(tokenizer_lib.document(tokenizer, ids), np.int32) for ids in tokenizer.encode_batch(texts)]


def _save_docs(f, docs: list[np.ndarray]) -> None:
    lengths = np.asarray([len(d) for d in docs], np.int64)
    np.savez(f, tokens=np.concatenate(docs) if docs else np.zeros(0, np.int32), lengths=lengths)


def _load_docs(path: str) -> list[np.ndarray]:
    with np.load(io.BytesIO(storage.read_bytes(path))) as data:
        tokens, lengths = data["tokens"], data["lengths"]
    return np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []


def tokenizer_file(config, fingerprint: str) -> str:
    """Where the corpus' trained tokenizer is cached: one sentencepiece .model per corpus and vocab_size."""
    return os.path.join(config.cache_dir, f"default-{fingerprint}-v{config.vocab_size}.model")


def _check_cache_file(path: str) -> None:
    """Refuses, before the training or tokenizing it would keep, a cache file that could not be written."""
    storage.check_output(path, True, f"the default corpus' cache file {path}",
                         "; set dataset_cache_dir (default: <base_output_directory>/cache) to a writable directory")


def tokenizer(config, log=print, corpus: tuple[list[str], str] | None = None):
    """The tokenizer a default-corpus run uses: tokenizer_path, else the one trained on the corpus (read from
    config.cache_dir; trained and cached there when missing). `corpus`: (train texts, fingerprint), when read."""
    if config.tokenizer_path:
        tok = tokenizer_lib.load(config.tokenizer_path)
    else:
        if corpus is None:
            train_texts, _, fingerprint = load_documents(config.default_corpus_max_mb, config.eval_split_fraction)
        else:
            train_texts, fingerprint = corpus
        path = tokenizer_file(config, fingerprint)
        if not storage.isfile(path):
            _check_cache_file(path)
            log(f"Training a {config.vocab_size}-piece tokenizer on the default corpus -> {path}")
            trained = tokenizer_training.train_sentencepiece(train_texts, config.vocab_size)
            _atomic_write(path, lambda f: f.write(trained.files[tokenizer_lib.SP_MODEL]))
        tok = _load_tokenizer(path)
    tokenizer_lib.check_vocab(tok, config.vocab_size)
    return tok


def documents(config, log=print):
    """(tokenizer, train docs, eval docs) for the embedded corpus; trains and caches as needed."""
    tok = tokenizer(config, log) if config.tokenizer_path else None  # checked before the corpus is read
    train_texts, eval_texts, fingerprint = load_documents(config.default_corpus_max_mb, config.eval_split_fraction)
    if tok is None:
        tok = tokenizer(config, log, corpus=(train_texts, fingerprint))
    tokenizer_lib.warn_if_no_eos(tok, log)

    docs = {}
    for split, texts in (("train", train_texts), ("eval", eval_texts)):
        path = os.path.join(config.cache_dir, f"default-{fingerprint}-{tok.checksum}-{split}.npz")
        if not storage.isfile(path):
            _check_cache_file(path)
            log(f"Tokenizing the default corpus ({split}: {len(texts)} documents) -> {path}")
            encoded = _encode_documents(tok, texts)
            _atomic_write(path, lambda f, encoded=encoded: _save_docs(f, encoded))
        docs[split] = _load_docs(path)
    return tok, docs["train"], docs["eval"]
