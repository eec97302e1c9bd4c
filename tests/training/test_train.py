"""The training loop end to end on the embedded default corpus (tiny model, in process)."""

import json
import os

import pytest

from maxtrain import train
from maxtrain.config import with_overrides

CORPUS = ["default_corpus_max_mb=0.3", "eval_steps=2", "log_period=5"]


def test_trains_evaluates_checkpoints_and_resumes(tiny_args, tmp_path, capsys):
    metrics_file = tmp_path / "m.jsonl"
    args = with_overrides(tiny_args, *CORPUS, "learning_rate=1e-2", "eval_interval=10", "checkpoint_period=10",
                          f"metrics_file={metrics_file}", "max_new_tokens=8")
    first = train.main([*args, "steps=20"])
    losses = first.eval_losses
    assert sorted(losses) == [0, 10, 20]
    assert losses[20] < losses[0] - 1.0, losses  # learns: eval loss falls by > 1 nat in 20 steps
    assert isinstance(first.sample, str) and first.sample.startswith("def main(")
    out = capsys.readouterr().out
    assert "greedy sample from 'def main('" in out and "tokens/s/device" in out
    ckpt_dir = first.config.checkpoint_dir
    assert sorted(os.listdir(ckpt_dir)) == ["10", "20"]
    assert all(os.listdir(os.path.join(ckpt_dir, step, "checksums")) == ["process_0.json"] for step in ("10", "20"))
    assert os.path.isfile(os.path.join(first.config.metadata_dir, "config.yml"))

    # The same command with the same run_name and more steps continues from step 20.
    second = train.main([*args, "steps=25"])
    steps = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines() if "learning/loss" in line]
    assert steps == list(range(1, 21)) + list(range(21, 26))
    assert "Resuming from" in capsys.readouterr().out
    assert int(second.state["step"]) == 25


@pytest.mark.slow
def test_non_finite_loss_stops_with_advice(tiny_args):
    with pytest.raises(train.TrainingError, match=r"the loss became (nan|inf) at step \d+.*learning_rate"):
        train.main(with_overrides(tiny_args, "dataset_type=synthetic", "steps=10", "learning_rate=1e30",
                    "gradient_clipping_threshold=0", "warmup_steps_fraction=0", "enable_checkpointing=false"))


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    import subprocess
    import sys

    from conftest import BASE_YML

    result = subprocess.run([sys.executable, "-m", "maxtrain.train", BASE_YML, "base_emb_dimm=64"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "did you mean base_emb_dim?" in result.stderr and "Traceback" not in result.stderr
