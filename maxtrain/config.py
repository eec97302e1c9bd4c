"""Configuration: the only module that knows YAML, overrides and derived values.

    config = load_config(["configs/base.yml", "steps=100", "model_name=gpt2-small"])
    config = with_devices(config, num_devices=8, num_processes=1)   # batch and mesh derivations

`configs/base.yml` is the schema: its keys are the only keys, and the type of each default is the
type an override must have (an int is accepted where a float is expected). A model preset
(`configs/models/<model_name>.yml`, or `model_name=<path of a preset YAML>`) is merged over it, then
the command-line overrides. The result is a frozen `Config`; every check that needs no devices
happens here, before JAX starts.

The configs ship inside the package: a config file named without a directory (`base.yml`) that does
not exist where the command runs is found among the packaged ones, and so are presets; an explicit
path always wins.

This module imports nothing else of maxtrain.
"""

from __future__ import annotations

import datetime
import difflib
import os
from typing import Any, Iterable

import yaml

DECODER_BLOCKS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")  # maxtrain/models/<family>.py
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = ("autoselected", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("autoselected", "full", "minimal", "save_qkv_proj", "save_out_proj", "none")
ATTENTIONS = ("autoselected", "dot_product", "flash", "cudnn")
DATASET_TYPES = ("default", "synthetic", "arrayrecord", "parquet", "jsonl")
PACKING_TYPES = ("concat_then_split", "first_fit")
LR_SCHEDULES = ("cosine", "wsd", "constant")
DECODE_STRATEGIES = ("greedy", "weighted", "topk", "nucleus")
MESH_AXES = ("data", "fsdp", "tensor")
# Downstream tasks (maxtrain/evals/tasks.py defines them; listed here so that a typo fails before any work).
EVAL_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "lambada", "mmlu")
LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers")


class ConfigError(ValueError):
    """A bad config file, key or value. The message names the problem and the fix."""


class Config:
    """Frozen, attribute-access view of the resolved configuration (see configs/base.yml)."""

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(_unknown_key_message(name, self._values)) from None

    def __setattr__(self, name, value):
        raise AttributeError(f"Config is frozen; use config.replace({name}=...) for a changed copy")

    def replace(self, **changes) -> "Config":
        """A copy with `changes` applied (keys must exist). Derived values are not recomputed."""
        for key in changes:
            if key not in self._values:
                raise ConfigError(_unknown_key_message(key, self._values))
        return Config({**self._values, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __contains__(self, key):
        return key in self._values

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"


# --------------------------------------------------------------------------------------------
# Loading and merging
# --------------------------------------------------------------------------------------------


def packaged_configs_dir() -> str:
    """configs/ of the installed package (a wheel puts it at maxtrain/configs; a source checkout has it
    beside the maxtrain/ package)."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "configs")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(here), "configs")


def _find_config(path: str) -> str:
    """`path` itself when it exists, else a packaged config of that name (base.yml, models/x.yml)."""
    if os.path.isfile(path) or os.path.isabs(path):
        return path
    packaged = os.path.join(packaged_configs_dir(), path)
    return packaged if os.path.isfile(packaged) else path


def defaults() -> dict[str, Any]:
    """The packaged base.yml's values (every key's default)."""
    values, _ = _load_with_bases(os.path.join(packaged_configs_dir(), "base.yml"))
    return {k: _coerce(k, v, v, "base.yml") for k, v in values.items()}


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist. Pass a YAML file such as configs/base.yml, or the "
                          f"name of a packaged one (base.yml)")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must be a mapping of key: value, not {type(data).__name__}")
    return data


def _load_with_bases(path: str, seen: tuple[str, ...] = (), given: set | None = None) -> tuple[dict[str, Any], str]:
    """Reads `path`, following `base_config:` chains. Returns (values, directory of the root base).

    `given` collects the keys set by files other than the root base (the user's own YAML)."""
    path = os.path.abspath(_find_config(path))
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(seen + (path,))}")
    data = _read_yaml(path)
    base = data.pop("base_config", None)
    if base is None:
        return data, os.path.dirname(path)
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path) and not os.path.dirname(base):
        base_path = base  # a packaged config by name
    base_values, root_dir = _load_with_bases(base_path, seen + (path,), given)
    for key in data:
        if key not in base_values:
            raise ConfigError(f"{path}: " + _unknown_key_message(key, base_values))
    if given is not None:
        given.update(data)
    return {**base_values, **data}, root_dir


