"""The `objective` key (maxtrain/config/losses.py): one row per objective, read for the data, the state and the
loss; the old use_* switches still work with one line of notice; a checkpoint saved with them still resumes."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain import train
from maxtrain.models import model_keys
from maxtrain.checkpointing import checksums
from maxtrain.checkpointing import inspect as checkpoint_inspect
from maxtrain.config import objectives as config_objectives
from maxtrain.errors import ConfigError
from maxtrain.training import distillation, losses, train_step
from maxtrain.models.model import Model
from post_helpers import compose, dpo_args, grpo_args, make_dataset, sft_args


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    paths = make_dataset(str(tmp_path_factory.mktemp("objective")))
    return {**paths, "dir": os.path.dirname(paths["sft"])}


def _args(dataset, name: str) -> list[str]:
    """A command line's settings that run objective `name` on the test data."""
    return {"lm": [], "sft": sft_args(dataset), "dpo": dpo_args(dataset), "grpo": grpo_args(dataset, dataset["dir"]),
            "distill": ["objective=distill", "distill_teacher_path=teacher"],
            "distill_on_policy": [*(a for a in grpo_args(dataset, dataset["dir"]) if a != "objective=grpo"),
                                  "objective=distill_on_policy", "distill_teacher_path=teacher"]}[name]


def _old(args: list[str]) -> list[str]:
    """`args` with objective=<name> spelled as its old switch, use_<...>=true."""
    old = {f"objective={name}": f"{key}=true" for key, name in config_objectives.OLD_KEYS.items()}
    return [old.get(a, a) for a in args]


def _load(*args, log=None):
    return config_lib.load_config(compose(BASE_YML, *TINY, "run_name=r", *args), log=log or (lambda *_: None))


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "distill"])
def test_each_old_switch_is_its_objective_with_one_line_of_notice(dataset, name):
    lines = []
    old = _load(*_old(_args(dataset, name)), log=lines.append)
    key = next(k for k, n in config_objectives.OLD_KEYS.items() if n == name)
    assert lines == [f"maxtrain: {key}=true is now objective={name} (the use_* keys will be removed)"]
    assert old.to_dict() == _load(*_args(dataset, name)).to_dict()  # the same run, whichever spelling
    assert not set(config_objectives.OLD_KEYS) & set(old.to_dict())  # the old switches are gone from the config


def test_the_old_switches_in_a_yaml_file_and_on_the_command_line(dataset, tmp_path):
    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE_YML}\nuse_sft: true\n")
    lines = []
    data = [a for a in sft_args(dataset) if not a.startswith("objective=")]
    config = config_lib.load_config(compose(str(mine), *TINY, *data), log=lines.append)
    assert config.objective == "sft" and lines == ["maxtrain: use_sft=true is now objective=sft (the use_* keys will be "
                                                   "removed)"]
    lines.clear()  # the command line's value replaces the file's
    assert config_lib.load_config([str(mine), *TINY, "use_sft=false"], log=lines.append).objective == "lm"
    assert lines == ["maxtrain: use_sft=false is now objective=lm (the use_* keys will be removed)"]


def test_sft_and_distillation_switches_together_are_distillation_on_conversations(dataset):
    lines = []
    config = _load(*_old(sft_args(dataset)), "use_distillation=true", "distill_teacher_path=t", log=lines.append)
    assert (config.objective, config.distill_data, config_objectives.data_kind(config)) == ("distill", "conversations",
                                                                                "conversations")
    assert lines == ["maxtrain: use_sft=true use_distillation=true are now objective=distill distill_data=conversations "
                     "(the use_* keys will be removed)"]


