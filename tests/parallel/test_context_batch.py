"""A fractional per_device_batch_size through the real train command: fewer sequences than devices under context
parallelism. 3 steps of the tiny model on the embedded corpus (packed rows) on 8 simulated CPU devices with
ici_context_parallelism=8 and per_device_batch_size=0.125 (one sequence a step), and with ici_context_parallelism=4
x ici_data_parallelism=2 and per_device_batch_size=0.25 (two), log the per-step losses of a run of the same global
batch on one device (a subprocess with one CPU device, per_device_batch_size=1 or 2) within 1e-5 relative, and read
the same rows (maxtrain.inspect_data's view of the first batches, as this host reads them, is the same text).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain import inspect_data, train
from maxtrain.config import with_overrides
from processes import env_with, finish

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
INSPECT = ("--batches", str(STEPS), "--rows", "8", "--chars", "100000")
# the one-device run: train, then print its rows as inspect_data shows them
ONE_DEVICE = ("import sys; from maxtrain import inspect_data, train; "
              f"train.main(sys.argv[1:-{len(INSPECT)}]); print('=== rows', flush=True); inspect_data.main(sys.argv[1:])")
RUN = ("default_corpus_max_mb=0.3", "eval_interval=-1", "enable_checkpointing=false", "log_period=1", f"steps={STEPS}",
       "learning_rate=1e-2", "max_target_length=64")


def _args(tmp_root: str, name: str, *overrides: str) -> list[str]:
    from conftest import BASE_YML, TINY  # pylint: disable=import-outside-toplevel
    return with_overrides([BASE_YML, *TINY, f"base_output_directory={tmp_root}", f"run_name={name}"], *RUN,
                          f"metrics_file={tmp_root}/{name}.jsonl", *overrides)


def _rows(tmp_root: str, name: str) -> list[dict]:
    with open(f"{tmp_root}/{name}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if "learning/loss" in line]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return rows


def _batches(text: str) -> list[str]:
    """inspect_data's lines from the host batch's shape on: the shape, then each batch's rows as text."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("host batch"))
    return [line for line in lines[start:] if line.startswith(("host batch", "batch ", "  row "))]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The one-device runs of global batch 1 and 2, in subprocesses with one CPU device (started together)."""
    root = str(tmp_path_factory.mktemp("cp_batch"))
    procs = []
    for rows in (1, 2):
        args = _args(root, f"one{rows}", f"per_device_batch_size={rows}")
        with open(f"{root}/one{rows}.log", "w", encoding="utf-8") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", ONE_DEVICE, *args, *INSPECT], cwd=ROOT, env=env_with(1),
                                          stdout=log, stderr=subprocess.STDOUT))
    codes = finish(procs)
    assert codes == [0, 0], [Path(f"{root}/one{r}.log").read_text()[-3000:] for r in (1, 2)]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("rows, overrides", [
    (1, ("ici_context_parallelism=8", "per_device_batch_size=0.125")),
    (2, ("ici_context_parallelism=4", "ici_data_parallelism=2", "per_device_batch_size=0.25")),
])
def test_a_fractional_batch_under_context_parallelism_trains_as_the_same_batch_on_one_device(references, rows,
                                                                                           overrides, capsys):
    name = f"cp{rows}"
    result = train.main(_args(references, name, *overrides))
    assert result.config.global_batch_size == rows and result.config.micro_batch_size == rows
    assert result.config.per_device_batch_size == rows / 8
    got, want = _rows(references, name), _rows(references, f"one{rows}")
    assert [r["learning/loss"] for r in got] == pytest.approx([r["learning/loss"] for r in want], rel=1e-5)
    capsys.readouterr()
    inspect_data.main([*_args(references, name, *overrides), *INSPECT])
    read = _batches(capsys.readouterr().out)
    one = _batches(Path(f"{references}/one{rows}.log").read_text(encoding="utf-8").split("=== rows", 1)[1])
    assert read == one and sum(line.startswith("  row ") for line in read) == STEPS * rows, (read, one)
    assert len({r["learning/loss"] for r in want}) == STEPS  # the steps train: a loss that did not move compares nothing