def _unknown_key_message(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "see configs/base.yml for the keys that exist"
    return f"unknown config key {key!r}: {hint}"


def _parse_overrides(args: list[str]) -> dict[str, str]:
    overrides = {}
    for arg in args:
        if "=" not in arg or arg.startswith("="):
            raise ConfigError(f"cannot read argument {arg!r}: overrides are key=value, e.g. steps=100")
        key, value = arg.split("=", 1)
        overrides[key.strip()] = value
    return overrides


def _type_name(value) -> str:
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string",
            list: "a list"}.get(type(value), type(value).__name__)


def _coerce(key: str, raw: Any, default: Any, source: str) -> Any:
    """Converts `raw` (a YAML value, or the text of a command-line override) to default's type."""
    if isinstance(raw, str) and not isinstance(default, str):
        try:
            raw = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            pass
    if isinstance(default, str):
        return "" if raw is None else str(raw)
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
    elif isinstance(default, int):
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif isinstance(default, float):
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):  # YAML 1.1 reads "1e-2" (no dot) as a string
            try:
                return float(raw)
            except ValueError:
                pass
    elif isinstance(default, list):
        if isinstance(raw, list):
            return raw
    elif default is None:
        return raw
    raise ConfigError(f"{source}: {key}={raw!r} has the wrong type; {key} must be {_type_name(default)}, "
                      f"e.g. {key}={yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}")


def load_config(argv: list[str]) -> Config:
    """argv: [yaml_path, key=value, ...]. Returns the validated, frozen config (no device facts yet)."""
    if not argv:
        raise ConfigError("usage: python -m maxtrain.train configs/base.yml [key=value ...]")
    if "=" in argv[0] and not argv[0].endswith((".yml", ".yaml")):
        raise ConfigError(f"the first argument must be a YAML config file (e.g. configs/base.yml), got {argv[0]!r}")
    given: set[str] = set()
    schema, config_dir = _load_with_bases(argv[0], given=given)
    overrides = _parse_overrides(argv[1:])
    for key in overrides:
        if key not in schema:
            raise ConfigError(_unknown_key_message(key, schema))

    values = {k: _coerce(k, v, v, argv[0]) for k, v in schema.items()}
    model_name = _coerce("model_name", overrides.get("model_name", values["model_name"]), "", "override")
    values.update(_load_preset(model_name, schema, config_dir))
    for key, raw in overrides.items():
        values[key] = _coerce(key, raw, schema[key], "command line")
    values["config_path"] = os.path.abspath(_find_config(argv[0]))
    values["run_name_was_generated"] = not values["run_name"]
    # Keys the user chose (their YAML or the command line) rather than base.yml's defaults: a checkpoint's
    # model settings are adopted only where none of the model keys were chosen (checkpoint.adopt_model).
    values["given_keys"] = sorted(given | set(overrides))
    _validate(values)
    return Config(_derive(values))


def preset_names() -> list[str]:
    models_dir = os.path.join(packaged_configs_dir(), "models")
    return sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml")) if os.path.isdir(models_dir) else []


def _load_preset(model_name: str, schema: dict[str, Any], config_dir: str) -> dict[str, Any]:
    """The preset `model_name` names: a path to a YAML file, else configs/models/<model_name>.yml beside
    the base config, else the packaged one."""
    if model_name.endswith((".yml", ".yaml")) or os.sep in model_name:
        path = model_name
        if not os.path.isfile(path):
            raise ConfigError(f"model_name={model_name!r} looks like a preset file but does not exist")
    else:
        path = os.path.join(config_dir, "models", f"{model_name}.yml")
        if not os.path.isfile(path):
            path = os.path.join(packaged_configs_dir(), "models", f"{model_name}.yml")
    if not os.path.isfile(path):
        close = difflib.get_close_matches(model_name, preset_names(), n=1, cutoff=0.6)
        raise ConfigError(f"model_name={model_name!r} is not a preset" + (f" (did you mean {close[0]}?)" if close else "")
                          + f". Presets: {', '.join(preset_names())}; or pass the path of a preset YAML.")
    preset = _read_yaml(path)
    out = {}
    for key, raw in preset.items():
        if key not in schema:
            raise ConfigError(f"{path}: " + _unknown_key_message(key, schema))
        out[key] = _coerce(key, raw, schema[key], path)
    return out


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def _one_of(values, key, allowed):
    _require(values[key] in allowed, f"{key}={values[key]!r} is not allowed; use one of: {', '.join(allowed)}")


