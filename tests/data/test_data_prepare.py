"""scripts/prepare_data.py and scripts/train_tokenizer.py: formats, metadata, re-runs, splits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import data_helpers as h
import numpy as np
import pytest

from maxtrain.data import prepare, prepared, text_files
from maxtrain.data import tokenizer as tokenizer_lib


def _records(out_dir: str, split: str = "train") -> list[np.ndarray]:
    meta = prepared.read_metadata(out_dir)
    paths = sorted(os.path.join(out_dir, n) for n, e in meta["shards"].items() if e["split"] == split)
    docs = prepared.PreparedDocuments(paths)
    return [docs[i] for i in range(len(docs))]


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_every_format_is_prepared_into_shards_with_metadata(kind, tmp_path, tmp_path_factory):
    tok_path = h.tokenizer_path(tmp_path_factory, kind=kind)
    tok = tokenizer_lib.load(tok_path)
    raw = tmp_path / "raw"
    docs = {
        "plain.jsonl": h.texts(30, "j"),
        "packed.jsonl.gz": h.texts(20, "g"),
        "packed.jsonl.zst": h.texts(20, "z"),
        "table.parquet": h.texts(40, "p"),
        "lines.txt": h.texts(15, "l"),
    }
    h.write_jsonl(str(raw / "plain.jsonl"), docs["plain.jsonl"])
    h.write_jsonl(str(raw / "packed.jsonl.gz"), docs["packed.jsonl.gz"], compression="gzip")
    h.write_jsonl(str(raw / "packed.jsonl.zst"), docs["packed.jsonl.zst"], compression="zstd")
    h.write_parquet(str(raw / "table.parquet"), docs["table.parquet"], row_group_size=8)
    (raw / "lines.txt").write_text("\n".join(docs["lines.txt"]) + "\n\n")  # a blank line: an empty document
    out = str(tmp_path / "out")
    meta = prepare.main(["--input", str(raw / "*"), "--tokenizer", tok_path, "--output-dir", out,
                         "--txt-documents", "line", "--workers", "2", "--shard-mb", "0.002"])

    expected = [t for group in docs.values() for t in group]
    assert meta["tokenizer"]["checksum"] == tok.checksum
    # the copy of the tokenizer: a .model file, or a directory with tokenizer.json and its config files
    assert meta["tokenizer"]["file"] == {"sentencepiece": "tokenizer.model", "hf": "tokenizer"}[kind]
    assert tokenizer_lib.load(os.path.join(out, meta["tokenizer"]["file"])).checksum == tok.checksum
    assert (meta["tokenizer"]["bos_id"], meta["tokenizer"]["eos_id"]) == (tok.bos_id, tok.eos_id)
    assert meta["splits"]["train"]["documents"] == len(expected)
    assert meta["splits"]["train"]["tokens"] == sum(len(tok.encode(t)) + 2 for t in expected)
    assert meta["empty_documents_skipped"] == 1
    assert sorted(os.path.basename(s["path"]) for s in meta["sources"]) == sorted(docs)
    assert meta["splits"]["train"]["shards"] > len(docs)  # the 2 kB units split the larger files
    with open(os.path.join(out, "metadata.json")) as f:
        assert json.load(f) == meta
    records = _records(out)
    assert all(r[0] == tok.bos_id and r[-1] == tok.eos_id for r in records)
    assert sorted(tok.decode(r[1:-1]) for r in records) == sorted(expected)  # every document exactly once


def test_rerun_skips_finished_shards_and_redoes_missing_ones(tmp_path, tmp_path_factory, capsys):
    tok_path = h.tokenizer_path(tmp_path_factory)
    for i in range(3):
        h.write_jsonl(str(tmp_path / "raw" / f"{i}.jsonl"), h.texts(10, f"r{i}"))
    args = ["--input", str(tmp_path / "raw" / "*.jsonl"), "--tokenizer", tok_path, "--output-dir",
            str(tmp_path / "out"), "--workers", "1"]
    first = prepare.main(args)
    shards = sorted(first["shards"])
    times = {n: os.stat(tmp_path / "out" / n).st_mtime_ns for n in shards}
    os.remove(tmp_path / "out" / shards[1])
    capsys.readouterr()
    second = prepare.main(args)
    assert "2 already done, 1 to do" in capsys.readouterr().err
    assert second["shards"] == first["shards"]
    for name in (shards[0], shards[2]):
        assert os.stat(tmp_path / "out" / name).st_mtime_ns == times[name]  # untouched
    assert os.path.isfile(tmp_path / "out" / shards[1])


def test_eval_fraction_splits_by_document_hash(tmp_path, tmp_path_factory):
    tok = tokenizer_lib.load(h.tokenizer_path(tmp_path_factory))
    docs = h.texts(200, "e")
    h.write_jsonl(str(tmp_path / "raw.jsonl"), docs)
    meta = prepare.main(["--input", str(tmp_path / "raw.jsonl"), "--tokenizer", tok.path, "--output-dir",
                         str(tmp_path / "out"), "--eval-fraction", "0.2", "--workers", "1"])
    train = {tok.decode(r[1:-1]) for r in _records(str(tmp_path / "out"), "train")}
    evals = {tok.decode(r[1:-1]) for r in _records(str(tmp_path / "out"), "eval")}
    assert not train & evals and train | evals == set(docs)
    assert 20 <= len(evals) <= 60 and meta["splits"]["eval"]["documents"] == len(evals)
    assert evals == {t for t in docs if prepare._is_eval(t, 0.2)}  # pylint: disable=protected-access


def test_byte_ranges_read_every_line_exactly_once(tmp_path):
    docs = h.texts(300, "b")
    path = h.write_jsonl(str(tmp_path / "big.jsonl"), docs)
    units = prepare.plan_units([path], 1000, "file")
    assert len(units) > 10
    seen = [t for u in units for t in text_files.read_texts(path, byte_range=u["byte_range"])]
    assert seen == docs


def test_train_tokenizer_script_round_trips_text(tmp_path):
    docs = h.texts(300, "s")
    h.write_jsonl(str(tmp_path / "a.jsonl"), docs[:150])
    h.write_parquet(str(tmp_path / "b.parquet"), docs[150:])
    out = tmp_path / "tok.model"
    result = subprocess.run([sys.executable, os.path.join(h.REPO, "scripts", "train_tokenizer.py"), "--input",
                             str(tmp_path / "a.jsonl"), "--input", str(tmp_path / "*.parquet"), "--output", str(out),
                             "--vocab-size", "300"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    tok = tokenizer_lib.load(str(out))
    assert tok.vocab_size == 300
    text = "doc x-1: alpha  beta\n\tgamma ünïcode"
    assert tok.decode(tok.encode(text)) == text


def test_prepare_script_reports_bad_input_and_exits_2(tmp_path, tmp_path_factory):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    result = subprocess.run([sys.executable, os.path.join(h.REPO, "scripts", "prepare_data.py"), "--input",
                             str(tmp_path / "bad.jsonl"), "--tokenizer", h.tokenizer_path(tmp_path_factory),
                             "--output-dir", str(tmp_path / "out"), "--workers", "1"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert f"{tmp_path / 'bad.jsonl'} line 2: no 'text' field (the line has: body)" in result.stderr
    assert "--text-field" in result.stderr


@pytest.mark.parametrize("name", ["x.csv", "x.parquet.gz"])
def test_unknown_file_types_are_refused(name):
    with pytest.raises(ValueError, match="parquet|unknown file type"):
        text_files.file_format(name)


def test_another_tokenizer_is_refused_unless_overwrite_and_never_mixed(tmp_path, tmp_path_factory):
    first, second = h.tokenizer_path(tmp_path_factory), h.tokenizer_path(tmp_path_factory, "other", seed=1)
    assert tokenizer_lib.load(first).checksum != tokenizer_lib.load(second).checksum
    raw = h.write_jsonl(str(tmp_path / "raw.jsonl"), h.texts(30, "a"))
    out = str(tmp_path / "out")
    args = ["--input", raw, "--output-dir", out, "--workers", "1"]
    prepare.main([*args, "--tokenizer", first])
    before = {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)}
    with pytest.raises(prepare.DataError, match=f"--output-dir {out} was prepared with another tokenizer .*pass "
                                                "--overwrite"):
        prepare.main([*args, "--tokenizer", second])
    assert {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)} == before  # untouched
    with pytest.raises(prepare.DataError, match="was prepared with other settings \\(text_field: 'text' -> 'body'\\)"):
        prepare.main([*args, "--tokenizer", first, "--text-field", "body"])
    meta = prepare.main([*args, "--tokenizer", second, "--overwrite"])
    assert meta["tokenizer"]["checksum"] == tokenizer_lib.load(second).checksum
    assert sorted(n for n in os.listdir(out) if n.endswith(".arrayrecord")) == sorted(meta["shards"])
    markers = [json.load(open(os.path.join(out, ".prepare", n))) for n in os.listdir(os.path.join(out, ".prepare"))]
    assert {m["settings"]["tokenizer_checksum"] for m in markers} == {tokenizer_lib.load(second).checksum}
