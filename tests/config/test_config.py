import os
import re

import pytest

from conftest import BASE_YML, REPO, TINY
from maxtrain import config as config_lib
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import ConfigError, features, limits, load_config, registry, with_devices


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
    (["per_device_batch_size=-2"], "per_device_batch_size=-2 is not allowed: it must be > 0"),
    (["base_num_query_heads=6", "base_num_kv_heads=4"], "must be a multiple of base_num_kv_heads=4"),
    (["ici_tensor_parallelism=3"], "tensor parallelism 3 .* must divide base_num_query_heads=4"),
    (["dtype=fp8"], "dtype='fp8' is not allowed: it must be one of: autoselected, float32"),
    (["model_name=gpt5"], "model_name='gpt5' is not a preset. Presets: deepseek3-671b, deepseek3-tiny, deepseek3.2-671b, deepseek3.2-tiny, deepseek4-flash, deepseek4-tiny, default"),
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
    assert abs(Model.bind(cfg).num_params / 1e6 - expected_millions) / expected_millions < 0.01


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


# --------------------------------------------------------------------------------------------
# Nothing silent (issue 44): features.py and limits.py
# --------------------------------------------------------------------------------------------

# A baseline that turns each feature off where base.yml's defaults have it on.
OFF = {"packing=true": ["packing=false"], "lr_schedule_type=cosine": ["lr_schedule_type=constant"],
       "per-layer attention types": ["model_name=deepseek3-tiny"]}
VALUES = {"chat_template": "chatml", "grain_packing_type": "first_fit", "moe_dispatch": "capacity",
          "lora_target_modules": ["q"], "grpo_reward_functions": ["format"], "mlp_only_layers": [0],
          "attention_layer_types": ["full"] * 4, "indexer_types": ["full", "shared"] * 2, "gdn_kernel": "jnp",
          "moe_grouped_matmul": "xla", "indexer_dtype": "float8",
          "grpo_rollout_engine": "vllm", "mrope_section": [24, 20, 20], "vision_freeze": ["tower"],
          "compress_layer_types": ["sliding_attention"] * 4}


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def _another_value(key: str):
    """A value of `key` its allowed values admit, other than its default."""
    setting = config_lib.table()[key]
    d = setting.default
    if key in VALUES or isinstance(d, str):
        return VALUES.get(key, "somewhere")
    if isinstance(d, bool):
        return not d
    for candidate in (2 * d, d / 2, d + 1, d - 1, 0.5, 1, 2, 0.25):
        if candidate != d and (not isinstance(d, int) or float(candidate).is_integer()):
            candidate = int(candidate) if isinstance(d, int) else float(candidate)
            if setting.allowed.admits(candidate):
                return candidate
    raise AssertionError(f"no other allowed value of {key}")


FEATURE_KEYS = [(f, k) for f in features.FEATURES for k in f.keys]


def test_every_feature_key_is_a_base_key_owned_by_one_row():
    keys = [k for f in features.FEATURES for k in f.keys]
    assert set(keys) <= set(config_lib.table()), set(keys) - set(config_lib.table())
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    for family in registry.FAMILIES.values():  # the family rows are the registry's, and only theirs
        assert all(features.owner(k).state == "decoder_block" for k in family.settings)
        assert {k for k, _ in family.usual} <= set(config_lib.table())
    rule = "does nothing without"  # the rule itself lives in features.py alone
    package = os.path.join(REPO, "maxtrain")
    owners = {os.path.relpath(os.path.join(d, n), REPO) for d, _, names in os.walk(package) for n in names
              if n.endswith(".py") and rule in open(os.path.join(d, n), encoding="utf-8").read()}
    assert owners == {os.path.join("maxtrain", "config", "features.py")}, owners


