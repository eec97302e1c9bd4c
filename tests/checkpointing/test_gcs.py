"""gs:// for real, against a local GCS emulator that these tests start (tests/gcs_emulator.py): data
globs, the dataset cache, checkpoints (kill -9, resume bitwise), metrics file, TensorBoard, viz."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import data_helpers as h
import jax
import numpy as np
import pytest
from conftest import BASE_YML, TINY

from maxtrain import data as data_lib
from maxtrain.observability import metrics
from maxtrain import storage, train

BUCKET = "maxtrain-test"


def _reset_clients():
    storage._gcs.cache_clear()  # pylint: disable=protected-access
    try:
        import gcsfs  # pylint: disable=import-outside-toplevel

        gcsfs.GCSFileSystem.clear_instance_cache()
    except ImportError:
        pass


@pytest.fixture(scope="module")
def gcs():
    import gcs_emulator  # pylint: disable=import-outside-toplevel

    try:
        context = gcs_emulator.emulator(BUCKET)
        url = context.__enter__()  # pylint: disable=unnecessary-dunder-call
    except gcs_emulator.Unavailable as e:
        pytest.skip(f"no GCS emulator: {e}")
    _reset_clients()
    yield f"gs://{BUCKET}"
    # tensorboardX's GCS record writers upload their file again when collected (their __del__ calls
    # close); once the emulator is gone, that retries for 120 s at interpreter exit. Closed already by
    # the runs, they are told not to.
    gc.collect()
    for obj in gc.get_objects():
        if type(obj).__name__ == "GCSRecordWriter":
            obj.close = lambda: None
    context.__exit__(None, None, None)
    _reset_clients()
    del url


@pytest.fixture(scope="module")
def corpus(gcs, tmp_path_factory):
    """Three jsonl files on local disk and the same files on gs://."""
    raw = tmp_path_factory.mktemp("raw")
    for i in range(3):
        path = h.write_jsonl(str(raw / f"part{i}.jsonl"), h.texts(200, f"g{i}", seed=i))
        storage.upload(path, f"{gcs}/raw/part{i}.jsonl")
    return {"local": str(raw / "*.jsonl"), "gcs": f"{gcs}/raw/*.jsonl", "tok": h.tokenizer_path(tmp_path_factory)}


def test_storage_reads_writes_globs_and_fingerprints_objects(gcs):
    storage.write_text(f"{gcs}/t/a.txt", "hello")
    storage.write_bytes(f"{gcs}/t/sub/b.bin", b"\x00\x01")
    assert storage.read_text(f"{gcs}/t/a.txt") == "hello"
    assert storage.glob(f"{gcs}/t/*.txt") == [f"{gcs}/t/a.txt"]
    assert storage.listdir(f"{gcs}/t") == ["a.txt", "sub"]
    assert storage.isdir(f"{gcs}/t/sub") and storage.isfile(f"{gcs}/t/sub/b.bin") and storage.size(f"{gcs}/t/a.txt") == 5
    first = storage.signature(f"{gcs}/t/a.txt")
    storage.write_text(f"{gcs}/t/a.txt", "world")  # same size, other content: another version
    assert storage.signature(f"{gcs}/t/a.txt") != first and "crc32c" in first

    # The metrics file: GCS has no append, so the object is rewritten with what it held before.
    path = f"{gcs}/t/metrics.jsonl"
    for run in range(2):
        lines = metrics.JsonLines(path)
        lines.write(f'{{"run": {run}}}\n')
        lines.close()
    assert storage.read_text(path) == '{"run": 0}\n{"run": 1}\n'
    storage.rmtree(f"{gcs}/t")
    assert not storage.exists(f"{gcs}/t/a.txt")


def test_data_and_dataset_cache_on_gcs_give_the_local_batches(gcs, corpus, tmp_path):
    def batches(files, cache_dir):
        config = h.config(*h.TINY_MODEL, "dataset_type=jsonl", f"grain_train_files={files}",
                          f"tokenizer_path={corpus['tok']}", f"dataset_cache_dir={cache_dir}",
                          "dataset_cache_shard_mb=0.004", "dataset_cache_workers=2", "max_target_length=32",
                          "per_device_batch_size=4", "eval_interval=-1")
        inputs = data_lib.make_inputs(config, log=lambda *a: None)
        try:
            out = [next(inputs.train_iterator) for _ in range(6)]
            inputs.sources.builders[0].wait()
            return out, inputs.sources.builders[0].cache
        finally:
            inputs.close()

    local, _ = batches(corpus["local"], tmp_path / "cache")
    remote, cache = batches(corpus["gcs"], f"{gcs}/cache")
    assert cache.directory.startswith(f"{gcs}/cache/text-") and cache.remote
    assert storage.isfile(f"{cache.directory}/metadata.json") and cache.finished() == list(range(cache.count))
    for a, b in zip(local, remote):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert not [n for n in os.listdir(tmp_path) if n.startswith("gs:")]  # nothing written to a local "gs:" dir


@pytest.mark.slow
def test_train_on_gcs_killed_resumes_bitwise(gcs, corpus, tmp_path):
    steps = 40
    tiny = [a for a in TINY if a.split("=")[0] not in ("vocab_size", "enable_tensorboard")]
    args = [BASE_YML, *tiny, "vocab_size=320", "dataset_type=jsonl", f"tokenizer_path={corpus['tok']}",
            "dataset_cache_shard_mb=0.004", "dataset_cache_workers=1", f"steps={steps}",
            "checkpoint_period=4", "max_num_checkpoints_to_keep=2", "log_period=10"]
    # The reference: the same data and cache settings on local disk, uninterrupted.
    whole = train.main([*args, f"grain_train_files={corpus['local']}", f"dataset_cache_dir={tmp_path / 'cache'}",
                        f"base_output_directory={tmp_path}", "run_name=whole", "eval_interval=-1",
                        "enable_tensorboard=false"])

    run = f"{gcs}/runs/cut"
    gcs_args = [*args, f"grain_train_files={corpus['gcs']}", f"dataset_cache_dir={gcs}/cache2",
                f"base_output_directory={gcs}/runs", "run_name=cut", f"metrics_file={run}/metrics.jsonl",
                "enable_tensorboard=true", f"grain_eval_files={corpus['gcs']}", "eval_steps=1", "viz_period=8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), h.REPO) if p)}
    process = subprocess.Popen([sys.executable, "-m", "maxtrain.train", *gcs_args, "eval_interval=-1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:  # kill -9 once a checkpoint is complete on GCS
        if storage.glob(f"{run}/checkpoints/*/commit_success.txt"):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == -signal.SIGKILL, output

    resumed = train.main([*gcs_args, "eval_interval=20"])
    assert int(resumed.state["step"]) == steps
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["params"]),
                 jax.device_get(whole.state["params"]))

    complete = sorted(int(p.split("/")[-2]) for p in storage.glob(f"{run}/checkpoints/*/commit_success.txt"))
    assert complete[-1] == steps and len(complete) == 2  # max_num_checkpoints_to_keep deletes on GCS too
    logged = [line for line in storage.read_text(f"{run}/metrics.jsonl").splitlines() if '"learning/loss"' in line]
    assert logged and logged[-1].startswith(f'{{"step": {steps},')
    assert storage.glob(f"{run}/tensorboard/events.out.tfevents.*")
    assert storage.glob(f"{run}/viz/step_*.html") and storage.glob(f"{run}/viz/step_*.png")
    assert "run_name: cut" in storage.read_text(f"{run}/metadata/config.yml")
