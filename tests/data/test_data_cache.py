"""Online cached preprocessing (maxtrain/data/cache.py): jsonl/parquet tokenized once, in the
background, while training reads the finished shards in a fixed order."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import data_helpers as h
import jax
import numpy as np
import pytest

from maxtrain import data as data_lib
from maxtrain import train
from maxtrain.data import cache as cache_lib
from maxtrain.data import tokenizer as tokenizer_lib

SHARD_MB = "dataset_cache_shard_mb=0.004"  # ~4 kB of input per shard: dozens of shards from a small corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three jsonl files of 300 tagged documents each, and a tokenizer."""
    raw = tmp_path_factory.mktemp("raw")
    docs = []
    for i in range(3):
        texts = h.texts(300, f"s{i}", seed=i)
        h.write_jsonl(str(raw / f"part{i}.jsonl"), texts)
        docs += texts
    return {"glob": str(raw / "*.jsonl"), "raw": raw, "docs": docs, "tok": h.tokenizer_path(tmp_path_factory)}


def _config(corpus, cache_dir, *extra):
    return h.config(*h.TINY_MODEL, "dataset_type=jsonl", f"grain_train_files={corpus['glob']}",
                    f"tokenizer_path={corpus['tok']}", f"dataset_cache_dir={cache_dir}", SHARD_MB,
                    "max_target_length=32", "per_device_batch_size=4", "eval_interval=-1", *extra)


def _batches(config, n, log=None):
    inputs = data_lib.make_inputs(config, log=log or (lambda *a: None))
    try:
        return [next(inputs.train_iterator) for _ in range(n)], inputs.sources.builders[0]
    finally:
        inputs.close()


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def _finish(config):
    """Runs the builder of `config`'s cache to the end; returns the cache."""
    lines = []
    inputs = data_lib.make_inputs(config, log=lines.append)
    builder = inputs.sources.builders[0]
    builder.wait()
    inputs.close()
    return builder, lines


def _drop_units(cache, units):
    """Deletes these units' shards and markers (and metadata.json): the state of an interrupted build."""
    for unit in units:
        marker = cache.marker(unit)
        os.remove(cache.marker_path(unit))
        for name in marker["shards"]:
            os.remove(os.path.join(cache.directory, name))
    if os.path.exists(os.path.join(cache.directory, "metadata.json")):
        os.remove(os.path.join(cache.directory, "metadata.json"))


def test_batches_do_not_depend_on_cache_progress_or_worker_count(corpus, tmp_path):
    n = 12
    fresh, builder = _batches(_config(corpus, tmp_path / "c1", "dataset_cache_workers=1"), n)
    assert builder.pending and len(builder.pending) == builder.cache.count  # it started from nothing

    builder, _ = _finish(_config(corpus, tmp_path / "c1", "dataset_cache_workers=1"))
    cache = builder.cache
    assert cache.finished() == list(range(cache.count)) and cache.count > 30

    log = []
    finished, builder = _batches(_config(corpus, tmp_path / "c1", "dataset_cache_workers=1"), n, log.append)
    assert builder.pending == [] and any("nothing to tokenize" in line for line in log)  # read, not re-tokenized
    assert os.path.isfile(os.path.join(cache.directory, "metadata.json"))
    _assert_same(fresh, finished)

    four, _ = _batches(_config(corpus, tmp_path / "c4", "dataset_cache_workers=4"), n)
    _assert_same(fresh, four)

    # Half the shards gone (an interrupted build): the run tokenizes them while it reads; same batches.
    _drop_units(cache, cache.finished()[::2])
    partial, builder = _batches(_config(corpus, tmp_path / "c1", "dataset_cache_workers=1"), n)
    assert 0 < len(builder.pending) < cache.count
    _assert_same(fresh, partial)

    # Building to the end shows progress, and leaves a complete prepared dataset (metadata.json). The run
    # above may have finished every shard while it read (a quiet machine), so some are taken away again.
    _drop_units(cache, cache.finished()[::3])
    builder, lines = _finish(_config(corpus, tmp_path / "c1", "dataset_cache_workers=1"))
    progress = [line for line in lines if line.startswith("dataset cache: ")]
    assert builder.pending and progress and "done in" in progress[-1] and "MB/s" in progress[-1], lines
    assert f"{len(builder.pending)}/{len(builder.pending)} shards" in progress[-1]
    assert os.path.isfile(os.path.join(cache.directory, "metadata.json"))


def test_one_epoch_reads_every_document_once(corpus, tmp_path):
    config = _config(corpus, tmp_path / "c", "num_epoch=1", "dataset_cache_workers=2", "packing=false")
    tok = tokenizer_lib.load(corpus["tok"])
    inputs = data_lib.make_inputs(config, log=lambda *a: None)
    tags = []
    try:
        for batch in inputs.train_iterator:
            tags += h.bos_documents(batch, tok)
    except data_lib.DataError as e:  # the end of the single epoch (generate_padding_batch_train=false)
        assert "ran out after" in str(e)
    finally:
        inputs.close()
    assert sorted(tags) == sorted(h.doc_tag(d) for d in corpus["docs"])