def _positive(values, *keys):
    for key in keys:
        _require(values[key] > 0, f"{key}={values[key]} must be > 0")


def _validate(v: dict[str, Any]) -> None:
    _positive(v, "steps", "log_period", "per_device_batch_size", "gradient_accumulation_steps",
              "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
              "base_num_decoder_layers", "head_dim", "vocab_size", "checkpoint_period",
              "rope_max_timescale", "normalization_layer_epsilon", "sa_block_q", "sa_block_kv",
              "loss_scale_initial", "loss_scale_period", "loss_scale_min", "default_corpus_max_mb",
              "distributed_initialization_timeout")
    _require(v["max_target_length"] >= 2, f"max_target_length={v['max_target_length']} must be at least 2")
    _require(v["learning_rate"] >= 0, f"learning_rate={v['learning_rate']} must be >= 0")
    _require(v["base_num_query_heads"] % v["base_num_kv_heads"] == 0,
             f"base_num_query_heads={v['base_num_query_heads']} must be a multiple of base_num_kv_heads="
             f"{v['base_num_kv_heads']} (each kv head serves a whole group of query heads); "
             f"e.g. base_num_kv_heads={_divisor_hint(v['base_num_query_heads'], v['base_num_kv_heads'])}")
    _require(v["head_dim"] % 2 == 0, f"head_dim={v['head_dim']} must be even (RoPE rotates pairs of features)")
    _validate_model(v)
    _one_of(v, "dtype", DTYPES)
    _one_of(v, "weight_dtype", WEIGHT_DTYPES)
    _one_of(v, "remat_policy", REMAT_POLICIES)
    _one_of(v, "attention", ATTENTIONS)
    _one_of(v, "dataset_type", DATASET_TYPES)
    _one_of(v, "grain_packing_type", PACKING_TYPES)
    _require(v["num_epoch"] == -1 or v["num_epoch"] > 0, f"num_epoch={v['num_epoch']} must be > 0, or -1 to repeat forever")
    _require(v["grain_shuffle_window"] >= 1, f"grain_shuffle_window={v['grain_shuffle_window']} must be >= 1 (1 = no shuffle)")
    for key in ("train_data_columns", "eval_data_columns"):
        _require(len(v[key]) == 1 and isinstance(v[key][0], str),
                 f"{key}={v[key]!r} must name exactly one text field, e.g. {key}=[text]")
    _one_of(v, "lr_schedule_type", LR_SCHEDULES)
    for key in ("warmup_steps_fraction", "cosine_learning_rate_final_fraction", "wsd_decay_steps_fraction",
                "eval_split_fraction"):
        _require(0.0 <= v[key] <= 1.0, f"{key}={v[key]} must be between 0 and 1")
    _require(0.0 < v["eval_split_fraction"] < 1.0 or v["dataset_type"] != "default",
             f"eval_split_fraction={v['eval_split_fraction']} must be strictly between 0 and 1 for the default corpus")
    _require(0.0 <= v["adam_b1"] < 1.0 and 0.0 <= v["adam_b2"] < 1.0, "adam_b1 and adam_b2 must be in [0, 1)")
    _require(v["gradient_clipping_threshold"] >= 0, "gradient_clipping_threshold must be >= 0 (0 disables clipping)")
    _require(v["eval_steps"] == -1 or v["eval_steps"] > 0, f"eval_steps={v['eval_steps']} must be > 0, or -1 for one epoch")
    _require(v["eval_interval"] == -1 or v["eval_interval"] > 0,
             f"eval_interval={v['eval_interval']} must be > 0, or -1 for no evaluation")
    _require(v["max_num_checkpoints_to_keep"] == -1 or v["max_num_checkpoints_to_keep"] > 0,
             f"max_num_checkpoints_to_keep={v['max_num_checkpoints_to_keep']} must be > 0, or -1 to keep all")
    _require(v["max_new_tokens"] >= 0, f"max_new_tokens={v['max_new_tokens']} must be >= 0")
    _require(v["viz_period"] == -1 or v["viz_period"] > 0, f"viz_period={v['viz_period']} must be > 0, or -1 for none")
    _positive(v, "viz_num_samples", "decode_sampling_temperature", "decode_sampling_top_k")
    _one_of(v, "decode_sampling_strategy", DECODE_STRATEGIES)
    _require(0.0 < v["decode_sampling_nucleus_p"] <= 1.0,
             f"decode_sampling_nucleus_p={v['decode_sampling_nucleus_p']} must be in (0, 1]")
    parse_eval_tasks(v["eval_tasks"], v["eval_tasks_num_fewshot"])
    _require(v["eval_tasks_interval"] == -1 or v["eval_tasks_interval"] > 0,
             f"eval_tasks_interval={v['eval_tasks_interval']} must be > 0, or -1 for the end of training only")
    for key in ("eval_tasks_max_examples", "eval_tasks_max_target_length", "eval_tasks_per_device_batch_size"):
        _require(v[key] == -1 or v[key] > 0, f"{key}={v[key]} must be > 0, or -1 for its default")
    _require(v["eval_tasks_max_target_length"] == -1 or v["eval_tasks_max_target_length"] >= 2,
             f"eval_tasks_max_target_length={v['eval_tasks_max_target_length']} must be at least 2")
    if v["dataset_type"] in ("arrayrecord", "parquet", "jsonl"):
        _require(bool(v["grain_train_files"]),
                 f"dataset_type={v['dataset_type']} needs grain_train_files=<glob of {v['dataset_type']} files>")
    if v["load_parameters_path"] and v["load_full_state_path"]:
        raise ConfigError("set only one of load_parameters_path (params only) and load_full_state_path (whole state)")
    for prefix in ("ici", "dcn"):
        for axis in MESH_AXES:
            key = f"{prefix}_{axis}_parallelism"
            _require(v[key] == -1 or v[key] >= 1, f"{key}={v[key]} must be >= 1, or -1 to fill the remaining devices")
        fills = [a for a in MESH_AXES if v[f"{prefix}_{a}_parallelism"] == -1]
        _require(len(fills) <= 1, f"only one {prefix}_*_parallelism may be -1, got {', '.join(fills)}")
    _validate_rules(v["logical_axis_rules"])
    tp = v["ici_tensor_parallelism"] * v["dcn_tensor_parallelism"]
    if tp > 1:
        for key in ("base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "vocab_size"):
            _require(v[key] % tp == 0,
                     f"tensor parallelism {tp} (ici_tensor_parallelism x dcn_tensor_parallelism) must divide "
                     f"{key}={v[key]}; use a tensor parallelism that divides it, e.g. "
                     f"ici_tensor_parallelism={_divisor_hint(v[key], tp)}")


def parse_eval_tasks(spec: str, num_fewshot: int = 0) -> dict[str, int]:
    """`eval_tasks` -> {task: few-shot count}: "hellaswag,mmlu:5" -> {"hellaswag": num_fewshot, "mmlu": 5}."""
    _require(num_fewshot >= 0, f"eval_tasks_num_fewshot={num_fewshot} must be >= 0")
    tasks: dict[str, int] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, _, shots = item.partition(":")
        name = name.strip()
        if name not in EVAL_TASKS:
            close = difflib.get_close_matches(name, EVAL_TASKS, n=1)
            raise ConfigError(f"eval_tasks: unknown task {name!r}" + (f"; did you mean {close[0]}?" if close else "")
                              + f" Tasks: {', '.join(EVAL_TASKS)}")
        _require(name not in tasks, f"eval_tasks names {name} twice")
        if shots:
            _require(shots.strip().isdigit(), f"eval_tasks: {item!r} must be task:N with N a number of few-shot "
                                              f"examples, e.g. {name}:5")
        tasks[name] = int(shots) if shots else num_fewshot
    return tasks


def _validate_model(v: dict[str, Any]) -> None:
    _one_of(v, "decoder_block", DECODER_BLOCKS)
    _one_of(v, "rope_type", ROPE_TYPES)
    _positive(v, "rope_factor", "original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow")
    if v["rope_type"] == "llama3":
        _require(v["rope_high_freq_factor"] > v["rope_low_freq_factor"] > 0,
                 f"rope_type=llama3 needs rope_high_freq_factor > rope_low_freq_factor > 0, got "
                 f"{v['rope_high_freq_factor']} and {v['rope_low_freq_factor']} (Llama 3.1 uses 4.0 and 1.0)")
    for key in ("local_rope_max_timescale", "query_pre_attn_scalar", "rope_attention_factor"):
        _require(v[key] == -1 or v[key] > 0, f"{key}={v[key]} must be > 0, or -1 for the default")
    for key in ("sliding_window_size", "attn_logits_soft_cap", "final_logits_soft_cap"):
        _require(v[key] >= 0, f"{key}={v[key]} must be >= 0 (0 turns it off)")
    types = v["attention_layer_types"]
    if types:
        _require(len(types) == v["base_num_decoder_layers"] and all(t in ("full", "sliding") for t in types),
                 f"attention_layer_types must list \"full\" or \"sliding\" for each of the "
                 f"{v['base_num_decoder_layers']} layers (or be [] for the family's pattern), got {types}")
        _require("sliding" not in types or v["sliding_window_size"] > 0,
                 "attention_layer_types has sliding layers but sliding_window_size=0; set sliding_window_size")


def _divisor_hint(n: int, near: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), d))


