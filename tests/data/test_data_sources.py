"""Sources: mixtures, global shuffle per epoch, file sharding, window shuffle, exact resume of every source."""

from __future__ import annotations

import collections
import itertools
import json

import data_helpers as h
import jax
import numpy as np
import pytest

from maxtrain.data import DataError, make_inputs, sources
from maxtrain.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return h.tokenizer_path(tmp_path_factory)


@pytest.fixture(scope="module")
def corpus_a(tmp_path_factory, tok_path):
    return h.prepared(tmp_path_factory, "corpus_a", h.texts(60, "a"), tok_path)


@pytest.fixture(scope="module")
def corpus_b(tmp_path_factory, tok_path):
    return h.prepared(tmp_path_factory, "corpus_b", h.texts(45, "b"), tok_path)


def _tags(docs, tok, n):
    return [h.doc_tag(tok.decode(d[1:-1])) for d in itertools.islice(docs, n)]


def _documents(cfg, index=0, count=1, log=print):
    opened = sources.open_sources(cfg)
    return opened.tokenizer, iter(sources.train_documents(opened, cfg, index, count, log))


def test_observed_mixture_matches_the_weights(corpus_a, corpus_b):
    cfg = h.config("dataset_type=arrayrecord", f"grain_train_files={corpus_a}/train-*:0.7;{corpus_b}/*.arrayrecord:0.3",
                   "eval_interval=-1", "vocab_size=320")
    tok, docs = _documents(cfg)
    tags = _tags(docs, tok, 1000)  # many epochs of both sources
    share = collections.Counter(t[0] for t in tags)
    assert share["a"] / 1000 == pytest.approx(0.7, abs=0.01) and share["b"] / 1000 == pytest.approx(0.3, abs=0.01)
    # in every stretch, not only on average: each window of 100 documents holds 70 +- 2 of source a
    for start in range(0, 1000, 100):
        assert abs(sum(t[0] == "a" for t in tags[start:start + 100]) - 70) <= 2


