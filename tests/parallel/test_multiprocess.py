"""A real multi-process run on CPU: 2 JAX processes x 2 CPU devices each, gloo collectives.

One module fixture runs `python -m maxtrain.train` as separate OS processes, exactly as a user would:
    reference   1 process  x 4 devices, steps 1-6
    two-process 2 processes x 2 devices, steps 1-3 (saves at 3 and exits), then again to step 6
                (resumes from 3), with the same global batches (dataset_type=synthetic draws every
                row from its global index, so the batch does not depend on the process count)
    disagree    2 processes started with different settings (process 1 writes to another
                base_output_directory), at the same time as the second two-process launch
and the tests assert on what they wrote. The compilation cache is shared between the two-process
launches, so the resumed run does not compile again.

Tolerance: the per-step losses of the 2-process run equal the 1-process run's to a relative
1e-5 (measured: at most 5e-7 absolute at loss ~6, i.e. ~1e-7 relative, from the different order
in which the cross-device sums are added).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxtrain.config import with_overrides
from processes import env_with, finish, free_port

ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5
TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=1", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=256", "max_target_length=32",
        "per_device_batch_size=1", "dataset_type=synthetic", "log_period=1", "learning_rate_schedule_steps=6",
        "checkpoint_period=3", "async_checkpointing=false", "max_new_tokens=0"]


def start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "maxtrain.train", "configs/base.yml", *args],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def start_processes(args: list[str], out: Path, name: str, port: int, cache: Path, per_process=None):
    procs = []
    for i in range(2):
        extra = per_process(i) if per_process else []  # replaces the same keys in args (a key given twice is refused)
        procs.append(start(with_overrides([*args, f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
                                           f"process_id={i}"], *extra), env_with(2, cache), out / f"{name}{i}.log"))
    return procs


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    cache = out / "jax_cache"
    common = [*TINY, f"base_output_directory={out}"]
    mp = [*common, "run_name=mp", f"metrics_file={out}/mp.jsonl"]
    port = free_port()

    reference = start([*common, "run_name=ref", "steps=6", f"metrics_file={out}/ref.jsonl"], env_with(4),
                      out / "ref.log")
    first = start_processes([*mp, "steps=3"], out, "first", port, cache)
    codes = {"ref": finish([reference]), "first": finish(first)}
    second = start_processes([*mp, "steps=6"], out, "second", port, cache)
    # At the same time: a 2-process run of the reference's run_name (checkpoints at 3 and 6) in
    # which process 1 looks in another, empty, output directory: both processes must refuse to start.
    disagree = start_processes([*common, "run_name=ref", "steps=9", f"metrics_file={out}/disagree.jsonl"], out,
                               "disagree", free_port(), cache,
                               per_process=lambda i: [f"base_output_directory={out / 'elsewhere'}"] if i else [])
    codes["second"], codes["disagree"] = finish(second), finish(disagree)
    logs = {p.stem: p.read_text() for p in out.glob("*.log")}
    return {"out": out, "codes": codes, "logs": logs}


@pytest.mark.slow  # these four share `runs`: 7 training processes, 70 s on 2 busy cores
def test_two_processes_train_like_one(runs):
    assert runs["codes"]["ref"] == [0], runs["logs"]["ref"][-3000:]
    assert runs["codes"]["first"] == [0, 0], runs["logs"]["first0"][-3000:] + runs["logs"]["first1"][-3000:]
    assert runs["codes"]["second"] == [0, 0], runs["logs"]["second0"][-3000:] + runs["logs"]["second1"][-3000:]
    ref = read_metrics(runs["out"] / "ref.jsonl")
    two = read_metrics(runs["out"] / "mp.jsonl")
    assert [m["step"] for m in ref] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in two] == [1, 2, 3, 4, 5, 6]  # once each: only process 0 writes
    for a, b in zip(ref, two):
        assert b["learning/loss"] == pytest.approx(a["learning/loss"], rel=LOSS_RTOL), a["step"]
        assert b["learning/grad_norm"] == pytest.approx(a["learning/grad_norm"], rel=LOSS_RTOL), a["step"]
    assert "over 4 devices in 2 process(es)" in runs["logs"]["first0"]


@pytest.mark.slow
def test_two_processes_save_stop_and_resume(runs):
    logs, run_dir = runs["logs"], runs["out"] / "mp"
    assert "Resuming from" not in logs["first0"]
    assert f"Resuming from {run_dir}/checkpoints/3" in logs["second0"]
    for step in (3, 6):
        data = sorted(os.listdir(run_dir / "checkpoints" / str(step) / "data"))
        assert "process_0-of-2.json" in data and "process_1-of-2.json" in data  # both input iterators saved


@pytest.mark.slow
def test_only_process_0_writes_metrics_tensorboard_and_metadata(runs):
    logs, run_dir = runs["logs"], runs["out"] / "mp"
    for name in ("first", "second"):
        assert "step      1" in logs[f"{name}0"] or "step      4" in logs[f"{name}0"]
        assert "| loss " not in logs[f"{name}1"] and "model:" not in logs[f"{name}1"]
    # One events file per launch: process 1 never opened a TensorBoard writer.
    assert len(glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))) == 2
    run_info = json.loads((run_dir / "metadata" / "run.json").read_text())
    assert run_info["num_processes"] == 2 and run_info["num_devices"] == 4


@pytest.mark.slow
def test_processes_started_with_different_settings_refuse_to_start(runs):
    """One agreed view: right after joining, every process compares its resolved config; all stop."""
    assert runs["codes"]["disagree"] == [2, 2]
    out = runs["out"]
    for i in range(2):
        lines = [l for l in runs["logs"][f"disagree{i}"].splitlines() if l.startswith("maxtrain: error:")]
        assert lines == [
            "maxtrain: error: the processes of this run were started with different settings: base_output_directory "
            f'(process 0: "{out}", process 1: "{out / "elsewhere"}"). Start every process with the same config file, '
            "overrides and maxtrain code (only process_id may differ). Nothing was done."], runs["logs"][f"disagree{i}"]
    ref_dir = runs["out"] / "ref"
    assert not (ref_dir / "checkpoints" / "9").exists() and not (runs["out"] / "disagree.jsonl").exists()
    assert (ref_dir / "checkpoints" / "6" / "state").is_dir()  # nothing saved was lost
    assert len(glob.glob(str(ref_dir / "tensorboard" / "events.out.tfevents.*"))) == 1  # the reference's own


def test_a_process_alone_fails_clearly_within_the_timeout(tmp_path):
    """Process 1 (and process 0) of a 2-process run, started without the other: exit 2, clear message."""
    timeout, startup_allowance = 3, 40
    args = [*TINY, f"base_output_directory={tmp_path}", "run_name=alone", "num_processes=2",
            f"distributed_initialization_timeout={timeout}"]
    procs, started = [], time.time()
    for i in range(2):
        # Different ports: each process waits for a partner that never comes.
        procs.append(start([*args, f"coordinator_address=127.0.0.1:{free_port()}", f"process_id={i}"],
                           env_with(2), tmp_path / f"alone{i}.log"))
    codes = finish(procs, timeout=timeout + startup_allowance + 30)
    elapsed = time.time() - started
    assert codes == [2, 2]
    assert elapsed < timeout + startup_allowance
    log0 = (tmp_path / "alone0.log").read_text()
    log1 = (tmp_path / "alone1.log").read_text()
    assert "process 0 started the coordinator" in log0 and "not all num_processes=2 processes joined" in log0, log0
    assert "process 1 could not reach the coordinator" in log1 and "nothing accepted a connection" in log1, log1
    assert "distributed_initialization_timeout=3s" in log0 and "distributed_initialization_timeout=3s" in log1
