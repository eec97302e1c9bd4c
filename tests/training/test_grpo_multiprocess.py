"""GRPO's trainer over 2 JAX processes (2 CPU devices each, gloo, fsdp over all 4) with 2 Ray rollout workers on the
JAX engine, on policy: the same per-step losses as 1 process of 4 devices with 2 workers, even with one worker killed
(SIGKILL) mid-batch, and each trainer process publishes only its own shards of the weights (rollout/multihost.py).

The prompts: one file of the reference's, split row by row into two files (rows 0, 2, ... and 1, 3, ...), unshuffled,
so that process p reads row p of every step's 2 prompts and the gathered batch is the reference's. Tolerance: the
losses to a relative 1e-5, as tests/parallel/test_multiprocess.py's (cross-device sums added in another order over
gloo); the sampled tokens, rewards and completion lengths exactly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY
from maxtrain.config import with_overrides
from post_helpers import compose, conversations, grpo_args, grpo_rows, make_dataset, write_jsonl
from processes import env_with, finish, free_port, kill_a_generating_worker

try:
    import ray
except ImportError:
    ray = None

ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "maxtrain.train", "configs/base.yml", *args], cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT)


def _logged(path: Path) -> dict:
    return {m["step"]: m for m in map(json.loads, path.read_text().splitlines()) if "learning/loss" in m}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_mp")
    paths = make_dataset(str(out), n=64)
    rows = grpo_rows(conversations(64, seed=0))
    whole = write_jsonl(str(out / "prompts.jsonl"), rows)
    (out / "halves").mkdir()
    for p in range(2):
        write_jsonl(str(out / "halves" / f"part{p}.jsonl"), rows[p::2])
    common = compose(*TINY, *grpo_args(paths, str(out)), f"base_output_directory={out}", "steps=3",
                     "eval_interval=3", "learning_rate=1e-2", "enable_checkpointing=false", "num_generations=2",
                     "ici_fsdp_parallelism=-1", "enable_data_shuffling=false", "grpo_rollout_workers=2")
    # a graded reward (the untrained model answers no sum, so exact_match would give 0 and the loss only the KL term):
    # (its digits + 1) / (its length + 1), so the advantages and policy loss are not zero
    (out / "digits_reward.py").write_text(
        "def digits(prompts, completions, answers):\n"
        "    return [(sum(c.isdigit() for c in t) + 1) / (len(t) + 1) for t in completions]\n")
    common = [*common, "grpo_reward_functions=[digits_reward:digits]"]
    env = {"RAY_ADDRESS": "", "PYTHONPATH": os.pathsep.join([str(ROOT), str(out)])}
    ref = _start(with_overrides([*common, "run_name=ref", f"metrics_file={out}/ref.jsonl"], f"grain_train_files={whole}"),
                 {**env_with(4), **env}, out / "ref.log")
    codes = {"ref": finish([ref], timeout=900)}
    port = free_port()
    two = [_start(with_overrides([*common, "run_name=mp", f"metrics_file={out}/mp.jsonl"],
                                 f"grain_train_files={out}/halves/*.jsonl", f"coordinator_address=127.0.0.1:{port}",
                                 "num_processes=2", f"process_id={i}"), {**env_with(2), **env}, out / f"mp{i}.log")
           for i in range(2)]
    killed: list = []  # a rollout worker killed mid-batch: restarted, it fetches the other process's part (Parts)
    thread = kill_a_generating_worker(killed)
    codes["mp"] = finish(two, timeout=900)
    thread.join(timeout=5)
    return {"out": out, "codes": codes, "logs": {p.stem: p.read_text() for p in out.glob("*.log")}, "killed": killed}


@pytest.mark.skipif(ray is None, reason="Ray is not installed: pip install 'maxtrain[rl]'")
@pytest.mark.slow  # 3 trainer processes and 4 Ray workers on the CPUs
def test_two_trainer_processes_with_workers_train_like_one(runs):
    logs = runs["logs"]
    assert runs["codes"]["ref"] == [0], logs["ref"][-3000:]
    assert runs["codes"]["mp"] == [0, 0], logs["mp0"][-3000:] + logs["mp1"][-3000:]
    ref, two = _logged(runs["out"] / "ref.jsonl"), _logged(runs["out"] / "mp.jsonl")
    assert sorted(ref) == sorted(two) == [1, 2, 3]
    for step in ref:
        assert ref[step]["learning/grpo_reward"] > 0  # the graded reward: advantages that are not all zero
        for key in ("learning/grpo_reward", "learning/grpo_completion_length"):
            assert two[step][key] == ref[step][key], (step, key)  # the same completions
        # (step 1's loss is 0 up to rounding: its ratios are 1 and each group's advantages sum to 0; its gradient is not)
        assert two[step]["learning/loss"] == pytest.approx(ref[step]["learning/loss"], rel=LOSS_RTOL, abs=1e-6), step
        assert two[step]["learning/grad_norm"] == pytest.approx(ref[step]["learning/grad_norm"], rel=LOSS_RTOL), step
        assert two[step]["learning/grpo_staleness_max"] == 0
    # the held-out prompts (every process reads them all) answered greedily over both processes, as by one
    evals = [{m["step"]: m["eval/grpo_reward"] for m in map(json.loads, (runs["out"] / f"{name}.jsonl").read_text()
                                                             .splitlines()) if "eval/grpo_reward" in m}
             for name in ("ref", "mp")]
    assert sorted(evals[0]) == [0, 3] and evals[0] == evals[1] and evals[0][3] > 0
    assert "over 4 devices in 2 process(es)" in logs["mp0"]
    # one worker was killed with SIGKILL mid-batch: Ray restarted it, its batch was sent again, and it fetched the other
    # trainer process's part of the weights from Parts (it had lost what it was offered): the same losses as above
    assert runs["killed"], "no rollout worker was seen generating"
    assert "died" in logs["mp0"] and max(m["learning/grpo_reissued_batches"] for m in two.values()) >= 1


@pytest.mark.skipif(ray is None, reason="Ray is not installed: pip install 'maxtrain[rl]'")
@pytest.mark.slow
def test_each_trainer_process_publishes_only_its_own_shards(runs):
    """Process 0's sync is its own shards, about half the model; the two hosts' together are the whole model once (the
    reference's one host sends it all); neither holds any leaf whole."""
    assert runs["codes"]["mp"] == [0, 0]
    ref, two = _logged(runs["out"] / "ref.jsonl"), _logged(runs["out"] / "mp.jsonl")
    model = ref[1]["learning/grpo_sync_bytes"]
    assert ref[1]["learning/grpo_sync_bytes_total"] == model and ref[1]["learning/grpo_sync_hosts"] == 1
    for m in two.values():
        assert m["learning/grpo_sync_hosts"] == 2 and m["learning/grpo_sync_bytes_total"] == model
        assert 0.4 * model < m["learning/grpo_sync_bytes"] < 0.6 * model
    said = {i: re.search(r"trainer process (\d) of 2 publishes (\d+) bytes of weights per version, (\d+) of (\d+) "
                         r"leaves whole", runs["logs"][f"mp{i}"]) for i in range(2)}
    assert all(said.values()), runs["logs"]["mp1"][-3000:]
    assert int(said[0][2]) + int(said[1][2]) == model
    assert 0.4 * model < int(said[1][2]) < 0.6 * model
    assert said[0][3] == said[1][3] == "0"  # fsdp over the 4 devices splits every leaf (the norm scales too)
