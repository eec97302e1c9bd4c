"""Configuration: the only module that knows YAML, overrides and derived values.

    config = load_config(["configs/base.yml", "steps=100", "model_name=gpt2-small"])
    config = with_devices(config, num_devices=8, num_processes=1)   # batch and mesh derivations

maxtrain's own `configs/base.yml` is the schema (settings.py reads it as the settings table): its
keys are the only keys, the type of each default is the type a value must have (an int is accepted
where a float is expected), and the `{...}` at the start of each comment is the values it allows.
The YAML file given first is merged over it (following its `base_config:` chain; a file without one
inherits base.yml, and says so once), then the model preset (`configs/models/<model_name>.yml`, or
`model_name=<path of a preset YAML>`), then the command-line overrides. The whole result is checked against the table and the named
cross-key checks below, and frozen into a `Config`; every check that needs no devices happens here,
before JAX starts.

The configs ship inside the package: a config file named without a directory (`base.yml`) that does
not exist where the command runs is found among the packaged ones, and so are presets; an explicit
path always wins.

This module imports nothing else of maxtrain but the settings table and the error types.
"""

from __future__ import annotations

import datetime
import difflib
import importlib.util
import os
import sys
from typing import Any, Iterable

import yaml

from maxtrain import settings as settings_lib
from maxtrain.errors import ConfigError  # noqa: F401 (re-exported: config.ConfigError)

# The device mesh's axes, declared once, outermost first (the last axis gets the closest devices): each
# mesh axis and the stem of its two config keys, ici_<stem>_parallelism (inside a slice) and
# dcn_<stem>_parallelism (across slices). sharding.py builds the mesh from this table; validation,
# errors and docs/parallelism.md read it. What each axis does:
#   data     replicas of the model, each on its own rows of the batch
#   stage    pipeline stages: contiguous runs of layers, micro-batches passed stage to stage (models/pipeline.py)
#   fsdp     rows of the batch, with parameters and optimizer state sharded and gathered per layer
#   context  the sequence: each device holds pieces of every row; attention gathers keys and values
#            (context_parallel.py)
#   expert   mixture-of-experts experts (issue 11); batch rows on models without experts
#   tensor   heads, MLP width and vocabulary: every matmul split, activations reduced per layer
MESH_AXES = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "context": "context", "expert": "expert",
             "tensor": "tensor"}


def parallelism_key(prefix: str, axis: str) -> str:
    """The config key of mesh axis `axis` inside a slice (prefix "ici") or across slices ("dcn")."""
    return f"{prefix}_{MESH_AXES[axis]}_parallelism"


# Downstream tasks (maxtrain/evals/tasks.py defines them; listed here so that a typo fails before any work).
EVAL_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "lambada", "mmlu")
LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "exp")
MOE_DECODER_BLOCKS = ("mixtral", "qwen3_moe")  # families whose layers may be mixtures of experts
# Keys that are not settings: added by load_config and _derive, ignored when runs are compared.
_DERIVED = ("config_path", "run_name_was_generated", "given_keys", "run_dir", "checkpoint_dir", "tensorboard_dir", "metadata_dir",
            "cache_dir", "schedule_steps", "warmup_steps", "tokens_per_sequence")


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


# maxtrain's own base.yml: the settings table.
BASE_CONFIG = os.path.join(packaged_configs_dir(), "base.yml")


def _find_config(path: str) -> str:
    """`path` itself when it exists, else a packaged config of that name (base.yml, models/x.yml)."""
    if "\x00" in path:
        raise ConfigError(f"config file {path!r} is not a usable path (it contains a NUL character). "
                          "Pass a YAML file such as configs/base.yml.")
    if os.path.isfile(path) or os.path.isabs(path):
        return path
    packaged = os.path.join(packaged_configs_dir(), path)
    return packaged if os.path.isfile(packaged) else path


_TABLES: dict[str, dict[str, settings_lib.Setting]] = {}


def table(path: str = BASE_CONFIG) -> dict[str, settings_lib.Setting]:
    """The settings table of base.yml (read once per process)."""
    path = os.path.realpath(path)
    if path not in _TABLES:
        _TABLES[path] = settings_lib.read_table(path)
    return _TABLES[path]


def defaults() -> dict[str, Any]:
    """The packaged base.yml's values (every key's default)."""
    return {k: s.default for k, s in table().items()}