@pytest.mark.parametrize("feature, key", FEATURE_KEYS, ids=[k for _, k in FEATURE_KEYS])
def test_a_setting_of_a_feature_that_is_off_is_refused(feature, key):
    """Every key of the table, set to another allowed value while its feature is off: refused, naming the key
    (by the table's rule, or an older rule of checks.py that names it first)."""
    baseline = OFF.get(feature.needs, [])
    assert not feature.on(load(*baseline).to_dict()), f"{feature.needs} is on with {baseline}"
    with pytest.raises(ConfigError, match=re.escape(f"{key}=")) as e:
        load(*baseline, f"{key}={_text(_another_value(key))}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, fragment", [
    (["distill_alpha=0.3"], r"distill_alpha=0.3 does nothing without objective=distill \(here objective=lm\): set "
                            "objective=distill .*, or drop distill_alpha"),
    (["muon_beta=0.9"], r"muon_beta=0.9 does nothing without opt_type=muon \(here opt_type=adamw\): set opt_type=muon"),
    (["grpo_beta=0.1"], "grpo_beta=0.1 does nothing without objective=grpo"),
    (["objective=sft", "dataset_type=jsonl", "grain_train_files=x.jsonl", "dpo_beta=0.3"],
     r"dpo_beta=0.3 does nothing without objective=dpo \(here objective=sft\)"),
    (["chat_template=chatml"], r"chat_template='chatml' does nothing without records rendered with a chat template "
                               r"\(objective=sft, dpo, grpo, distill with distill_data=conversations or distill_on_policy\) "
                               r"\(here objective=lm\)"),
    (["objective=distill", "distill_teacher_path=t", "sft_train_on_completion_only=false"],
     r"sft_train_on_completion_only=false does nothing without conversations \(objective=sft or distill with "
     r"distill_data=conversations\) \(here objective=distill\)"),
    (["lora_alpha=8"], "lora_alpha=8.0 does nothing without lora_rank > 0: set lora_rank"),
    (["num_experts_per_tok=2"], "num_experts_per_tok=2 does nothing without a mixture-of-experts family"),
    (["decode_sampling_top_k=5"], "decode_sampling_top_k=5 does nothing without decode_sampling_strategy=topk"),
    (["sliding_window_size=4096"], r"sliding_window_size=4096 does nothing without sliding-window layers \(here "
                                   r"decoder_block=llama\): .*attention_layer_types"),
    (["model_name=llama3.1-8b", "rope_type=default", "rope_factor=4"], "rope_factor=4.0 does nothing without rope_type"),
])
def test_the_refusal_names_the_key_the_switch_and_the_fix(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load(*overrides)


def test_a_presets_values_are_the_models_defaults_and_the_users_are_checked(tmp_path):
    assert load("model_name=llama3.1-8b", "rope_type=default").rope_factor == 8.0  # the preset's, switched off
    assert load("model_name=gemma3-1b", f"attention_layer_types=[{','.join(['full'] * 26)}]").sliding_window_size == 512
    assert load("objective=distill", "distill_teacher_path=t", "distill_alpha=0.3").distill_alpha == 0.3
    assert load("opt_type=muon", "muon_beta=0.9").muon_beta == 0.9
    assert load("distill_alpha=0.5").distill_alpha == 0.5  # the default, given: does nothing and says nothing
    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE_YML}\ndpo_beta: 0.3\n")
    with pytest.raises(ConfigError, match="dpo_beta=0.3 does nothing without objective=dpo"):
        load_config([str(mine)])


def test_the_registry_plans_each_layers_attention_as_the_family_builds_it():
    for preset in config_lib.preset_names():
        for extra in ([], ["sliding_window_size=8"], ["attention_layer_types=[]"]):
            try:
                cfg = load(f"model_name={preset}", *extra)
            except ConfigError:
                continue  # a window where no layer slides
            # the plan says which layers slide; the others attend fully, in Llama 4's chunks, or not at all (a
            # recurrent layer, which has no window either)
            built = [t.attention if t.attention == "sliding" else "full" for t in Model.bind(cfg).layer_types]
            assert built == features.layer_attention(cfg.to_dict()), preset


