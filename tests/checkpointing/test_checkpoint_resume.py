"""Bitwise determinism across a stop and resume, on packed default-corpus data over 8 CPU devices.

Run A trains 2N steps. Run B trains N steps, stops, and is resumed (same command, more steps) for N
more. Both use learning_rate_schedule_steps=2N, so the schedule does not depend on where B stops.
Every logged loss and grad norm and the final params, optimizer state and step are bitwise equal.
"""

from __future__ import annotations

import os

from ckpt_helpers import assert_bitwise_equal, cache_dir, logged, train  # noqa: F401  (cache_dir is a fixture)
from maxtrain.checkpointing import files as checkpoint_files

N = 3

# data x FSDP x tensor parallel (2 x 2 x 2), with gradient accumulation over 2 micro-batches
MESH = ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "gradient_accumulation_steps=2"]


def test_resume_is_bitwise_identical(tmp_path, cache_dir):  # noqa: F811
    common = [*MESH, f"learning_rate_schedule_steps={2 * N}", f"checkpoint_period={N}",
              "warmup_steps_fraction=0.2"]
    a = train(tmp_path, "a", cache_dir, *common, f"steps={2 * N}", f"metrics_file={tmp_path}/a.jsonl")
    b1 = train(tmp_path, "b", cache_dir, *common, f"steps={N}", f"metrics_file={tmp_path}/b.jsonl")
    assert int(b1.state["step"]) == N
    b = train(tmp_path, "b", cache_dir, *common, f"steps={2 * N}", f"metrics_file={tmp_path}/b.jsonl")

    losses_a, losses_b = logged(tmp_path / "a.jsonl"), logged(tmp_path / "b.jsonl")
    assert sorted(losses_a) == sorted(losses_b) == list(range(1, 2 * N + 1))
    assert losses_a == losses_b, "logged loss / grad norm differ after resume"
    assert losses_a[1] != losses_a[2 * N], "the model did not train"
    assert_bitwise_equal(a.state, b.state, "final train state (params, opt state, step, rng, loss scale)")
    # ... and what was saved at the end is what was trained.
    for run, result in (("a", a), ("b", b)):
        saved = checkpoint_files.read_params(str(tmp_path / run / "checkpoints" / str(2 * N)))
        assert_bitwise_equal(saved, result.state["params"], f"run {run}: saved params")
    assert checkpoint_files.complete_steps(str(tmp_path / "b" / "checkpoints")) == [N, 2 * N]


def test_an_objective_changed_at_resume_says_so_and_moves_no_step(tmp_path, cache_dir):  # noqa: F811
    """Resuming an lm run as distillation (or loading its whole state into one) is a new stage, started from the
    parameters: refused before any restore, naming both objectives and load_parameters_path; every step stays."""
    import pytest  # pylint: disable=import-outside-toplevel

    from maxtrain.checkpointing.files import CheckpointError  # pylint: disable=import-outside-toplevel

    train(tmp_path, "lm", cache_dir, "steps=2", "checkpoint_period=2")
    steps = sorted(os.listdir(tmp_path / "lm" / "checkpoints"))
    distill = ["objective=distill", f"distill_teacher_path={tmp_path / 'lm'}", "steps=4"]
    with pytest.raises(CheckpointError, match=r"this run's checkpoint .*/lm/checkpoints/2 was trained with objective=lm, "
                                              r"and this run has objective=distill: the objective changed\. Start the "
                                              r"new stage as a new run from its parameters \(run_name=<a new name> "
                                              r"load_parameters_path=.*/lm/checkpoints/2\)"):
        train(tmp_path, "lm", cache_dir, *distill)
    assert sorted(os.listdir(tmp_path / "lm" / "checkpoints")) == steps  # nothing moved aside as damaged
    assert not (tmp_path / "lm" / "damaged_checkpoints").exists()
    with pytest.raises(CheckpointError, match=r"load_full_state_path=.*/lm/checkpoints/2 holds the state of a run with "
                                              r"objective=lm .* Start the new stage from its parameters: "
                                              r"load_parameters_path="):
        train(tmp_path, "stage2", cache_dir, *distill, f"load_full_state_path={tmp_path / 'lm'}")