def _load_chain(path: str, schema: dict, seen: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """A user YAML file merged over its `base_config:` chain. Returns (values, notes to print)."""
    path = os.path.abspath(_find_config(path))
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(seen + (path,))}")
    if os.path.realpath(path) == os.path.realpath(BASE_CONFIG):
        return {}, []
    data, _ = settings_lib.read_mapping(path)
    base = data.pop("base_config", None)
    for key in data:
        if key not in schema:
            raise ConfigError(f"{path}: " + _unknown_key_message(key, schema))
    if base is None:
        note = (f"note: {path} has no base_config, so it is applied over {BASE_CONFIG} (add "
                "`base_config: base.yml` to say so)")
        return data, [note]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base_config={base!r} must name a YAML file, e.g. base_config: base.yml")
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path) and os.path.isfile(os.path.join(packaged_configs_dir(), base)):
        base_path = os.path.join(packaged_configs_dir(), base)  # a name in maxtrain's configs/
    if not os.path.isfile(base_path):
        raise ConfigError(f"{path}: base_config {base!r} does not exist (looked for {os.path.abspath(base_path)}); "
                          "use base_config: base.yml, or a path relative to this file")
    values, notes = _load_chain(base_path, schema, seen + (path,))
    return {**values, **data}, notes


def _unknown_key_message(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "see configs/base.yml for the keys that exist"
    return f"unknown config key {key!r}: {hint}"


def parse_overrides(args: list[str]) -> dict[str, str]:
    """key=value arguments -> {key: value text}; a key given twice is an error (settings.unique)."""
    assignments = []
    for i, arg in enumerate(args):
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"cannot read argument {arg!r}: overrides are key=value, e.g. steps=100")
        assignments.append((key.strip(), value, f"argument {i + 2}: {arg!r}"))
    return settings_lib.unique(assignments, "the command line")


def with_overrides(argv: list[str], *overrides: str) -> list[str]:
    """argv with key=value `overrides` replacing the same keys' earlier values (or appended).

    For programs and tests that compose a command line; a person typing one key twice is refused.
    """
    keys = {o.partition("=")[0].strip() for o in overrides}
    return [a for a in argv if "=" not in a or a.partition("=")[0].strip() not in keys] + list(overrides)


def _type_name(value) -> str:
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string",
            list: "a list"}.get(type(value), type(value).__name__)


def _example(default) -> str:
    return yaml.safe_dump(default, default_flow_style=True, width=1_000_000).strip().removesuffix("...").strip()


def _coerce(key: str, raw: Any, default: Any, source: str) -> Any:
    """Converts `raw` (a YAML value, or the text of a command-line override) to default's type."""
    if isinstance(raw, str) and not isinstance(default, str):
        try:
            raw = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            pass
    if isinstance(default, str):
        if raw is None:
            return ""
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
    elif isinstance(default, bool):
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
        if isinstance(raw, str):  # YAML 1.1 reads "1e-2" (no dot) as a string; also "nan", "inf"
            try:
                return float(raw)
            except ValueError:
                pass
    elif isinstance(default, list):
        if isinstance(raw, list):
            return raw
    elif default is None:
        return raw
    shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:77] + "..."
    raise ConfigError(f"{source}: {key}={shown} has the wrong type; {key} must be {_type_name(default)}, "
                      f"e.g. {key}={_example(default)}")


def _process_id_hint(values: dict, overrides: dict) -> int:
    """This process' id as far as the config tells (for printing notes once, before JAX starts)."""
    for raw in (overrides.get("process_id"), os.environ.get("MAXTRAIN_PROCESS_ID"), os.environ.get("SLURM_PROCID")):
        try:
            if raw is not None and str(raw).strip():
                return int(str(raw).strip())
        except ValueError:
            pass
    return values.get("process_id", -1)