@pytest.mark.parametrize("family", [n for n, f in registry.FAMILIES.items() if f.usual])
def test_a_familys_defining_setting_left_at_the_shared_default_is_refused(family):
    """Each defining setting at the shared default that turns it off (the others at the family's usual value)."""
    usual = dict(registry.FAMILIES[family].usual)
    model = [f"decoder_block={family}"] + {  # MLA's q/k width; DeepSeek-V4's low-rank queries, indexer, expert width
        "deepseek": ["head_dim=192"], "deepseek_v4": ["q_lora_rank=16", "index_n_heads=2", "base_moe_mlp_dim=32",
                                                      "max_new_tokens=0"]}.get(family, [])
    load(*model, *(f"{k}={v}" for k, v in usual.items()))
    for key, value in usual.items():
        off = {**usual, key: {"sliding_window_size": 0, "num_experts": 1}[key]}
        with pytest.raises(ConfigError, match=f"set {key}={value} "):
            load(*model, *(f"{k}={v}" for k, v in off.items()))


def test_sliding_layers_without_a_window_are_refused_and_full_attention_is_a_choice():
    with pytest.raises(ConfigError, match=r"decoder_block=gpt_oss has sliding-window layers .* sliding_window_size=0 "
                                          r"would give them full attention; set sliding_window_size=128"):
        load("model_name=gpt-oss-20b", "sliding_window_size=0")
    with pytest.raises(ConfigError, match="attention_layer_types has sliding layers, but sliding_window_size=0"):
        load("attention_layer_types=[sliding,full,sliding,full]")
    full = ",".join(["full"] * 24)
    assert load("model_name=gpt-oss-20b", "sliding_window_size=0", f"attention_layer_types=[{full}]").num_experts == 32


GRPO = ["objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl", "train_data_columns=[prompt,answer]",
        "eval_data_columns=[prompt,answer]"]


@pytest.mark.parametrize("sampling, fragment", [
    (["decode_sampling_strategy=greedy"], "greedy"),
    (["decode_sampling_strategy=topk", "decode_sampling_top_k=1"], "decode_sampling_top_k=1"),
    (["decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=0.0002"], r"decode_sampling_nucleus_p=0.0002 <= "
                                                                               "1/vocab_size"),
    (["decode_sampling_strategy=weighted", "decode_sampling_temperature=1e-6"], "decode_sampling_temperature=1e-06"),
    (["decode_sampling_strategy=nucleus", "decode_sampling_temperature=0.001"], "decode_sampling_temperature=0.001"),
    (["decode_sampling_strategy=weighted", "vocab_size=1"], "vocab_size=1"),
])
def test_grpo_refuses_a_sampler_that_can_draw_one_token(sampling, fragment):
    with pytest.raises(ConfigError, match=f"objective=grpo samples each prompt's completions with .*{fragment}.*would "
                                          "all be the same"):
        load(*GRPO, *sampling)
    for fine in (["decode_sampling_strategy=weighted"], ["decode_sampling_strategy=topk", "decode_sampling_top_k=2"],
                 ["decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=0.0003"]):  # > 1/4096
        assert load(*GRPO, *fine).objective == "grpo"


def test_multi_token_prediction_needs_a_longer_sequence_than_its_modules():
    with pytest.raises(ConfigError, match=r"mtp_num_layers=4 needs max_target_length >= 5, but max_target_length=4: "
                                          r"multi-token prediction module k predicts token i \+ k \+ 1"):
        load("model_name=deepseek3-tiny", "mtp_num_layers=4", "max_target_length=4")
    assert load("model_name=deepseek3-tiny", "mtp_num_layers=3", "max_target_length=4").mtp_num_layers == 3


@pytest.mark.parametrize("key, on", [("mtp_num_layers", ["model_name=deepseek3-tiny", "mtp_num_layers=3"]),
                                     ("max_prefill_predict_length", [*GRPO, "decode_sampling_strategy=weighted",
                                                                     "max_prefill_predict_length=16"]),
                                     ("gdn_chunk_size", ["model_name=qwen3-next-80b-a3b", "gdn_chunk_size=128"])])
