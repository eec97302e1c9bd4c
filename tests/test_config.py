import os
import re

import pytest

from conftest import BASE_YML, REPO
from maxtrain import config as config_lib
from maxtrain import models
from maxtrain.config import ConfigError, load_config, with_devices


def load(*overrides):
    return load_config([BASE_YML, *overrides])


def test_defaults_and_overrides_are_typed():
    cfg = load("steps=7", "learning_rate=1", "scan_layers=false", "run_name=abc")
    assert load("learning_rate=1e-2").learning_rate == 0.01
    assert cfg.steps == 7 and isinstance(cfg.learning_rate, float) and cfg.learning_rate == 1.0
    assert cfg.scan_layers is False
    assert cfg.run_dir == os.path.join("outputs", "abc")
    assert cfg.checkpoint_dir == os.path.join("outputs", "abc", "checkpoints")


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean base_emb_dim") as e:
        load("base_emb_dimm=64")
    assert len(str(e.value)) < 200  # one suggestion, not a list of every key


@pytest.mark.parametrize("override, fragment", [
    ("steps=abc", "steps must be an integer"),
    ("scan_layers=maybe", "scan_layers must be a boolean"),
    ("learning_rate=fast", "learning_rate must be a number"),
    ("logical_axis_rules=7", "logical_axis_rules must be a list"),
])
def test_wrong_type_names_key_and_type(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load(override)


@pytest.mark.parametrize("overrides, fragment", [
    (["per_device_batch_size=-2"], "per_device_batch_size=-2 is not allowed: it must be >= 1"),
    (["base_num_query_heads=6", "base_num_kv_heads=4"], "must be a multiple of base_num_kv_heads=4"),
    (["ici_tensor_parallelism=3"], "tensor parallelism 3 .* must divide base_num_query_heads=4"),
    (["dtype=fp8"], "dtype='fp8' is not allowed: it must be one of: autoselected, float32"),
    (["model_name=gpt5"], "model_name='gpt5' is not a preset. Presets: deepseek3-671b, deepseek3-tiny, default, gemma2-2b"),
    (["ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"], "only one ici_\\*_parallelism may be -1"),
    (["logical_axis_rules=[[\"embed\", \"model\"]]"], "unknown mesh axis 'model'"),
    (["dataset_type=arrayrecord"], "needs grain_train_files"),
    (["steps"], "overrides are key=value"),
])
def test_impossible_values_are_explained(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load(*overrides)


def test_every_base_key_has_a_comment():
    with open(BASE_YML) as f:
        lines = f.read().splitlines()
    for line in lines:
        match = re.match(r"^([a-z_0-9]+):", line)
        if match:
            assert "#" in line, f"base.yml key {match.group(1)} has no one-line comment"


@pytest.mark.parametrize("name, expected_millions", [
    ("gpt2-small", 124), ("llama3-1b", 1236), ("llama3-8b", 8030), ("llama2-7b", 6738),
])
def test_presets_have_the_published_sizes(name, expected_millions):
    cfg = load(f"model_name={name}")
    assert abs(models.num_params(cfg) / 1e6 - expected_millions) / expected_millions < 0.01


def test_preset_then_override_precedence():
    cfg = load("model_name=llama3-8b", "base_num_decoder_layers=2")
    assert cfg.base_emb_dim == 4096 and cfg.base_num_decoder_layers == 2


def test_base_config_inheritance(tmp_path):
    own = tmp_path / "mine.yml"
    own.write_text(f"base_config: {BASE_YML}\nsteps: 3\n")
    os.symlink(os.path.join(REPO, "configs", "models"), tmp_path / "models")
    cfg = load_config([str(own), "log_period=1"])
    assert cfg.steps == 3 and cfg.log_period == 1
    bad = tmp_path / "bad.yml"
    bad.write_text(f"base_config: {BASE_YML}\nstepz: 3\n")
    with pytest.raises(ConfigError, match="did you mean steps"):
        load_config([str(bad)])


def test_derived_batch_and_schedule():
    cfg = with_devices(load("per_device_batch_size=3", "gradient_accumulation_steps=2", "steps=100",
                            "warmup_steps_fraction=0.1", "max_target_length=16"), num_devices=8)
    assert cfg.global_batch_size == 3 * 8 * 2 and cfg.micro_batch_size == 24
    assert cfg.tokens_per_step == 48 * 16
    assert cfg.schedule_steps == 100 and cfg.warmup_steps == 10


def test_multi_process_needs_run_name():
    with pytest.raises(ConfigError, match="explicit run_name"):
        with_devices(load(), num_devices=4, num_processes=2)
    assert with_devices(load("run_name=x"), num_devices=4, num_processes=2).num_processes == 2


@pytest.mark.parametrize("name, hint", [
    ("../../x", "base_output_directory=.. run_name=x"), ("/tmp/elsewhere", "base_output_directory=/tmp run_name=elsewhere"),
    ("a/b", f"base_output_directory={os.path.join('outputs', 'a')} run_name=b"), (".", ""), ("..", ""),
    ("x\0y", ""), ("gs://bucket/run", "base_output_directory=gs://bucket run_name=run")])
def test_run_name_is_one_directory_inside_the_output_directory(name, hint):
    with pytest.raises(ConfigError, match=r"run_name=.* must be one directory name \(no '/', not '.' or '..'\): the "
                                          r"run is written to base_output_directory/run_name") as e:
        load(f"run_name={name}")
    assert hint in str(e.value) and "\n" not in str(e.value)
    assert load("run_name=run.1-a_b").run_dir == os.path.join("outputs", "run.1-a_b")
    assert load().run_name_was_generated  # an empty run_name still gets a timestamped one


def test_config_is_frozen():
    cfg = load()
    with pytest.raises(AttributeError, match="frozen"):
        cfg.steps = 3
    with pytest.raises(AttributeError, match="did you mean steps"):
        _ = cfg.stepss
    assert config_lib.Config.replace(cfg, steps=3).steps == 3
