"""Image conversations in a real two-process run (2 JAX processes x 1 CPU device, gloo), against one process with
2 devices: the same global batches give the same losses, because each row's images are laid out in its own slot
(data/image_layout.py) and the model gives row r's placeholders row r's features (models/image_batch.py).

The records are copies of one conversation in two files: each process reads its own file (jsonl shards by file),
one process reads both, and every packed row is the same either way, so the global batches agree. Each host holds
two rows (per_device_batch_size=2) whose slots are padded (2 images of 24 patches in 64): the old flat layout would
have put host 0's padding between host 0's and host 1's images, and host 1's placeholders would have read it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY
from post_helpers import compose
from processes import env_with, finish, free_port
import image_chat_helpers as helpers

pytest.importorskip("PIL.Image")
ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "maxtrain.train", "configs/base.yml", *compose(*args)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["learning/loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow  # three training processes, each compiling the tiny tower and decoder (~2 min on 2 busy cores)
def test_two_processes_train_on_image_conversations_as_one(tmp_path):
    data = helpers.make_dataset(str(tmp_path), n=1)
    for name in ("train-0.jsonl", "train-1.jsonl"):
        helpers.write_jsonl(str(tmp_path / name), data["records"] * 24)
    paths = {**data, "train": str(tmp_path / "train-*.jsonl")}
    args = [*TINY, *helpers.model_args(paths), f"base_output_directory={tmp_path}", "per_device_batch_size=2",
            "steps=3", "log_period=1", "enable_data_shuffling=false", "async_checkpointing=false",
            "checkpoint_period=100"]
    reference = _start([*args, "run_name=one", f"metrics_file={tmp_path}/one.jsonl"], env_with(2), tmp_path / "one.log")
    assert finish([reference], timeout=400) == [0], (tmp_path / "one.log").read_text()[-3000:]
    port = free_port()
    two = [*args, "run_name=two", f"metrics_file={tmp_path}/two.jsonl", f"coordinator_address=127.0.0.1:{port}",
           "num_processes=2"]
    procs = [_start([*two, f"process_id={i}"], env_with(1), tmp_path / f"two{i}.log") for i in range(2)]
    logs = lambda: "".join((tmp_path / f"two{i}.log").read_text()[-3000:] for i in range(2))  # noqa: E731
    assert finish(procs, timeout=400) == [0, 0], logs()
    one, two = _losses(tmp_path / "one.jsonl"), _losses(tmp_path / "two.jsonl")
    assert len(one) == len(two) == 3 and "in 2 process(es)" in logs()
    assert two == pytest.approx(one, rel=1e-5)
