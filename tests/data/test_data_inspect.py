"""python -m maxtrain.inspect_data: decoded batches with segment boundaries, and the per-host shard assignment."""

from __future__ import annotations

import data_helpers as h
import pytest

from maxtrain import inspect_data
from maxtrain.data import DataError


def test_prints_shard_assignment_and_decoded_segments(tmp_path_factory, capsys):
    tok = h.tokenizer_path(tmp_path_factory)
    corpus = h.prepared(tmp_path_factory, "inspect_corpus", h.texts(30, "i"), tok, ("--eval-fraction", "0.2"))
    inspect_data.main([h.BASE, "vocab_size=320", "dataset_type=arrayrecord",
                       f"grain_train_files={corpus}/train-*.arrayrecord", f"grain_eval_files={corpus}/eval-*",
                       "grain_packing_type=first_fit", "max_target_length=128", "per_device_batch_size=1",
                       "num_processes=2", "process_id=1", "--batches", "1", "--rows", "2", "--chars", "400"])
    out = capsys.readouterr().out
    assert "host 0: documents 0, 2, 4, ... of the seeded global shuffle" in out
    assert "host 1: documents 1, 3, 5, ... of the seeded global shuffle" in out
    assert f"tokenizer: {corpus}/tokenizer.model" in out
    assert "batch 0 of host 1:" in out
    rows = [line for line in out.splitlines() if line.strip().startswith("row ")]
    assert len(rows) == 2
    assert "⟦1 @0-" in rows[0] and "⟦2 @0-" in rows[0]  # several documents packed into the row, each marked
    assert "'doc i-" in rows[0]  # decoded back to text


def test_jsonl_assignment_is_by_file(tmp_path, tmp_path_factory, capsys):
    for i in range(3):
        h.write_jsonl(str(tmp_path / f"part{i}.jsonl"), h.texts(5, f"p{i}"))
    inspect_data.main([h.BASE, "vocab_size=320", "dataset_type=jsonl", f"grain_train_files={tmp_path}/*.jsonl",
                       f"tokenizer_path={h.tokenizer_path(tmp_path_factory)}", "eval_interval=-1", "num_processes=2",
                       "--batches", "1"])
    out = capsys.readouterr().out
    assert "host 0: 2 files: part0.jsonl, part2.jsonl" in out and "host 1: 1 files: part1.jsonl" in out


def test_refuses_train_and_eval_data_with_different_tokenizers(tmp_path_factory):
    train = h.prepared(tmp_path_factory, "inspect_corpus2", h.texts(10, "x"), h.tokenizer_path(tmp_path_factory))
    other = h.prepared(tmp_path_factory, "inspect_other", h.texts(10, "y"),
                       h.tokenizer_path(tmp_path_factory, "other", seed=1))
    with pytest.raises(DataError, match="train and eval inputs use different tokenizers"):
        inspect_data.main([h.BASE, "vocab_size=320", "dataset_type=arrayrecord", f"grain_train_files={train}/*.arrayrecord",
                           f"grain_eval_files={other}/*.arrayrecord"])


def test_a_hugging_face_tokenizer_and_one_larger_than_the_model(tmp_path_factory, capsys):
    hf = h.tokenizer_path(tmp_path_factory, kind="hf")
    corpus = h.prepared(tmp_path_factory, "inspect_hf", h.texts(12, "f"), hf)
    args = [h.BASE, "dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord", "eval_interval=-1",
            "max_target_length=64", "per_device_batch_size=1", "--batches", "1", "--rows", "1", "--chars", "400"]
    inspect_data.main([*args, "vocab_size=512"])  # fewer pieces than the model's vocabulary: fine
    out = capsys.readouterr().out
    assert f"tokenizer: {corpus}/tokenizer  huggingface" in out and "320 pieces (vocab_size 512)  bos 1  eos 2" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("row 0"))
    assert "<|begin_of_text|>doc f-" in row and "<|end_of_text|>" in row  # special tokens decode as written
    with pytest.raises(DataError, match=rf"the tokenizer {corpus}/tokenizer has 320 pieces but vocab_size=300"):
        inspect_data.main([*args, "vocab_size=300"])