def test_every_length_need_refuses_one_token_less(key, on):
    row = next(r for r in limits.LENGTH_NEEDS if r[0] == key)
    least = row[2](load(*on).to_dict())
    with pytest.raises(ConfigError, match=f"{key}=.* needs max_target_length >= {least}, but max_target_length="
                                          f"{least - 1}"):
        load(*on, f"max_target_length={least - 1}")
    assert load(*on, f"max_target_length={least}").max_target_length == least
    assert {r[0] for r in limits.LENGTH_NEEDS} == {"mtp_num_layers", "max_prefill_predict_length", "gdn_chunk_size"}


def test_a_chunk_at_least_as_long_as_the_sequence_is_full_attention():
    """Llama 4's chunked layers attend within blocks of chunk_attn_window_size; a block at least as long as the
    sequence is the full attention such a model computes on a short sequence: its preset's own chunk is accepted."""
    assert load("model_name=llama4-scout", "max_target_length=4096").chunk_attn_window_size == 8192
    assert load("decoder_block=llama4_text", "num_experts=4", "chunk_attn_window_size=64",
                "max_target_length=32").max_target_length == 32


def test_an_empty_output_directory_or_a_blank_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"base_output_directory is empty \(an unset shell variable, as in "
                                          r"base_output_directory=\$OUT\?\): the run would be written into the current "
                                          "directory"):
        load("base_output_directory=")
    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE_YML}\nbase_output_directory:\n")  # null: an unset value
    with pytest.raises(ConfigError, match="base_output_directory is empty"):
        load_config([str(mine)])
    for key in limits.PATH_KEYS:
        with pytest.raises(ConfigError, match=f"{key}=' ' is only white space"):
            load(f"{key}= ")
    for key in (k for k, empty in limits.PATH_KEYS.items() if empty and k != "run_name"):  # "" keeps its meaning
        assert getattr(load(f"{key}="), key) == ""
    assert load("run_name=").run_name_was_generated
    assert load("base_output_directory=.").run_dir.startswith(".")


def test_every_path_key_says_what_its_empty_value_means():
    named_like_paths = {k for k, s in config_lib.table().items() if isinstance(s.default, str)
                        and k.endswith(("_path", "_dir", "_directory", "_file", "_files"))}
    assert named_like_paths <= set(limits.PATH_KEYS) <= set(config_lib.table())


def test_the_config_after_the_devices_is_a_type_of_its_own():
    """load_config gives the settings (Config); with_devices the second phase (DeviceConfig), which alone has
    the values that follow from the devices, and says where they come from when asked too early."""
    config = config_lib.load_config([BASE_YML, *TINY])
    assert type(config) is config_lib.Config
    with pytest.raises(AttributeError, match="known only once the devices are: a DeviceConfig"):
        _ = config.global_batch_size
    placed = config_lib.with_devices(config, num_devices=4)
    assert isinstance(placed, config_lib.DeviceConfig)
    assert placed.global_batch_size == 4 * config.per_device_batch_size * config.gradient_accumulation_steps
    assert isinstance(placed.replace(steps=3), config_lib.DeviceConfig)  # a changed copy keeps its phase


# --------------------------------------------------------------------------------------------
# Nothing silent, round four (issue 54): second switches, presets the user wrote, keys of another command, experts
# placed nowhere
# --------------------------------------------------------------------------------------------

