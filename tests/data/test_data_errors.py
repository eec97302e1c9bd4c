"""Bad input: every error names the file (and line or record) and the fix, before training where it can."""

from __future__ import annotations

import os
import shutil

import data_helpers as h
import pytest

from maxtrain.data import DataError, make_inputs, prepare, prepared


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return h.tokenizer_path(tmp_path_factory)


@pytest.fixture
def corpus(tmp_path_factory, tmp_path, tok_path):
    """A fresh copy of a prepared corpus (tests damage it)."""
    source = h.prepared(tmp_path_factory, "errors_corpus", h.texts(40, "c"), tok_path, ("--eval-fraction", "0.3"))
    shutil.copytree(source, tmp_path / "data")
    return str(tmp_path / "data")


def _open(*overrides, index=0, count=1):
    return make_inputs(h.config("vocab_size=320", "eval_interval=-1", *overrides), log=lambda *_: None,
                       process_index=index, process_count=count)


def test_missing_directory_and_empty_glob(tmp_path):
    h.write_jsonl(str(tmp_path / "train.jsonl"), h.texts(3))
    with pytest.raises(DataError, match=r"'/no/such/dir/\*.arrayrecord' matches no files \(the directory /no/such/dir "
                                        r"does not exist\).*prepare_data.py"):
        _open("dataset_type=arrayrecord", "grain_train_files=/no/such/dir/*.arrayrecord")
    with pytest.raises(DataError, match=rf"grain_eval_files: .{tmp_path}/eval\*.jsonl. matches no files"):
        _open("dataset_type=jsonl", f"grain_train_files={tmp_path}/train.jsonl", f"grain_eval_files={tmp_path}/eval*.jsonl")


def _train_shards(corpus):
    return sorted(os.path.join(corpus, n) for n in os.listdir(corpus) if n.startswith("train-"))


def test_empty_shard(corpus):
    empty = os.path.join(corpus, "train-00009-of-00009.arrayrecord")
    prepared.write_shard(empty, [])
    with pytest.raises(DataError, match=f"{empty} holds no records: an empty shard. Delete it and re-run "
                                        "scripts/prepare_data.py"):
        _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord")


def test_empty_text_file(tmp_path, tok_path):
    h.write_jsonl(str(tmp_path / "a.jsonl"), h.texts(3))
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(DataError, match=f"{tmp_path / 'b.jsonl'} is empty: an empty shard"):
        _open("dataset_type=jsonl", f"grain_train_files={tmp_path}/*.jsonl", f"tokenizer_path={tok_path}")


def test_truncated_arrayrecord(corpus):
    shard = _train_shards(corpus)[0]
    with open(shard, "rb") as f:
        data = f.read()
    with open(shard, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(DataError, match=f"{shard} is truncated or corrupt.*Delete it and re-run"):
        _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord")


def test_corrupt_record_names_file_and_record(corpus):
    shard = _train_shards(corpus)[0]
    data = bytearray(open(shard, "rb").read())
    data[300:340] = b"\xff" * 40  # inside the first records' chunks, not the index at the end
    open(shard, "wb").write(bytes(data))
    docs = prepared.PreparedDocuments([shard])  # the index is intact: this passes the start-up check
    with pytest.raises(DataError, match=rf"{shard} record \d+ cannot be read .*damaged.*re-run scripts/prepare_data"):
        for i in range(len(docs)):
            docs[i]


def test_shard_left_over_from_another_preparation(corpus):
    stray = os.path.join(corpus, "train-00000-of-00099.arrayrecord")
    shutil.copy(_train_shards(corpus)[0], stray)
    with pytest.raises(DataError, match=f"{stray} is not listed in .*metadata.json.*left over"):
        _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord")


def test_glob_that_matches_the_metadata_too(corpus):
    with pytest.raises(DataError, match=r"metadata.json is not an .arrayrecord file"):
        _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/*")


def test_jsonl_line_without_the_text_field(tmp_path, tok_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"content": "where is text?"}\n')
    common = ["dataset_type=jsonl", f"grain_train_files={path}", f"tokenizer_path={tok_path}"]
    inputs = _open(*common)  # the first line is fine: the error comes when line 3 is read
    with pytest.raises(DataError, match=rf"{path} line 3: no 'text' field \(the line has: content\).*"
                                        r"train_data_columns=\[NAME\]"):
        for _ in range(50):
            next(inputs.train_iterator)
    path.write_text('{"content": "first line"}\n')
    with pytest.raises(DataError, match=rf"{path} line 1: no 'text' field"):  # at start-up
        _open(*common)
    assert next(_open(*common, "train_data_columns=[content]").train_iterator)["loss_weights"].sum() > 0


def test_invalid_utf8(tmp_path, tok_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 latin-1"}\n')
    with pytest.raises(DataError, match=rf"{path} line 2: invalid UTF-8 at byte offset 13 of the line .*iconv"):
        list(prepare.text_files.read_texts(str(path)))
    with pytest.raises(DataError, match=rf"{path} line 2: invalid UTF-8"):
        prepare.main(["--input", str(path), "--tokenizer", tok_path, "--output-dir", str(tmp_path / "out"),
                      "--workers", "1"])


def test_bad_json_and_parquet_column(tmp_path, tok_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=rf"{bad} line 2: not valid JSON"):
        list(prepare.text_files.read_texts(str(bad)))
    table = h.write_parquet(str(tmp_path / "t.parquet"), ["x", "y"], field="body")
    with pytest.raises(DataError, match=rf"{table}: no column 'text' \(columns: body, id\)"):
        _open("dataset_type=parquet", f"grain_train_files={table}", f"tokenizer_path={tok_path}")


def test_prepared_data_with_another_tokenizer(corpus, tmp_path_factory):
    other = h.tokenizer_path(tmp_path_factory, "other", seed=1)
    with pytest.raises(DataError, match=rf"the prepared data in {corpus} was tokenized with tokenizer \w+ .* but "
                                        rf"tokenizer_path='{other}' has checksum \w+. Set tokenizer_path="):
        _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord", f"tokenizer_path={other}")


def test_train_and_eval_with_different_tokenizers(corpus, tmp_path_factory):
    other = h.tokenizer_path(tmp_path_factory, "other", seed=1)
    eval_dir = h.prepared(tmp_path_factory, "other_eval", h.texts(10, "o"), other)
    with pytest.raises(DataError, match=r"train and eval inputs use different tokenizers"):
        _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord",
              f"grain_eval_files={eval_dir}/*.arrayrecord")


def test_jsonl_needs_a_tokenizer(tmp_path):
    path = h.write_jsonl(str(tmp_path / "a.jsonl"), h.texts(3))
    with pytest.raises(DataError, match="needs tokenizer_path=.*scripts/train_tokenizer.py"):
        _open("dataset_type=jsonl", f"grain_train_files={path}")


def test_running_out_of_training_data_without_padding_batches(corpus):
    inputs = _open("dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord", "num_epoch=1",
                   "max_target_length=64")
    with pytest.raises(DataError, match=r"host 0: the training data \(num_epoch=1\) ran out after \d+ batches.*"
                                        r"generate_padding_batch_train=true"):
        for _ in range(1000):
            next(inputs.train_iterator)