def test_another_tokenizer_or_changed_input_never_reads_the_cache(corpus, tmp_path, tmp_path_factory):
    raw = tmp_path / "raw"
    for i in range(2):
        h.write_jsonl(str(raw / f"p{i}.jsonl"), h.texts(40, f"f{i}"))
    tok = tokenizer_lib.load(corpus["tok"])
    other = tokenizer_lib.load(h.tokenizer_path(tmp_path_factory, "other", seed=1))
    files = sorted(str(p) for p in raw.iterdir())

    def cache(tokenizer, field="text"):
        return cache_lib.TextCache(str(tmp_path / "c"), files, tokenizer, field, 0.004)

    first = cache(tok)
    assert cache(tok).directory == first.directory  # same inputs, same tokenizer: the same cache
    assert cache(other).directory != first.directory
    assert cache(tok, field="body").directory != first.directory
    assert first.inputs["tokenizer_checksum"] == tok.checksum
    assert [i["path"] for i in first.inputs["inputs"]] == files and "mtime_ns" in first.inputs["inputs"][0]

    with open(files[1], "a", encoding="utf-8") as f:  # appended to: another version of the input
        f.write(json.dumps({"text": "doc f1-new: alpha beta"}) + "\n")
    assert cache(tok).directory != first.directory

    # A marker written with other settings (say, by an older maxtrain) does not count as finished.
    marker = {"unit": first.units[0], "settings": {**first.settings, "token_dtype": "uint32"}, "shards": {}}
    os.makedirs(os.path.dirname(first.marker_path(0)), exist_ok=True)
    with open(first.marker_path(0), "w", encoding="utf-8") as f:
        json.dump(marker, f)
    assert first.marker(0) is None


def test_a_bad_line_deep_in_the_data_stops_the_run_with_its_location(corpus, tmp_path):
    raw = tmp_path / "raw"
    h.write_jsonl(str(raw / "a.jsonl"), h.texts(200, "a"))
    with open(raw / "a.jsonl", "a", encoding="utf-8") as f:
        f.write("{not json\n")
    config = h.config(*h.TINY_MODEL, "dataset_type=jsonl", f"grain_train_files={raw}/*.jsonl",
                      f"tokenizer_path={corpus['tok']}", f"dataset_cache_dir={tmp_path / 'c'}",
                      "dataset_cache_shard_mb=1", "max_target_length=32", "per_device_batch_size=4",
                      "eval_interval=-1")
    inputs = data_lib.make_inputs(config, log=lambda *a: None)
    try:
        with pytest.raises(data_lib.DataError, match=r"a\.jsonl line 201: not valid JSON"):
            for _ in range(1000):
                next(inputs.train_iterator)
    finally:
        inputs.close()


def test_a_killed_tokenizing_worker_stops_the_run_instead_of_hanging(corpus, tmp_path):
    config = _config(corpus, tmp_path / "c", "dataset_cache_workers=1")
    inputs = data_lib.make_inputs(config, log=lambda *a: None)
    builder = inputs.sources.builders[0]
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (builder._executor and builder._executor._processes):  # pylint: disable=protected-access
            time.sleep(0.01)
        for process in builder._executor._processes.values():  # pylint: disable=protected-access
            os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(data_lib.DataError, match="a tokenizing worker process died"):
            for _ in range(10_000):
                next(inputs.train_iterator)
    finally:
        inputs.close()


@pytest.mark.slow  # two short training runs: ~30 s on 2 loaded cores
def test_resume_in_the_middle_of_cache_building_equals_an_uninterrupted_run(corpus, tmp_path, tiny_args, capsys):
    args = [*(a for a in tiny_args[:-2] if not a.startswith("vocab_size=")), "dataset_type=jsonl",
            f"grain_train_files={corpus['glob']}",
            f"tokenizer_path={corpus['tok']}", SHARD_MB, "vocab_size=320", "eval_interval=-1",
            "checkpoint_period=3", "learning_rate_schedule_steps=6", "dataset_cache_workers=1",
            f"dataset_cache_dir={tmp_path / 'cache'}", f"base_output_directory={tmp_path}"]
    whole = train.main([*args, "run_name=whole", "steps=6"])

    # A run stopped at its step-3 checkpoint, killed while the cache was half built.
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "3", tmp_path / "cut" / "checkpoints" / "3")
    cache = cache_lib.TextCache(str(tmp_path / "cache"), sorted(str(p) for p in corpus["raw"].iterdir()),
                                tokenizer_lib.load(corpus["tok"]), "text", 0.004)
    _drop_units(cache, cache.finished()[::2])
    capsys.readouterr()
    resumed = train.main([*args, "run_name=cut", "steps=6"])
    out = capsys.readouterr().out
    assert "Resuming from" in out and f"of this host's {cache.count} shards" in out and "tokenizing" in out
    assert int(resumed.state["step"]) == 6
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["params"]),
                 jax.device_get(whole.state["params"]))