# Per second switch: its first switch on (the family), the second off.
GRPO_SAMPLED = [*GRPO, "decode_sampling_strategy=weighted"]
SECOND_OFF = {"temperature_tuning=true": ["decoder_block=llama4_text", "num_experts=4", "nope_layer_interval=4"],
              "NoPE layers (nope_layer_interval >= 1)": ["decoder_block=llama4_text", "num_experts=4"],
              "RoPE layers (nope_layer_interval other than 1)": ["decoder_block=llama4_text", "num_experts=4",
                                                                 "nope_layer_interval=1"],
              "gated delta-net layers (inhomogeneous_layer_cycle_interval >= 2)":
                  ["model_name=qwen3-next-80b-a3b", "inhomogeneous_layer_cycle_interval=1"],
              "moe_dispatch=dropless": ["decoder_block=mixtral", "num_experts=4", "moe_dispatch=capacity"],
              "a shared expert (shared_experts >= 1)": ["model_name=qwen3-next-80b-a3b", "shared_experts=0"],
              "a lightning indexer (index_n_heads > 0)": ["model_name=deepseek3-tiny"],
              "indexer_training=dense_warmup or sparse": ["model_name=deepseek3.2-tiny"],
              "a model with a vision tower (vision_config set)": ["decoder_block=gemma4", "sliding_window_size=64"],
              "bidirectional_image_attention=true": ["model_name=gemma4-default-vl"],
              # GRPO's rollout keys (rl-adv)
              "grpo_scale_rewards=group or batch": [*GRPO_SAMPLED, "grpo_scale_rewards=none"],
              "grpo_overlong_buffer_length > 0": GRPO_SAMPLED,
              "grpo_dynamic_sampling=true": GRPO_SAMPLED,
              "an environment (multi-turn episodes; a single-turn completion has one turn)": GRPO_SAMPLED,
              "rollout workers (grpo_rollout_workers > 0)": GRPO_SAMPLED}
# GRPO's loss keys (training/policy_losses.py): objective=grpo on, the loss's second switch off
GRPO_RUN = ["objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl", "train_data_columns=[prompt,answer]",
            "decode_sampling_strategy=weighted", "max_target_length=128"]
SECOND_OFF.update({"a clipped loss (grpo_loss_type=grpo, bnpo, dr_grpo or dapo)":
                       [*GRPO_RUN, "grpo_loss_type=cispo", "grpo_epsilon_high=5"],
                   "a KL term (grpo_beta > 0)": [*GRPO_RUN, "grpo_beta=0"]})
SECOND_KEYS = [(f, k) for f in features.REQUIRES for k in f.keys]


def test_every_second_switch_has_a_first_and_a_baseline():
    assert {f.needs for f in features.REQUIRES} == set(SECOND_OFF)
    for feature, key in SECOND_KEYS:  # the key's first switch is a row of FEATURES
        assert features.owner(key) is not None, key


@pytest.mark.parametrize("feature, key", SECOND_KEYS, ids=[k for _, k in SECOND_KEYS])
def test_a_key_whose_second_switch_is_off_is_refused(feature, key):
    """The key's first switch (its family) on, its second off: the key, set to another value, is refused naming
    the second switch; with the second switch on it loads."""
    baseline = SECOND_OFF[feature.needs]
    values = load(*baseline).to_dict()
    assert features.owner(key).on(values) and not feature.on(values)
    with pytest.raises(ConfigError, match=re.escape(f"{key}=") + ".* does nothing without " + re.escape(feature.needs)
                       + r" \(here " + re.escape(feature.state)) as e:
        load(*baseline, f"{key}={_text(_another_value(key))}")
    assert "\n" not in str(e.value)


def test_the_summary_names_the_gated_delta_rule_only_where_layers_run_it():
    assert features.has_gated_deltanet(load("model_name=qwen3-next-80b-a3b").to_dict())
    assert not features.has_gated_deltanet(load("model_name=qwen3-next-80b-a3b",
                                                "inhomogeneous_layer_cycle_interval=1").to_dict())
    runtime = Runtime.from_config(load("model_name=qwen3-next-80b-a3b", "inhomogeneous_layer_cycle_interval=1"), "cpu")
    assert runtime.gdn_kernel == "" and "gated delta" not in runtime.describe()


