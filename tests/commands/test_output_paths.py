"""Every output a tool writes is checked before any work (storage.check_output, the one owner): a path under a
regular file, a directory where a file goes or the reverse, a directory that cannot be written. Each is one line
`<prog>: error: ...` naming the path and the fix, exit status 2, and nothing was compiled, read or written.
The scripts' rows are in tests/commands/test_scripts_errors.py; the commands' in tests/bad_inputs/."""

from __future__ import annotations

import os
import re
import types

import pytest

from conftest import BASE_YML, TINY
from maxtrain import errors, evaluate, storage, train, train_compile
from maxtrain.compile import executable


def test_the_owner_names_the_path_and_the_fix(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [  # (path, is_file, what the line says after the name)
        (afile / "sub" / "out.json", True, rf"cannot be created: {afile} is a file, not a directory\. Choose a path "
                                           "inside a directory"),
        (afile / "sub", False, rf"cannot be created: {afile} is a file, not a directory\. Choose a path inside a "
                                "directory"),
        (afile, False, r"is a file, not a directory; choose a directory"),
        (tmp_path, True, r"is a directory; give a file path"),
    ]
    for path, is_file, problem in cases:
        with pytest.raises(errors.PathError, match=rf"^--out {re.escape(str(path))} {problem}; or else$"):
            storage.check_output(str(path), is_file, f"--out {path}", "; or else")
    storage.check_output(str(tmp_path / "new" / "deeper"), False)  # made later: fine now
    storage.check_output(str(afile), True)  # a file replaced: fine
    storage.check_output("gs://bucket/under/afile", True)  # a bucket answers on the first write
    assert afile.read_text() == "x" and not (tmp_path / "new").exists()

    # A directory without write permission (permission bits do not stop root, so the access check is simulated).
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path))
    with pytest.raises(errors.PathError, match=rf"{tmp_path}/out.json cannot be written: no write permission on "
                                               rf"{tmp_path}\. Choose a writable path"):
        storage.check_output(str(tmp_path / "out.json"), True)


def run(prog: str, main, argv: list[str], capsys) -> str:
    """The one error line of `main` run as its command runs it (errors.run_cli): exit status 2, no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        errors.run_cli(prog, main, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and "Errno" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def test_the_commands_outputs_under_a_file_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """train_compile's compiled_trainstep_file (refused after the compile before), train's run directory and
    dataset_cache_dir, evaluate's results directory: each before anything is built or compiled."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setattr(executable, "save", lambda *a: pytest.fail("compiled and saved"))
    tiny = [BASE_YML, *TINY, f"base_output_directory={tmp_path}", "dataset_type=synthetic"]
    line = run("maxtrain.train_compile", train_compile.main, [*tiny, f"compiled_trainstep_file={afile}/step.bin"],
               capsys)
    assert f"compiled_trainstep_file='{afile}/step.bin' cannot be created: {afile} is a file, not a directory" in line
    line = run("maxtrain.train_compile", train_compile.main, [*tiny, f"compiled_trainstep_file={tmp_path}"], capsys)
    assert f"compiled_trainstep_file='{tmp_path}' is a directory; give a file path" in line

    line = run("maxtrain", train.main, [*tiny, "run_name=afile"], capsys)
    assert f"the run directory '{afile}' is a file, not a directory" in line and "choose another run_name" in line
    line = run("maxtrain", train.main, [*tiny, "run_name=r", f"dataset_cache_dir={afile}/cache"], capsys)
    assert f"dataset_cache_dir='{afile}/cache' cannot be created: {afile} is a file" in line

    line = run("maxtrain.evaluate", evaluate.main, [BASE_YML, f"base_output_directory={afile}", "eval_tasks=hellaswag",
                                                    f"load_parameters_path={tmp_path}/none"], capsys)
    assert f"base_output_directory='{afile}'" not in line  # evaluate names its own output, the results directory
    assert re.search(rf"the results directory '{afile}/[^']+' cannot be created: {afile} is a file", line), line
    assert afile.read_text() == "x" and sorted(os.listdir(tmp_path)) == ["afile"]


def test_the_default_corpus_cache_under_a_file_is_refused_before_training_a_tokenizer(tmp_path, monkeypatch):
    """Every command that reads the default corpus (train, decode, viz, evaluate, inspect_data) caches its
    tokenizer and tokens under dataset_cache_dir: refused before the tokenizer is trained."""
    from maxtrain.data import default_corpus, tokenizer_training  # pylint: disable=import-outside-toplevel

    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setattr(tokenizer_training, "train_sentencepiece", lambda *a: pytest.fail("trained a tokenizer"))
    config = types.SimpleNamespace(tokenizer_path="", default_corpus_max_mb=0.3, eval_split_fraction=0.1,
                                   cache_dir=str(afile / "cache"), vocab_size=512)
    with pytest.raises(errors.PathError, match=rf"the default corpus' cache file {afile}/cache/default-.*\.model cannot "
                                               rf"be created: {afile} is a file, not a directory.*; set "
                                               r"dataset_cache_dir"):
        default_corpus.tokenizer(config, log=lambda *a: None)