def test_global_shuffle_covers_every_document_once_per_epoch_in_a_new_order(corpus_a):
    cfg = h.config("dataset_type=arrayrecord", f"grain_train_files={corpus_a}/train-*", "eval_interval=-1",
                   "vocab_size=320")
    tok, docs = _documents(cfg)
    tags = _tags(docs, tok, 180)
    epochs = [tags[0:60], tags[60:120], tags[120:180]]
    assert all(sorted(e) == sorted(f"a-{i}" for i in range(60)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != sorted(epochs[0])
    again = _tags(_documents(cfg)[1], tok, 60)
    assert again == epochs[0]  # the same seed, the same order
    other = h.config("dataset_type=arrayrecord", f"grain_train_files={corpus_a}/train-*", "eval_interval=-1",
                     "vocab_size=320", "seed=1")
    assert _tags(_documents(other)[1], tok, 60) != epochs[0]


def test_a_hugging_face_tokenizer_feeds_prepared_and_raw_sources(tmp_path, tmp_path_factory):
    hf = h.tokenizer_path(tmp_path_factory, kind="hf")
    tok = tokenizer_lib.load(hf)
    docs = h.texts(30, "q")
    corpus = h.prepared(tmp_path_factory, "hf_corpus", docs, hf)
    h.write_jsonl(str(tmp_path / "raw.jsonl"), docs)
    for overrides in (["dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*"],  # the data's own copy
                      ["dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*", f"tokenizer_path={hf}"],
                      ["dataset_type=jsonl", f"grain_train_files={tmp_path}/raw.jsonl", f"tokenizer_path={hf}"]):
        opened, documents = _documents(h.config(*overrides, "eval_interval=-1", "vocab_size=320", "num_epoch=1"))
        assert opened.kind == "huggingface" and opened.checksum == tok.checksum
        epoch = list(documents)
        assert all(d[0] == tok.bos_id and d[-1] == tok.eos_id for d in epoch)
        assert sorted(tok.decode(d[1:-1]) for d in epoch) == sorted(docs)
    other = h.tokenizer_path(tmp_path_factory, "other", seed=1)
    with pytest.raises(DataError, match=rf"was tokenized with tokenizer {tok.checksum} .* Set "
                                        rf"tokenizer_path={corpus}/tokenizer \(or leave it empty"):
        _documents(h.config("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*", "vocab_size=320",
                            f"tokenizer_path={other}"))


def test_jsonl_shards_by_file_warns_when_uneven_and_shuffles_in_windows(tmp_path, tok_path):
    for i in range(3):
        h.write_jsonl(str(tmp_path / f"f{i}.jsonl"), h.texts(20, f"f{i}"))
    common = ["dataset_type=jsonl", f"grain_train_files={tmp_path}/*.jsonl", f"tokenizer_path={tok_path}",
              "eval_interval=-1", "vocab_size=320", "num_epoch=1"]
    tok = tokenizer_lib.load(tok_path)
    seen, logs = [], []
    for host in range(2):
        _, docs = _documents(h.config(*common, "grain_shuffle_window=8"), host, 2, logs.append)
        seen.append(_tags(docs, tok, 1000))
    assert any("3 files for 2 hosts, not a multiple" in m for m in logs)
    files = [{t.split("-")[0] for t in s} for s in seen]
    assert files == [{"f0", "f2"}, {"f1"}]  # host i reads files i, i + 2, ...
    assert sorted(seen[0] + seen[1]) == sorted(f"f{i}-{j}" for i in range(3) for j in range(20))
    assert seen[1] != [f"f1-{j}" for j in range(20)]  # shuffled ...
    window_of = {f"f1-{j}": j // 8 for j in range(20)}
    assert [window_of[t] for t in seen[1]] == sorted(window_of[t] for t in seen[1])  # ... within windows of 8
    _, unshuffled = _documents(h.config(*common, "enable_data_shuffling=false"), 1, 2)
    assert _tags(unshuffled, tok, 1000) == [f"f1-{j}" for j in range(20)]


def test_too_few_files_for_the_hosts_is_an_error(tmp_path, tok_path):
    h.write_jsonl(str(tmp_path / "only.jsonl"), h.texts(5))
    cfg = h.config("dataset_type=jsonl", f"grain_train_files={tmp_path}/*.jsonl", f"tokenizer_path={tok_path}",
                   "eval_interval=-1", "vocab_size=320")
    with pytest.raises(ValueError, match="has 1 files for 2 hosts, so host 1 has none.*dataset_type=arrayrecord"):
        make_inputs(cfg, process_index=1, process_count=2)


def _resumes_exactly(cfg, consumed: int = 7, compare: int = 5) -> None:
    """The iterator restored from a JSON round trip of its state continues exactly like the original."""
    it = make_inputs(cfg).train_iterator
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(compare)]
    resumed = make_inputs(cfg).train_iterator
    resumed.set_state(state)
    for i, want in enumerate(expected):
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in want), f"batch {i} after restoring {state}"


@pytest.mark.parametrize("packing", ["packing=false", "grain_packing_type=first_fit",
                                     "grain_packing_type=concat_then_split"])
def test_arrayrecord_mixture_resumes_exactly(corpus_a, corpus_b, packing):
    _resumes_exactly(h.config("dataset_type=arrayrecord", f"grain_train_files={corpus_a}/*.arrayrecord:2;{corpus_b}/train*:1",
                              "eval_interval=-1", "vocab_size=320", "max_target_length=24", "per_device_batch_size=3",
                              packing))


@pytest.mark.parametrize("packing", ["concat_then_split", "first_fit"])
def test_padding_after_the_last_epoch_resumes_exactly(corpus_a, packing):
    cfg = h.config("dataset_type=arrayrecord", f"grain_train_files={corpus_a}/*.arrayrecord", "eval_interval=-1",
                   "vocab_size=320", "max_target_length=24", "per_device_batch_size=1", "num_epoch=1",
                   "generate_padding_batch_train=true", f"grain_packing_type={packing}")
    batches = list(itertools.islice(make_inputs(cfg, log=lambda *_: None).train_iterator, 80))
    real = [b for b in batches if b["loss_weights"].any()]
    assert 10 < len(real) < 70 and all(not b["loss_weights"].any() for b in batches[len(real):])
    _resumes_exactly(cfg, consumed=len(real) - 1)  # across the end of the data
    _resumes_exactly(cfg, consumed=len(real) + 3)  # inside the padding


def test_grain_worker_processes_resume_exactly(corpus_a):
    _resumes_exactly(h.config("dataset_type=arrayrecord", f"grain_train_files={corpus_a}/*.arrayrecord",
                              "eval_interval=-1", "vocab_size=320", "max_target_length=24", "grain_worker_count=1"))


@pytest.mark.slow  # 35 s on 2 busy cores: Grain worker processes, each importing transformers' tokenizer
def test_grain_worker_processes_tokenize_with_a_hugging_face_tokenizer(tmp_path, tmp_path_factory):
    """jsonl is tokenized in the Grain worker, which receives the tokenizer pickled (as its files' bytes)."""
    hf = h.tokenizer_path(tmp_path_factory, kind="hf")
    for name in ("w", "v"):
        h.write_jsonl(str(tmp_path / f"{name}.jsonl"), h.texts(20, name))
    cfg = h.config("dataset_type=jsonl", f"grain_train_files={tmp_path}/*.jsonl", f"tokenizer_path={hf}",
                   "eval_interval=-1", "vocab_size=320", "max_target_length=40", "grain_worker_count=1")
    inputs = make_inputs(cfg, log=lambda *_: None)
    tags = [t for _ in range(3) for t in h.bos_documents(next(inputs.train_iterator), inputs.tokenizer)
            if t and "-" in t]  # not a document cut by the row's end within its tag
    assert len(tags) > 5 and {t.split("-")[0] for t in tags} == {"w", "v"}
    _resumes_exactly(cfg)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_sequential_sources_resume_exactly_mid_file_and_across_epochs(tmp_path, tok_path, kind):
    for i in range(2):
        docs = h.texts(25, f"{kind}{i}")
        if kind == "jsonl":
            h.write_jsonl(str(tmp_path / f"{i}.jsonl.gz"), docs, compression="gzip")
        else:
            h.write_parquet(str(tmp_path / f"{i}.parquet"), docs, row_group_size=4)
    cfg = h.config(f"dataset_type={kind}", f"grain_train_files={tmp_path}/*", f"tokenizer_path={tok_path}",
                   "eval_interval=-1", "vocab_size=320", "max_target_length=40", "per_device_batch_size=2",
                   "grain_shuffle_window=4")
    _resumes_exactly(cfg, consumed=1)    # mid-file, mid-window (a batch is 16 x 40 tokens, ~6 documents)
    _resumes_exactly(cfg, consumed=70)   # after more than one epoch (the 2 files hold ~5,000 tokens)


def test_default_corpus_still_trains_and_evaluates(tmp_path):
    cfg = h.config("dataset_cache_dir=" + str(tmp_path), "default_corpus_max_mb=1", "vocab_size=512",
                   "max_target_length=64", "per_device_batch_size=2", "eval_steps=3")
    inputs = make_inputs(cfg, log=lambda *_: None)
    batch = next(inputs.train_iterator)
    assert batch["inputs"].shape == (1, 2 * jax.local_device_count(), 64) and batch["loss_weights"].sum() > 100
    assert len(inputs.eval_batches) == 3
    assert "def " in "".join(h.decode_segments(batch, inputs.tokenizer)) or "import" in "".join(
        h.decode_segments(batch, inputs.tokenizer))
