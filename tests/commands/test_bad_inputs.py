"""The bad-input table (tests/bad_inputs/): every row gets its one clear line, no traceback, and
leaves the existing run and data untouched.

The commands' rows run in this process through each command's own CLI wrapper (errors.run_cli, which is all
their `__main__` blocks do), so the table stays fast; the scripts' rows run as the real commands they are, all in
one child process (tests/command_child.py; no script is loaded here); one row per tool also runs as a real command
of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import bad_inputs
from bad_inputs import ROWS, TOOLS, Row, argv_for, build_world, judge, run_subprocess, tree_hash
from maxtrain.errors import run_cli


def _in_process():
    from maxtrain import decode, inspect_checkpoint, inspect_data, train, viz  # pylint: disable=import-outside-toplevel
    from maxtrain.data import prepare  # pylint: disable=import-outside-toplevel

    return {"train": train.main, "decode": decode.main, "viz": viz.main, "inspect_data": inspect_data.main,
            "inspect": inspect_checkpoint.main, "prepare_data": prepare.main}


def _is_script(row: Row) -> bool:
    return TOOLS[row.tool][1][0].endswith(".py") and row.tool not in _IN_PROCESS


_IN_PROCESS = ("prepare_data",)  # scripts/prepare_data.py is a main of the package: data/prepare.py


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(str(tmp_path_factory.mktemp("bad_inputs_world")), log=lambda *_: None)


@pytest.fixture(scope="module")
def mains():
    return _in_process()


def test_the_table_is_large_and_covers_every_tool():
    assert len(ROWS) >= 100 and len({r.id for r in ROWS}) == len(ROWS)
    assert {r.tool for r in ROWS} == set(TOOLS)


@pytest.fixture(scope="module")
def script_answers(world, tmp_path_factory) -> dict:
    """The scripts' rows as real commands, all in one child process: {row id: (exit status, stdout, stderr)}; the
    existing run and data are checked unchanged after them all."""
    rows = [r for r in ROWS if _is_script(r)]
    runs = []
    for row in rows:
        scratch = str(tmp_path_factory.mktemp(row.id))
        if row.setup:
            row.setup(world, scratch)
        runs.append({"argv": [*TOOLS[row.tool][1], *argv_for(row, world, scratch)]})
    before = tree_hash(world.root)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": bad_inputs.REPO}
    done = subprocess.run([sys.executable, os.path.join(bad_inputs.REPO, "tests", "command_child.py"),
                           bad_inputs.REPO], input=json.dumps(runs), env=env, cwd=bad_inputs.REPO,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert tree_hash(world.root) == before, "a script's row changed files of the existing run or data"
    answers = json.loads(done.stdout.splitlines()[-1])
    return {row.id: (a["returncode"], a["stdout"], a["stderr"]) for row, a in zip(rows, answers)}


@pytest.mark.slow  # builds the world (a tokenizer, a prepared directory, a 4-step run), then ~120 rows
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row(row: Row, world, mains, tmp_path, capsys, request):
    if _is_script(row):
        code, out, err = request.getfixturevalue("script_answers")[row.id]
        verdict, line = judge(row, code, out, err)
        assert verdict == "clear", f"{row.id}: {verdict} (exit {code}): {line}\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-2000:]}"
        return
    scratch = str(tmp_path)
    if row.setup:
        row.setup(world, scratch)
    before = tree_hash(world.root)
    capsys.readouterr()
    try:
        run_cli(TOOLS[row.tool][0], mains[row.tool], argv_for(row, world, scratch))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    verdict, line = judge(row, code, out, err)
    assert verdict == "clear", f"{row.id}: {verdict} (exit {code}): {line}\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-2000:]}"
    assert tree_hash(world.root) == before, f"{row.id} changed files of the existing run or data"


# One row per tool as the real command a user types (`python -m ...`, `python scripts/...`).
REAL = ["unknown-key", "decode-no-checkpoint", "viz-no-checkpoint", "inspect-data-unknown-key", "inspect-bit-flipped",
        "prepare-other-tokenizer", "tokenizer-vocab-below-characters", "convert-config-malformed"]


@pytest.mark.slow
@pytest.mark.parametrize("row_id", REAL)
def test_row_as_a_real_command(row_id, world, tmp_path):
    row = next(r for r in ROWS if r.id == row_id)
    scratch = str(tmp_path)
    if row.setup:
        row.setup(world, scratch)
    before = tree_hash(world.root)
    code, out, err = run_subprocess(row, world, scratch, bad_inputs.sys.executable, bad_inputs.REPO)
    verdict, line = judge(row, code, out, err)
    assert verdict == "clear", f"{row.id}: {verdict} (exit {code}): {line}\n{err[-2000:]}"
    assert tree_hash(world.root) == before