def load_config(argv: list[str], log=None) -> Config:
    """argv: [yaml_path, key=value, ...]. Returns the validated, frozen config (no device facts yet).

    `log` receives the notes (e.g. a YAML file without base_config); default: stderr, process 0 only.
    """
    if not argv:
        raise ConfigError("usage: python -m maxtrain.train configs/base.yml [key=value ...]")
    if "=" in argv[0] and not argv[0].endswith((".yml", ".yaml")):
        raise ConfigError(f"the first argument must be a YAML config file (e.g. configs/base.yml), got {argv[0]!r}")
    schema = table()
    overrides = parse_overrides(argv[1:])
    for key in overrides:
        if key not in schema:
            raise ConfigError(_unknown_key_message(key, schema))
    chain, notes = _load_chain(argv[0], schema)

    values = {k: s.default for k, s in schema.items()}
    values.update({k: _coerce(k, v, schema[k].default, argv[0]) for k, v in chain.items()})
    model_name = _coerce("model_name", overrides.get("model_name", values["model_name"]), "", "override")
    values.update(_load_preset(model_name, schema, os.path.dirname(os.path.abspath(_find_config(argv[0])))))
    for key, raw in overrides.items():
        values[key] = _coerce(key, raw, schema[key].default, "command line")
    values["config_path"] = os.path.abspath(_find_config(argv[0]))
    values["run_name_was_generated"] = not values["run_name"]
    # Keys the user chose (their YAML or the command line) rather than base.yml's defaults: a checkpoint's
    # model settings are adopted only where none of the model keys were chosen (checkpoint_files.adopt_model_settings).
    values["given_keys"] = sorted(set(chain) | set(overrides))
    validate(values)
    if notes:
        if log is None and _process_id_hint(values, overrides) <= 0:
            log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        for note in notes:
            (log or (lambda _: None))(note)
    return Config(_derive(values))


def preset_names() -> list[str]:
    models_dir = os.path.join(packaged_configs_dir(), "models")
    return sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml")) if os.path.isdir(models_dir) else []


def _load_preset(model_name: str, schema: dict, config_dir: str) -> dict[str, Any]:
    """The preset `model_name` names: a path to a YAML file, else configs/models/<model_name>.yml beside
    the config file, else the packaged one."""
    if model_name.endswith((".yml", ".yaml")) or os.sep in model_name:
        path = model_name
        if not os.path.isfile(path):
            raise ConfigError(f"model_name={model_name!r} looks like a preset file but does not exist")
    else:
        path = os.path.join(config_dir, "models", f"{model_name}.yml")
        if not os.path.isfile(path):
            path = os.path.join(packaged_configs_dir(), "models", f"{model_name}.yml")
    if not model_name or not os.path.isfile(path):
        close = difflib.get_close_matches(model_name, preset_names(), n=1, cutoff=0.6)
        raise ConfigError(f"model_name={model_name!r} is not a preset" + (f" (did you mean {close[0]}?)" if close else "")
                          + f". Presets: {', '.join(preset_names())}; or pass the path of a preset YAML.")
    preset, _ = settings_lib.read_mapping(path)
    out = {}
    for key, raw in preset.items():
        if key not in schema:
            raise ConfigError(f"{path}: " + _unknown_key_message(key, schema))
        out[key] = _coerce(key, raw, schema[key].default, path)
    return out


# --------------------------------------------------------------------------------------------
# Validation: every key against the table, then the rules that relate several keys
# --------------------------------------------------------------------------------------------


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def validate(v: dict[str, Any]) -> None:
    """The whole resolved config: each key's allowed values (the table), then the named checks."""
    for name, setting in table().items():
        settings_lib.check_value(setting, v[name])
    for check in CHECKS:
        check(v)


def _heads_divisible_by_kv_heads(v):
    _require(v["base_num_query_heads"] % v["base_num_kv_heads"] == 0,
             f"base_num_query_heads={v['base_num_query_heads']} must be a multiple of base_num_kv_heads="
             f"{v['base_num_kv_heads']} (each kv head serves a whole group of query heads); "
             f"e.g. base_num_kv_heads={_divisor_hint(v['base_num_query_heads'], v['base_num_kv_heads'])}")


def _head_dim_even(v):
    _require(v["head_dim"] % 2 == 0, f"head_dim={v['head_dim']} must be even (RoPE rotates pairs of features)")



def _vocab_tiling_divides_length(v):
    _require(v["num_vocab_tiling"] == -1 or v["max_target_length"] % v["num_vocab_tiling"] == 0,
             f"num_vocab_tiling={v['num_vocab_tiling']} must divide max_target_length={v['max_target_length']} "
             "(the sequence is cut into that many chunks)")


def _flash_blocks_powers_of_two(v):
    for key in ("sa_block_q", "sa_block_kv"):
        _require(v[key] & (v[key] - 1) == 0, f"{key}={v[key]} must be a power of two (16, 32, 64, 128, ...)")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
CHAT_TEMPLATES = ("chatml", "llama3", "plain")  # maxtrain/data/chat.py: built-in templates


