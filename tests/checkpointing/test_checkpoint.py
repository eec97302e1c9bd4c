"""What a checkpoint holds, loading it into a new run, and the errors when it does not fit."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ckpt_helpers import REPO, assert_bitwise_equal, cache_dir, train  # noqa: F401  (cache_dir is a fixture)
from maxtrain import inspect_checkpoint
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.checkpointing import manager as checkpoint_manager
from maxtrain.errors import PathError


@pytest.fixture(scope="module")
def base(tmp_path_factory, cache_dir):  # noqa: F811
    """A 2-step run with a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("base")
    result = train(out, "base", cache_dir, "steps=2", "checkpoint_period=2")
    return out, result


def test_checkpoint_holds_state_data_and_metadata(base, capsys):
    out, result = base
    step_dir = out / "base" / "checkpoints" / "2"
    tree = checkpoint_files.read_tree(str(step_dir))
    for path in ("step", "rng", "loss_scale/scale", "loss_scale/good_steps", "params/layers/decoder/wq",
                 "opt_state/1/0/mu/layers/decoder/wq", "opt_state/1/0/nu/token_embedding"):
        assert path in tree, path
    assert tree["params/layers/decoder/wq"] == ((2, 32, 2, 16), "float32")
    assert (step_dir / "data" / "process_0-of-1.json").is_file()
    meta = checkpoint_files.read_metadata(str(step_dir))
    assert meta["step"] == 2 and meta["num_devices"] == 8 and meta["num_processes"] == 1
    assert meta["config"]["base_emb_dim"] == 32
    if (REPO / ".git").exists():
        assert len(meta["git"]["sha"]) == 40 and isinstance(meta["git"]["dirty"], bool)
    assert any(p.startswith("jax==") for p in meta["packages"])
    # ... and the same metadata as readable files in <run>/metadata.
    run_meta = out / "base" / "metadata"
    assert json.loads((run_meta / "run.json").read_text())["git"] == meta["git"]
    assert "orbax-checkpoint==" in (run_meta / "requirements.txt").read_text()
    assert "base_emb_dim: 32" in (run_meta / "config.yml").read_text()
    saved = checkpoint_files.read_params(str(step_dir))
    assert_bitwise_equal(saved, result.state["params"], "saved params")

    assert inspect_checkpoint.main([str(out / "base")]) == 0
    shown = capsys.readouterr().out
    assert f"checkpoint: {step_dir}" in shown
    assert "params/layers/decoder/wq" in shown and "float32  [2, 32, 2, 16]" in shown
    assert "base_mlp_dim=64" in shown and meta["git"]["sha"] in shown


def test_a_checkpoint_that_does_not_fit_fails_before_training(base, cache_dir, tmp_path):  # noqa: F811
    out, _ = base
    with pytest.raises(checkpoint_files.CheckpointError) as error:
        train(tmp_path, "ft", cache_dir, "base_mlp_dim=96", f"load_parameters_path={out}/base/checkpoints/2")
    message = str(error.value)
    assert "does not fit the configured model" in message
    assert "params/layers/decoder/w_gate: checkpoint [2, 32, 64] vs model [2, 32, 96]" in message
    assert "params/layers/decoder/w_down: checkpoint [2, 64, 32] vs model [2, 96, 32]" in message
    assert "base_mlp_dim=64 (this run: 96)" in message
    assert not (tmp_path / "ft" / "metadata").exists(), "it failed only after starting the run"

    # Resuming a run with another model: the differing keys of the whole state are named.
    with pytest.raises(checkpoint_files.CheckpointError) as error:
        train(out, "base", cache_dir, "steps=4", "logits_via_embedding=true")
    message = str(error.value)
    assert "(resume)" in message and "not in the model  params/output" in message
    assert "not in the model  opt_state/1/0/mu/output" in message
    assert "logits_via_embedding=False (this run: True)" in message and "new run_name" in message

    with pytest.raises(checkpoint_files.CheckpointError, match="does not exist"):
        train(tmp_path, "ft", cache_dir, f"load_full_state_path={tmp_path}/nowhere")
    with pytest.raises(checkpoint_files.CheckpointError, match="holds no complete checkpoint"):
        train(tmp_path, "ft2", cache_dir, f"load_full_state_path={tmp_path}")


def test_load_parameters_path_starts_fine_tuning_with_a_fresh_optimizer(base, cache_dir, tmp_path):  # noqa: F811
    out, trained = base
    # With learning rate 0 (weight decay is scaled by it too) the params stay exactly as loaded.
    result = train(tmp_path, "ft", cache_dir, "steps=1", "learning_rate=0", f"load_parameters_path={out}/base")
    state = result.state
    assert_bitwise_equal(state["params"], trained.state["params"], "loaded params")
    assert int(state["step"]) == 1
    assert int(state["opt_state"][1][0].count) == 1, "the optimizer state was not fresh"
    assert float(np.abs(np.asarray(state["opt_state"][1][0].mu["layers"]["decoder"]["wq"])).max()) > 0


def test_load_full_state_path_continues_another_runs_state(base, cache_dir, tmp_path):  # noqa: F811
    out, trained = base
    result = train(tmp_path, "cont", cache_dir, "steps=3", f"load_full_state_path={out}/base/checkpoints")
    state = result.state
    assert int(state["step"]) == 3 and int(state["opt_state"][1][0].count) == 3
    assert checkpoint_files.complete_steps(str(tmp_path / "cont" / "checkpoints")) == [3]
    assert checkpoint_files.read_metadata(str(tmp_path / "cont" / "checkpoints" / "3"))["config"]["run_name"] == "cont"
    before = np.asarray(trained.state["params"]["layers"]["decoder"]["wq"])
    assert not np.array_equal(np.asarray(state["params"]["layers"]["decoder"]["wq"]), before)


def test_unwritable_checkpoint_directory_fails_at_start(cache_dir, tmp_path):  # noqa: F811
    # As root, permission bits do not stop writes; a directory that would sit under a regular file
    # cannot be created by anyone.
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(PathError) as error:  # the run's outputs are checked first, before any work
        train(blocker / "outputs", "r", cache_dir, "steps=2")
    assert str(error.value) == (f"base_output_directory='{blocker}/outputs' cannot be created: {blocker} is a file, "
                                "not a directory. Choose a path inside a directory")
    with pytest.raises(checkpoint_files.CheckpointError) as error:  # the checkpointer's own probe says the same
        checkpoint_manager.check_writable(str(blocker / "outputs" / "r" / "checkpoints"))
    message = str(error.value)
    assert f"the checkpoint directory {blocker}/outputs/r/checkpoints is not writable" in message
    assert "Not a directory" in message and "enable_checkpointing=false" in message
    assert blocker.read_text() == "not a directory"


def test_find_step_dir_skips_half_written_checkpoints(tmp_path):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    ckpts = tmp_path / "checkpoints"
    saver = ocp.StandardCheckpointer()
    for name in ("10", "20", "40"):
        saver.save(ckpts / name / "state", {"params": {"w": np.zeros(2, np.float32)}})
    saver.wait_until_finished()
    (ckpts / "30.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    (ckpts / "50").mkdir()  # no state/: not a checkpoint (a damaged one, to the trainer)
    assert checkpoint_files.complete_steps(str(ckpts)) == [10, 20, 40]
    for path in (tmp_path, ckpts):
        assert checkpoint_files.find_step_dir(str(path)) == os.path.join(ckpts, "40")
    assert checkpoint_files.find_step_dir(str(ckpts / "20")) == str(ckpts / "20")