def test_a_preset_the_user_wrote_names_a_key_that_does_nothing_in_its_model(tmp_path):
    mine = tmp_path / "my-llama4.yml"
    model = "decoder_block: llama4_text\nnum_experts: 4\nnope_layer_interval: 4\n"
    mine.write_text(model + "temperature_tuning_scale: 0.2\n")  # temperature_tuning is off
    with pytest.raises(ConfigError, match=re.escape(f"model_name={mine}: temperature_tuning_scale=0.2 does nothing "
                                                    "without temperature_tuning=true")):
        load(f"model_name={mine}")
    other = tmp_path / "my-llama.yml"
    other.write_text("decoder_block: llama\nglobal_head_dim: 128\n")  # a key no llama reads
    with pytest.raises(ConfigError, match=r"global_head_dim=128 does nothing without decoder_block=gemma4_text"):
        load(f"model_name={other}")
    # its values are its model's defaults: a command line that turns its feature off refuses nothing
    mine.write_text(model + "temperature_tuning: true\ntemperature_tuning_scale: 0.2\n")
    assert load(f"model_name={mine}", "temperature_tuning=false").temperature_tuning_scale == 0.2
    assert load("model_name=llama3.1-8b", "rope_type=default").rope_factor == 8.0  # a packaged one's too


def test_a_key_of_another_command_is_refused_naming_the_command_that_reads_it():
    for key, args in (("compile_topology", ["compile_topology=v5p-8"]), ("compile_report_file", ["compile_report_file=r"]),
                      ("compile_topology_num_slices", ["compile_topology_num_slices=2"])):
        with pytest.raises(ConfigError, match=f"{key}=.* is read by maxtrain.train_compile, not by maxtrain.train: "
                                              "run python -m maxtrain.train_compile with it, or drop"):
            load_config([BASE_YML, *args], command="maxtrain.train")
    assert load_config([BASE_YML, "compile_topology=v5p-8", "compile_topology_num_slices=2", "compile_report_file=r"],
                       command="maxtrain.train_compile").compile_topology_num_slices == 2
    with pytest.raises(ConfigError, match="compiled_trainstep_file='s.bin' is read by maxtrain.train_compile and "
                                          "maxtrain.train, not by maxtrain.decode"):
        load_config([BASE_YML, "compiled_trainstep_file=s.bin"], command="maxtrain.decode")
    assert load_config([BASE_YML, "compiled_trainstep_file=s.bin"], command="maxtrain.train")
    assert load("compile_topology=v5p-8").compile_topology == "v5p-8"  # a library caller names no command


@pytest.mark.parametrize("overrides, said", [
    (["decoder_block=qwen3_moe", "num_experts=4", "decoder_sparse_step=5"], "decoder_sparse_step=5 leaves no layer "
     "of experts among base_num_decoder_layers=4: decoder_block=qwen3_moe would be a dense model; use "
     "decoder_sparse_step <= 4"),
    (["decoder_block=qwen3_moe", "num_experts=4", "decoder_sparse_step=2", "mlp_only_layers=[1,3]"],
     r"decoder_sparse_step=2 with mlp_only_layers=\[1, 3\] leaves no layer of experts"),
    (["decoder_block=llama4_text", "num_experts=4", "decoder_sparse_step=8"], "decoder_sparse_step=8 leaves no layer"),
    (["model_name=qwen3-next-80b-a3b", "base_num_decoder_layers=4", "mlp_only_layers=[0,1,2,3]"],
     r"mlp_only_layers=\[0, 1, 2, 3\] leaves no layer of experts"),
    (["model_name=glm-4.5-air", "first_num_dense_layers=46"], "first_num_dense_layers=46 leaves no layer of experts "
     "among base_num_decoder_layers=46"),
])
def test_rules_that_place_experts_leaving_none_are_refused(overrides, said):
    with pytest.raises(ConfigError, match=said):
        load(*overrides)


def test_the_registry_places_experts_as_each_family_builds_them():
    for preset in config_lib.preset_names():
        for extra in ([], ["decoder_sparse_step=2"], ["mlp_only_layers=[0]"], ["first_num_dense_layers=1"]):
            try:
                cfg = load(f"model_name={preset}", *extra)
            except ConfigError:
                continue  # a placement key the family does not read
            row = registry.FAMILIES[cfg.decoder_block]
            if not row.moe or cfg.num_experts <= 1:
                continue
            built = [t.is_moe for t in Model.bind(cfg).layer_types]
            assert built == row.moe_plan(cfg.base_num_decoder_layers, cfg.to_dict()), (preset, extra)