def _one_objective(v):
    _require(not (v["use_sft"] and v["use_dpo"]),
             "use_sft=true and use_dpo=true were both set; a run has one objective. Run SFT first, then DPO from its "
             "checkpoint with load_parameters_path=<the SFT run>")


def _data_columns(v):
    """One text field for pre-training; SFT and DPO name the fields of their records (docs/post_training.md)."""
    wanted = {"sft": (["messages"], ["prompt", "completion"]), "dpo": (["prompt", "chosen", "rejected"],)}
    kind = "sft" if v["use_sft"] else "dpo" if v["use_dpo"] else None
    for key in ("train_data_columns", "eval_data_columns"):
        columns = v[key]
        _require(all(isinstance(c, str) and c for c in columns),
                 f"{key}={columns!r} must be a list of field names, e.g. {key}=[text]")
        if kind is None:
            _require(len(columns) == 1, f"{key}={columns!r} must name exactly one text field, e.g. {key}=[text]")
            continue
        shapes = ["[" + ",".join(c) + "]" for c in wanted[kind]]
        _require(len(columns) in {len(c) for c in wanted[kind]},
                 f"use_{kind}=true reads {'conversations' if kind == 'sft' else 'preference pairs'}, but {key}="
                 f"{columns!r}; set {key}={shapes[0]} (the names of your fields, in that order)"
                 + (f", or {shapes[1]}" if kind == "sft" else ""))
        _require(v["dataset_type"] in ("jsonl", "parquet"),
                 f"use_{kind}=true reads jsonl or parquet files, but dataset_type={v['dataset_type']}; set "
                 f"dataset_type=jsonl (or parquet) and grain_train_files=<your files>")


def _chat_template_known(v):
    _require(v["chat_template"] in ("",) + CHAT_TEMPLATES,
             f"chat_template={v['chat_template']!r} is not a built-in template; use one of {', '.join(CHAT_TEMPLATES)}, "
             "or \"\" for the tokenizer's own")


def _lora_targets_known(v):
    targets = v["lora_target_modules"]
    _require(len(targets) > 0 and all(t in LORA_TARGETS for t in targets) and len(set(targets)) == len(targets),
             f"lora_target_modules={targets!r} must list distinct projections among {', '.join(LORA_TARGETS)} "
             "(q, k, v, o: attention; gate, up, down: MLP)")


def _llama3_rope_factors(v):
    if v["rope_type"] == "llama3":
        _require(v["rope_high_freq_factor"] > v["rope_low_freq_factor"] > 0,
                 f"rope_type=llama3 needs rope_high_freq_factor > rope_low_freq_factor > 0, got "
                 f"{v['rope_high_freq_factor']} and {v['rope_low_freq_factor']} (Llama 3.1 uses 4.0 and 1.0)")


def _attention_layer_types(v):
    types = v["attention_layer_types"]
    if types:
        _require(len(types) == v["base_num_decoder_layers"] and all(t in ("full", "sliding") for t in types),
                 f"attention_layer_types must list \"full\" or \"sliding\" for each of the "
                 f"{v['base_num_decoder_layers']} layers (or be [] for the family's pattern), got {types}")
        _require("sliding" not in types or v["sliding_window_size"] > 0,
                 "attention_layer_types has sliding layers but sliding_window_size=0; set sliding_window_size")


def _experts_per_token_at_most_experts(v):
    e, k = v["num_experts"], v["num_experts_per_tok"]
    _require(k <= e, f"num_experts_per_tok={k} is more than num_experts={e}: each token is routed to "
                     f"num_experts_per_tok distinct experts; use num_experts_per_tok <= {e}")


def _moe_layers_of_the_family(v):
    layers = v["mlp_only_layers"]
    _require(all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < v["base_num_decoder_layers"]
                 for i in layers),
             f"mlp_only_layers={layers} must list layer indices in [0, {v['base_num_decoder_layers'] - 1}]")
    block, e = v["decoder_block"], v["num_experts"]
    if block not in MOE_DECODER_BLOCKS:
        _require(e == 1, f"decoder_block={block} has no experts, but num_experts={e}; use decoder_block=mixtral or "
                         "qwen3_moe for a mixture of experts, or num_experts=1")
    if block == "mixtral":
        _require(v["decoder_sparse_step"] == 1 and not layers,
                 "decoder_block=mixtral has experts in every layer; decoder_sparse_step and mlp_only_layers are "
                 "qwen3_moe settings (use decoder_block=qwen3_moe to mix dense and MoE layers)")
        _require(v["norm_topk_prob"], "decoder_block=mixtral always renormalizes its top-k router weights; "
                                      "norm_topk_prob=false is a qwen3_moe setting")