def _validate_rules(rules) -> None:
    _require(isinstance(rules, list), "logical_axis_rules must be a list of [logical_axis, mesh_axes] pairs")
    for rule in rules:
        _require(isinstance(rule, list) and len(rule) == 2,
                 f"logical_axis_rules entry {rule!r} must be a pair [logical_axis, mesh_axes]")
        name, mesh_axes = rule
        _require(name in LOGICAL_AXES, f"logical_axis_rules: unknown logical axis {name!r}; known: {', '.join(LOGICAL_AXES)}")
        axes = [] if mesh_axes is None else [mesh_axes] if isinstance(mesh_axes, str) else mesh_axes
        for axis in axes:
            _require(axis in MESH_AXES, f"logical_axis_rules: {name!r} maps to unknown mesh axis {axis!r}; "
                                        f"mesh axes are {', '.join(MESH_AXES)}")


# --------------------------------------------------------------------------------------------
# Derived values
# --------------------------------------------------------------------------------------------


def _derive(v: dict[str, Any]) -> dict[str, Any]:
    """Values computed from the config alone, in one place."""
    if not v["run_name"]:
        v["run_name"] = "run_" + datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    v["run_dir"] = os.path.join(v["base_output_directory"], v["run_name"])
    v["checkpoint_dir"] = os.path.join(v["run_dir"], "checkpoints")
    v["tensorboard_dir"] = os.path.join(v["run_dir"], "tensorboard")
    v["metadata_dir"] = os.path.join(v["run_dir"], "metadata")
    v["cache_dir"] = v["dataset_cache_dir"] or os.path.join(v["base_output_directory"], "cache")
    schedule = v["learning_rate_schedule_steps"]
    v["schedule_steps"] = v["steps"] if schedule == -1 else schedule
    v["warmup_steps"] = int(v["warmup_steps_fraction"] * v["schedule_steps"])
    v["tokens_per_sequence"] = v["max_target_length"]
    return v


def revalidate(config: Config) -> Config:
    """Checks a config again after values were replaced (e.g. a checkpoint's model settings adopted)."""
    values = config.to_dict()
    _validate(values)
    return Config(values)


def with_devices(config: Config, num_devices: int, num_processes: int = 1) -> Config:
    """Adds the values that depend on the devices: global batch and tokens per step."""
    if num_processes > 1 and config.run_name_was_generated:
        raise ConfigError("multi-process runs need an explicit run_name=... so that every process writes "
                          "to, and resumes from, the same run directory")
    micro_batch = config.per_device_batch_size * num_devices
    global_batch = micro_batch * config.gradient_accumulation_steps
    return Config({**config.to_dict(), "num_devices": num_devices, "num_processes": num_processes,
                   "micro_batch_size": micro_batch, "global_batch_size": global_batch,
                   "tokens_per_step": global_batch * config.max_target_length})