@pytest.mark.parametrize("args, match", [
    (["use_sft=true", "use_grpo=true"], r"use_sft=true and use_grpo=true were both set; a run has one objective: set "
                                        r"objective=sft or objective=grpo"),
    (["use_dpo=true", "use_distillation=true"], r"use_dpo=true and use_distillation=true were both set"),
    (["objective=dpo", "use_sft=true"], r"use_sft=true contradicts objective=dpo: a run has one objective; drop use_sft"),
    (["objective=lm", "use_grpo=true"], r"use_grpo=true contradicts objective=lm"),
    (["objective=dpo", "use_dpo=false"], r"use_dpo=false contradicts objective=dpo; drop use_dpo"),
    (["use_dpo=maybe"], r"use_dpo='maybe' has the wrong type; use_dpo must be a boolean"),
])
def test_old_switches_that_disagree_are_refused_naming_both_keys(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        _load(*args)
    assert "\n" not in str(e.value)


def test_every_row_has_a_loss_and_declares_what_its_state_and_batches_hold(dataset, tmp_path):
    allowed = config_lib.table()["objective"].allowed.describe()  # base.yml's {$objectives}
    assert set(losses.LOSSES) == set(config_objectives.OBJECTIVES) == set(allowed.removeprefix("one of: ").split(", "))
    for name, extra in [(n, []) for n in config_objectives.OBJECTIVES] + [("grpo", ["grpo_beta=0"])]:
        config = _load(*_args(dataset, name), *extra)
        if name.startswith("distill"):  # the teacher's model settings, as adopt_teacher reads them from its checkpoint
            config = config_lib.Config({**config.to_dict(), distillation.KEY: {k: getattr(config, k)
                                                                               for k in model_keys.MODEL_KEYS}})
        row = config_objectives.of(config)
        frozen = {row.frozen} if config_objectives.holds_frozen(config) else set()
        assert set(train_step.state_specs(config, Model.bind(config))) == {"params"} | frozen, (name, extra)
        assert losses.batch_keys(config) == row.batch_keys
        assert set(row.shown) <= set(row.keys) and set(row.data) == set(row.columns)
    assert not config_objectives.holds_frozen(_load(*_args(dataset, "grpo"), "grpo_beta=0"))


def test_make_inputs_reads_the_data_kind_of_the_row(dataset, tmp_path):
    def first(*args):
        config = config_lib.with_devices(_load(f"base_output_directory={tmp_path}", *args, "max_target_length=64"), 8)
        inputs = data_lib.make_inputs(config, log=lambda *_: None)
        return inputs, next(inputs.train_iterator)

    inputs, prompts = first(*grpo_args(dataset, dataset["dir"]))
    assert set(prompts) == {"prompt", "first", "text", "answer"} and inputs.prompts.stop_ids
    assert len(inputs.eval_batches) == 8  # the held-out prompts
    _, pairs = first(*dpo_args(dataset))
    assert (pairs["loss_weights"] < 0).any()  # the rejected completions
    _, sft = first(*sft_args(dataset))
    _, distilled = first(*sft_args(dataset), "objective=distill", "distill_teacher_path=t",
                         "distill_data=conversations")
    assert (sft["loss_weights"] >= 0).all()
    for key in sft:  # distillation on conversations reads what SFT reads
        np.testing.assert_array_equal(distilled[key], sft[key])


def test_inspect_data_shows_the_prompts_of_grpo(dataset, capsys):
    from maxtrain import inspect_data  # pylint: disable=import-outside-toplevel

    inspect_data.main([*compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"])), "--batches", "1", "--rows", "1"])
    out = capsys.readouterr().out
    assert "eval: 8 held-out prompts" in out and "2 prompts, left-padded to 16 tokens" in out
    assert "<|im_start|>assistant⏎' -> answer '" in out


def test_a_saved_config_with_the_old_switches_reads_as_its_objective():
    off = {"use_sft": False, "use_dpo": False, "use_grpo": False, "use_distillation": False}
    assert config_objectives.saved_objective({**off, "steps": 3}) == {"objective": "lm", "steps": 3}
    assert config_objectives.saved_objective({**off, "use_dpo": True})["objective"] == "dpo"
    assert config_objectives.saved_objective({**off, "use_sft": True, "use_distillation": True}) == {
        "objective": "distill", "distill_data": "conversations"}
    assert config_objectives.saved_objective({"objective": "sft", "steps": 3}) == {"objective": "sft", "steps": 3}


@pytest.mark.slow  # two tiny DPO runs (~15 s idle)
def test_a_checkpoint_written_with_the_old_switches_resumes(dataset, tmp_path, capsys):
    common = compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", "viz_period=-1", "eval_interval=-1",
                     *dpo_args(dataset), "checkpoint_period=1", "async_checkpointing=false", "run_name=old")
    first = train.main([*common, "steps=1"])
    path = os.path.join(tmp_path, "old", "checkpoints", "1", "metadata", "metadata")
    with open(path) as f:
        meta = json.load(f)
    del meta["config"]["objective"], meta["config"]["distill_data"]  # as written before the objective key
    meta["config"].update(use_sft=False, use_dpo=True, use_grpo=False, use_distillation=False)
    with open(path, "w") as f:
        json.dump(meta, f)
    checksums.write(os.path.dirname(os.path.dirname(path)))  # the step as that maxtrain saved it, checksums and all
    assert "dataset_type=jsonl objective=dpo" in checkpoint_inspect.describe(os.path.dirname(os.path.dirname(path)))
    capsys.readouterr()
    resumed = train.main(_old([*common, "steps=2"]))
    out = capsys.readouterr()
    assert "use_dpo=true is now objective=dpo" in out.err
    changed = [line for line in out.out.splitlines() if line.startswith("resuming with changed settings")]
    assert not any("objective" in line or "use_" in line for line in changed), changed
    assert int(resumed.state["step"]) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["reference"]),
                 jax.device_get(first.state["reference"]))  # the checkpoint's frozen reference, loaded


@pytest.mark.slow  # two tiny runs on conversations, the teacher's and the student's (~25 s idle)
def test_distillation_on_conversations_trains_towards_the_teacher(dataset, tmp_path):
    common = [BASE_YML, *TINY, f"base_output_directory={tmp_path}", "viz_period=-1", *sft_args(dataset),
              "eval_steps=1", "learning_rate=0.01", "warmup_steps_fraction=0"]
    train.main(compose(*common, "base_emb_dim=48", "base_num_decoder_layers=3", "run_name=teacher", "steps=2",
                       "eval_interval=-1"))
    student = train.main(compose(*common, "run_name=student", "steps=4", "eval_interval=4", "objective=distill",
                                 "distill_data=conversations", f"distill_teacher_path={tmp_path / 'teacher'}"))
    assert student.config.objective == "distill" and "teacher" in student.state
    first, last = student.eval_metrics[0], student.eval_metrics[4]
    assert first["distill_kl"] > 0 and last["distill_kl"] < first["distill_kl"]  # towards the teacher
    assert last["distill_ce"] < first["distill_ce"]  # and the conversations' assistant tokens