def _expert_parallelism_divides_experts(v):
    ici, dcn, e = v["ici_expert_parallelism"], v["dcn_expert_parallelism"], v["num_experts"]
    ep = ici * dcn
    if ici > 0 and dcn > 0 and e % ep:  # -1 (fill) is resolved with the devices; the mesh checks it then
        raise ConfigError(f"expert parallelism {ep} (ici_expert_parallelism x dcn_expert_parallelism) must divide "
                          f"num_experts={e}: each device holds num_experts / {ep} whole experts; e.g. "
                          f"ici_expert_parallelism={_divisor_hint(e, ep)}")


def _default_corpus_needs_eval_split(v):
    _require(0.0 < v["eval_split_fraction"] < 1.0 or v["dataset_type"] != "default",
             f"eval_split_fraction={v['eval_split_fraction']} must be strictly between 0 and 1 for the default corpus")


def _files_for_file_datasets(v):
    if v["dataset_type"] in ("arrayrecord", "parquet", "jsonl"):
        _require(bool(v["grain_train_files"].strip()),
                 f"dataset_type={v['dataset_type']} needs grain_train_files=<glob of {v['dataset_type']} files>")


def _one_starting_point(v):
    _require(not (v["load_parameters_path"] and v["load_full_state_path"]),
             "set only one of load_parameters_path (params only) and load_full_state_path (whole state)")


def _one_filled_mesh_axis(v):
    for prefix in ("ici", "dcn"):
        fills = [parallelism_key(prefix, a) for a in MESH_AXES if v[parallelism_key(prefix, a)] == -1]
        _require(len(fills) <= 1, f"only one {prefix}_*_parallelism may be -1, got {', '.join(fills)}")


def _ways(v: dict[str, Any], axis: str) -> int | None:
    """How many ways `axis` splits (ici x dcn), or None while one of them is -1 (known with the devices)."""
    ici, dcn = v[parallelism_key("ici", axis)], v[parallelism_key("dcn", axis)]
    return None if -1 in (ici, dcn) else ici * dcn


def _stages_divide_layers(v):
    """Each pipeline stage holds the same number of layers (sharding.create_mesh checks again once -1 is
    resolved)."""
    stages, layers = _ways(v, "stage"), v["base_num_decoder_layers"]
    if stages and stages > 1:
        _require(layers % stages == 0,
                 f"pipeline parallelism {stages} (ici_pipeline_parallelism x dcn_pipeline_parallelism) must divide "
                 f"base_num_decoder_layers={layers}: each stage holds the same number of layers; e.g. "
                 f"ici_pipeline_parallelism={_divisor_hint(layers, stages)}")


def _no_pipeline_stages_with_experts(v):
    """Mixture-of-experts layers run their own shard_map over the expert axis, and report per-layer
    figures; neither is wired through a pipeline stage yet."""
    stages = _ways(v, "stage")
    _require(v["decoder_block"] not in MOE_DECODER_BLOCKS or stages == 1,
             f"decoder_block={v['decoder_block']} (mixture of experts) does not run with pipeline parallelism yet; "
             "set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1 (use expert, fsdp or tensor parallelism)")


def _context_chunks_divide_length(v):
    """Context parallelism cuts each sequence into 2 chunks per device (one early, one late)."""
    cp, length = _ways(v, "context"), v["max_target_length"]
    if cp and cp > 1:
        _require(length % (2 * cp) == 0,
                 f"context parallelism {cp} (ici_context_parallelism x dcn_context_parallelism) splits each sequence "
                 f"into {2 * cp} chunks (two per device, one early and one late, so that causal attention's work is "
                 f"even), so max_target_length={length} must be a multiple of {2 * cp}; e.g. max_target_length="
                 f"{max(2 * cp, length // (2 * cp) * 2 * cp)}")


