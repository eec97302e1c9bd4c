"""Self-checking checkpoints: checksums written with every step, verified by resume, load and inspect;
a damaged newest step is moved aside and the run resumes, bitwise, from the newest good step; a
checkpoint already at `steps` trains nothing and writes nothing."""

from __future__ import annotations

import hashlib
import os

import pytest

from ckpt_helpers import assert_bitwise_equal, cache_dir, train, train_subprocess  # noqa: F401
from maxtrain.checkpointing import checksums
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.checkpointing import inspect as checkpoint_inspect


def tree_hash(root) -> str:
    """A hash of every file's path and bytes under `root`."""
    h = hashlib.sha256()
    for directory, dirs, names in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(directory, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def biggest_array_file(step_dir) -> str:
    files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(step_dir, "state")) for n in names
             if os.sep + "d" + os.sep in os.path.join(d, n) + os.sep]
    return max(files, key=os.path.getsize)


def flip_byte(path, offset=None) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if offset is None else offset
        data[i] ^= 0x40
        f.seek(0)
        f.write(data)


def test_each_step_carries_checksums_and_a_flipped_byte_is_named(tmp_path, cache_dir):  # noqa: F811
    train(tmp_path, "r", cache_dir, "steps=4", "checkpoint_period=2")
    ckpts = tmp_path / "r" / "checkpoints"
    for step in (2, 4):
        listed = checksums.read(str(ckpts / str(step)))
        assert listed and any(p.startswith("state/") for p in listed) and "metadata/metadata" in listed
        assert checkpoint_files.check_step(str(ckpts / str(step))).status == "verified"
    victim = biggest_array_file(ckpts / "4")
    flip_byte(victim)
    health = checkpoint_files.check_step(str(ckpts / "4"))
    assert health.status == "damaged" and health.problem == f"{victim}: its contents changed since it was saved " \
                                                             "(checksum mismatch)"
    usable, damaged = checkpoint_files.latest_usable_step(str(ckpts))
    assert usable.step == 2 and [h.step for h in damaged] == [4]
    # inspect agrees with the trainer on the latest usable step, and refuses the damaged one by name.
    text = checkpoint_inspect.describe(str(tmp_path / "r"))
    assert f"checkpoint: {ckpts}/2" in text and "latest usable step: 2" in text and f"damaged step 4: {victim}" in text
    with pytest.raises(checkpoint_files.CheckpointError, match=f"is damaged: {victim}: its contents changed"):
        checkpoint_inspect.describe(str(ckpts / "4"))
    # A truncated or deleted file is named too.
    os.truncate(victim, 10)
    assert checkpoint_files.check_step(str(ckpts / "4")).problem.startswith(f"{victim} has 10 bytes, but ")
    os.remove(victim)
    assert checkpoint_files.check_step(str(ckpts / "4")).problem == f"{victim} is missing (it was saved with this step)"


@pytest.mark.slow  # three short training runs
def test_resume_moves_a_damaged_step_aside_and_continues_bitwise_from_the_one_before(tmp_path, cache_dir, capsys):  # noqa: F811
    schedule = "learning_rate_schedule_steps=6"  # the same schedule, whatever `steps` each run has
    reference = train(tmp_path, "ref", cache_dir, "steps=6", "checkpoint_period=2", schedule)
    train(tmp_path, "r", cache_dir, "steps=4", "checkpoint_period=2", schedule)
    ckpts = tmp_path / "r" / "checkpoints"
    victim = biggest_array_file(ckpts / "4")
    flip_byte(victim)
    before = tree_hash(ckpts / "4")
    capsys.readouterr()
    resumed = train(tmp_path, "r", cache_dir, "steps=6", "checkpoint_period=2", schedule)
    logged = capsys.readouterr().out.splitlines()
    moved = tmp_path / "r" / "damaged_checkpoints" / "4"
    assert tree_hash(moved) == before, "the damaged step must be moved aside intact, never deleted"
    assert any(line.startswith(f"checkpoint step 4 is damaged: {victim}: its contents changed") and f"Moved it to {moved}"
               in line for line in logged), logged
    assert f"Resuming from {ckpts}/2" in logged
    assert checkpoint_files.complete_steps(str(ckpts)) == [2, 4, 6]
    assert_bitwise_equal(resumed.state["params"], reference.state["params"], "params after the fallback")
    assert_bitwise_equal(resumed.state["opt_state"], reference.state["opt_state"], "optimizer state")


@pytest.mark.slow  # two short training runs
def test_a_step_that_does_not_restore_falls_back_the_same_way(tmp_path, cache_dir):  # noqa: F811
    train(tmp_path, "r", cache_dir, "steps=4", "checkpoint_period=2")
    ckpts = tmp_path / "r" / "checkpoints"
    # No checksums (as saved by an older maxtrain), and an array file cut short: only the restore notices.
    for step in (2, 4):
        for name in os.listdir(ckpts / str(step) / "checksums"):
            os.remove(ckpts / str(step) / "checksums" / name)
        os.rmdir(ckpts / str(step) / "checksums")
    assert checkpoint_files.check_step(str(ckpts / "4")).status == "unverified"
    victim = biggest_array_file(ckpts / "4")
    os.truncate(victim, 10)  # 10 bytes: cut to half, it restored without error in one CI run (2026-11-30)
    # The resume in a new process, as a real one is: in this process the TensorStore contexts of the first run
    # could still hold what it wrote (Orbax reads with recheck_cached_data=False) and serve it instead of the file.
    resumed = train_subprocess(tmp_path, "r", cache_dir, "steps=5", "checkpoint_period=2")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    logged = out.splitlines()
    assert any(line.startswith(f"checkpoint step 4 is damaged: {ckpts}/4: it does not restore") for line in logged), out
    assert (tmp_path / "r" / "damaged_checkpoints" / "4").is_dir()
    assert f"Resuming from {ckpts}/2" in logged
    assert checkpoint_files.complete_steps(str(ckpts)) == [2, 4, 5]


def test_a_checkpoint_already_at_steps_trains_nothing_and_writes_nothing(tmp_path, cache_dir, capsys):  # noqa: F811
    train(tmp_path, "r", cache_dir, "steps=4", "checkpoint_period=2")
    before = tree_hash(tmp_path / "r")
    capsys.readouterr()
    result = train(tmp_path, "r", cache_dir, "steps=2")
    logged = capsys.readouterr().out.splitlines()
    assert result.nothing_to_train and result.state is None
    assert f"checkpoint {tmp_path}/r/checkpoints/4 is at step 4, steps=2: nothing to train; raise steps (e.g. " \
           "steps=6) to train on" in logged
    assert tree_hash(tmp_path / "r") == before