def _tensor_parallelism_divides(v):
    tp = v["ici_tensor_parallelism"] * v["dcn_tensor_parallelism"]
    if tp > 1:
        for key in ("base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "vocab_size"):
            _require(v[key] % tp == 0,
                     f"tensor parallelism {tp} (ici_tensor_parallelism x dcn_tensor_parallelism) must divide "
                     f"{key}={v[key]}; use a tensor parallelism that divides it, e.g. "
                     f"ici_tensor_parallelism={_divisor_hint(v[key], tp)}")


def _coordinator_address(v):
    if v["coordinator_address"]:
        split_address(v["coordinator_address"], "coordinator_address")
    if v["num_processes"] > 0 and v["process_id"] >= 0:
        _require(v["process_id"] < v["num_processes"],
                 f"process_id={v['process_id']} must be in [0, num_processes={v['num_processes']})")


def _metrics_file_is_a_file_path(v):
    path = v["metrics_file"]
    _require(not path or not path.endswith(("/", os.sep)),
             f"metrics_file={path!r} names a directory; give a file path, e.g. metrics_file=outputs/metrics.jsonl")


def _eval_tasks_known(v):
    parse_eval_tasks(v["eval_tasks"], v["eval_tasks_num_fewshot"])


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


def split_address(address: str, key: str = "coordinator_address") -> tuple[str, int]:
    """host:port -> (host, port), or a ConfigError naming the key, the value and the fix."""
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{key}={address!r} must be host:port, e.g. 10.0.0.2:1234")
    if not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}={address!r}: port {port} is outside 1-65535; use a free port such as 8476")
    return host.strip("[]"), int(port)


# The rules a per-key range cannot express, each a function of the resolved values.
def _optional_packages_installed(v):
    _require(not v["enable_wandb"] or importlib.util.find_spec("wandb") is not None,
             "enable_wandb=true needs the wandb package: pip install 'maxtrain[wandb]' (or set enable_wandb=false)")
    remote = [k for k in ("base_output_directory", "dataset_cache_dir", "metrics_file", "grain_train_files",
                          "grain_eval_files", "load_parameters_path", "load_full_state_path") if v[k].startswith("gs://")]
    _require(not remote or importlib.util.find_spec("gcsfs") is not None,
             f"{remote[0] if remote else ''} is on gs://, which needs gcsfs: pip install 'maxtrain[gcs]'")


def _known_profiler(v):
    _require(v["profiler"] in ("", "xplane"), f"profiler={v['profiler']!r} is not supported; use profiler=xplane "
                                               "(a jax.profiler trace, as MaxText) or leave it empty")


CHECKS = (_heads_divisible_by_kv_heads, _head_dim_even, _vocab_tiling_divides_length, _llama3_rope_factors, _attention_layer_types,
          _flash_blocks_powers_of_two, _one_objective, _data_columns, _chat_template_known, _lora_targets_known,
          _default_corpus_needs_eval_split, _files_for_file_datasets, _one_starting_point, _one_filled_mesh_axis,
          _stages_divide_layers, _no_pipeline_stages_with_experts, _context_chunks_divide_length,
          lambda v: _validate_rules(v["logical_axis_rules"]), _tensor_parallelism_divides, _coordinator_address,
          _metrics_file_is_a_file_path, _optional_packages_installed, _known_profiler,
          _experts_per_token_at_most_experts, _moe_layers_of_the_family, _expert_parallelism_divides_experts, _eval_tasks_known)


def _divisor_hint(n: int, near: int) -> int:
    divisors = [d for d in range(1, min(n, 100_000) + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), d))


def _validate_rules(rules) -> None:
    _require(isinstance(rules, list), "logical_axis_rules must be a list of [logical_axis, mesh_axes] pairs")
    for rule in rules:
        _require(isinstance(rule, list) and len(rule) == 2,
                 f"logical_axis_rules entry {rule!r} must be a pair [logical_axis, mesh_axes]")
        name, mesh_axes = rule
        _require(isinstance(name, str) and (name in LOGICAL_AXES or name.removeprefix("activation_") in LOGICAL_AXES),
                 f"logical_axis_rules: unknown logical axis {name!r}; known: {', '.join(LOGICAL_AXES)} "
                 "(and activation_<axis> for activations placed apart from parameters)")
        axes = [] if mesh_axes is None else [mesh_axes] if isinstance(mesh_axes, str) else mesh_axes
        _require(isinstance(axes, list), f"logical_axis_rules: {name!r} maps to {mesh_axes!r}; give a mesh axis, "
                                         "a list of them, or null")
        for axis in axes:
            _require(isinstance(axis, str) and axis in MESH_AXES,
                     f"logical_axis_rules: {name!r} maps to unknown mesh axis {axis!r}; "
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
    validate(values)
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
