"""Which settings belong to which feature, and what a family is: nothing a user sets is silently ignored.

    features.FEATURES                  # Feature(needs, on, keys): a switch, its predicate, the keys it owns
    features.owner("distill_alpha")    # the Feature whose keys include it
    features.layer_attention(values)   # ["sliding", "full", ...]: each layer's attention, as the model builds it

Two rules, each over one declared table:

- `FEATURES` (the features with a switch: each objective's keys and its data kind's, LoRA, Muon, float16 loss scaling,
  fp8, multi-token prediction, mixtures of experts, each family's own settings, RoPE scaling, sliding
  windows, sampling, the profiler, ...): a key of a feature that is off, set by the user to anything but
  its base.yml default, is refused, naming the key, the switch and the fix. `REQUIRES` holds the second
  switches: a key of a feature that is on whose effect depends on another switch of it (Llama 4's
  temperature_tuning_scale without temperature_tuning, the gated delta rule's settings without its layers,
  the grouped matmul without the dropless dispatch). A packaged model preset's values are the model's
  defaults (loading.py records them as `preset_keys`), so a preset that sets a feature's keys loads, and
  turning the preset's feature off (rope_type=default on llama3.1-8b) refuses nothing; a preset the user
  wrote (model_name=<path>) is checked as the model it describes (preset_settings_that_do_nothing).
- `COMMAND_KEYS`: a key only some commands read (compile_topology: maxtrain.train_compile), set where another
  command runs, is refused naming the command that reads it.
- each family's defining settings (registry.Family.usual): a family whose layers slide (its pattern, or
  attention_layer_types) with sliding_window_size=0, or a mixture-of-experts family with num_experts=1,
  would silently be another model (full attention, a dense MLP); refused with the family's usual value.
- each family's fixed settings (registry.Family.fixed: deepseek_v4's balance and z-loss weights, it has no router
  logits): base.yml's default, where nobody chose the key, resolves to the family's value (resolve_fixed, the first
  step of checks.validate); another value chosen is refused with the family's reason.

Every key of FEATURES is declared once (tests/config/test_config.py checks each is a base.yml key of one row); each key
of REQUIRES is one of a FEATURES row.
Imports the registry, the objectives' table, the schema (the mesh's ways) and the error type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxtrain.config import objectives
from maxtrain.config.registry import FAMILIES, HYBRID_SETTINGS, MOE_FAMILIES, Family
from maxtrain.config.schema import table, ways
from maxtrain.config.settings import check_value
from maxtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Feature:
    needs: str                          # what turns it on, as the error says it: "objective=distill"
    on: Callable[[dict], bool]          # whether resolved values have it on
    keys: tuple[str, ...]               # the settings only it reads
    fix: str = ""                       # how to turn it on, where that is more than "set <needs>"
    state: str = ""                     # the switch's key, whose value the error shows (decoder_block, ...)


def _reading(key: str) -> tuple[str, ...]:
    """The families whose modules read `key` (registry.Family.settings)."""
    return tuple(name for name, f in FAMILIES.items() if key in f.settings)


def _family_features() -> tuple[Feature, ...]:
    """One row per set of families that read the same family settings (registry.Family.settings)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for row in FAMILIES.values():
        for key in row.settings:
            groups.setdefault(_reading(key), [])
            if key not in groups[_reading(key)]:
                groups[_reading(key)].append(key)
    return tuple(Feature("decoder_block=" + " or ".join(names), lambda v, names=names: v["decoder_block"] in names,
                         tuple(keys), state="decoder_block") for names, keys in groups.items())


def _objective_features() -> tuple[Feature, ...]:
    """One row per set of objectives that read the same keys (most keys one objective's alone; distill_teacher_path
    distill's and distill_on_policy's), then the keys of the data kinds read through a chat template."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for o in objectives.OBJECTIVES.values():
        for key in o.keys:
            readers = tuple(r.name for r in objectives.OBJECTIVES.values() if key in r.keys)
            if key not in groups.setdefault(readers, []):
                groups[readers].append(key)
    fixes = {o.name: o.fix for o in objectives.OBJECTIVES.values()}
    rows = [Feature("objective=" + " or ".join(names), lambda v, names=names: v["objective"] in names, tuple(keys),
                    fix=fixes[names[0]] if len(names) == 1 else "", state="objective")
            for names, keys in groups.items()]
    def reading(kinds):  # "sft, dpo or distill with distill_data=conversations": the objectives that read these kinds
        names = [o.name + ("" if o.data[0] in kinds else f" with {o.data_key}={next(k for k in o.data if k in kinds)}")
                 for o in objectives.OBJECTIVES.values() if set(o.data) & set(kinds)]
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    conversations = reading((objectives.CONVERSATIONS,))
    templated = reading((objectives.CONVERSATIONS, objectives.PAIRS, objectives.PROMPTS))
    return (*rows,
            Feature(f"conversations (objective={conversations})",
                    lambda v: objectives.data_kind(v) == objectives.CONVERSATIONS, ("sft_train_on_completion_only",),
                    fix="set objective=sft", state="objective"),
            Feature(f"records rendered with a chat template (objective={templated})", objectives.templated,
                    ("chat_template",), fix="set objective=sft (or dpo, grpo)", state="objective"))


def family(v: dict[str, Any]) -> Family:
    """The configured family's registry row (a plain one for a family only a test has added)."""
    return FAMILIES.get(v["decoder_block"]) or Family(v["decoder_block"], (), "")


def layer_attention(v: dict[str, Any]) -> list[str]:
    """"full" or "sliding" for each layer of the configured model (its family's layer_types agree)."""
    return family(v).attention_plan(v["base_num_decoder_layers"], v["sliding_window_size"], v["attention_layer_types"])


MLA_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.mixer == "mla")
SLIDING_FAMILIES = tuple(n for n, f in FAMILIES.items() if "sliding" in f.attention_pattern or f.window_everywhere)
MOE = "a mixture-of-experts family"
USE_MOE = "set decoder_block to one of " + ", ".join(MOE_FAMILIES)

FEATURES: tuple[Feature, ...] = (
    # objectives (config/objectives.py: each row's keys; the keys of the data kinds that read records) and adapters
    *_objective_features(),
    Feature("lora_rank > 0", lambda v: v["lora_rank"] > 0, ("lora_alpha", "lora_target_modules"),
            fix="set lora_rank (e.g. lora_rank=8)"),
    # an image-and-text model's training (training/freeze.py): a model without a tower has nothing to freeze
    Feature("a model with a vision tower (vision_config set)", lambda v: v["vision_config"] != "", ("vision_freeze",),
            fix="import an image-and-text checkpoint with its tower (scripts/convert_hf.py import, without --text-only)",
            state="vision_config"),
    # DeepSeek-V3.2's indexer training (models/families/deepseek/indexer_training.py): a deepseek model with an indexer
    Feature("an indexer to train (decoder_block=deepseek with index_n_heads > 0)",
            lambda v: family(v).sparse_attention and v["index_n_heads"] > 0,
            ("indexer_training", "indexer_loss_weight"),
            fix="set model_name=deepseek3.2-tiny, or index_n_heads > 0 on a deepseek model", state="index_n_heads"),
    # optimizer and precision
    Feature("opt_type=muon", lambda v: v["opt_type"] == "muon",
            ("muon_beta", "muon_weight_decay", "muon_consistent_rms", "muon_ns_steps"), state="opt_type"),
    Feature("dtype=float16", lambda v: v["dtype"] == "float16",
            ("loss_scale_initial", "loss_scale_period", "loss_scale_min"), state="dtype"),  # its loss scaling
    Feature("lr_schedule_type=cosine", lambda v: v["lr_schedule_type"] == "cosine",
            ("cosine_learning_rate_final_fraction",), state="lr_schedule_type"),
    Feature("lr_schedule_type=wsd", lambda v: v["lr_schedule_type"] == "wsd", ("wsd_decay_steps_fraction",),
            state="lr_schedule_type"),
    Feature("quantization=fp8 or fp8_mlp", lambda v: bool(v["quantization"]), ("quantize_output_head",),
            fix="set quantization=fp8 (or fp8_mlp)"),
    # the model
    # (capacity_factor belongs to the experts, not only to moe_dispatch=capacity: a comparison of the two
    # dispatches keeps one capacity_factor, as tests/models/test_moe.py does)
    Feature(MOE, lambda v: v["decoder_block"] in MOE_FAMILIES,
            ("num_experts", "num_experts_per_tok", "base_moe_mlp_dim", "moe_dispatch", "capacity_factor",
             "moe_grouped_matmul", "load_balance_loss_weight", "router_z_loss_weight", "num_moe_hidden_tiling",
             "shared_experts", "routed_bias", "routed_bias_update_rate", "seq_balance_loss_weight"), fix=USE_MOE,
            state="decoder_block"),
    Feature("mtp_num_layers > 0", lambda v: v["mtp_num_layers"] > 0, ("mtp_loss_scaling_factor",),
            fix="set mtp_num_layers (e.g. mtp_num_layers=1, decoder_block=deepseek)"),
    *_family_features(),
    Feature("sliding-window layers", lambda v: "sliding" in layer_attention(v),
            ("sliding_window_size", "local_rope_max_timescale"),
            fix="give layers a window with attention_layer_types (\"sliding\" or \"full\" per layer), or use a family "
                "whose layers slide (decoder_block=" + ", ".join(SLIDING_FAMILIES) + ")", state="decoder_block"),
    Feature("per-layer attention types", lambda v: family(v).per_layer_attention,
            ("attention_layer_types",), fix="use a family other than " + ", ".join(
                n for n, f in FAMILIES.items() if not f.per_layer_attention), state="decoder_block"),
    Feature("rope_type=linear, llama3, yarn or proportional", lambda v: v["rope_type"] != "default", ("rope_factor",),
            fix="set rope_type (linear, llama3, yarn or proportional)", state="rope_type"),
    Feature("rope_type=llama3 or yarn", lambda v: v["rope_type"] in ("llama3", "yarn"),
            ("original_max_position_embeddings",), fix="set rope_type=llama3 (or yarn)", state="rope_type"),
    Feature("rope_type=llama3", lambda v: v["rope_type"] == "llama3", ("rope_low_freq_factor", "rope_high_freq_factor"),
            state="rope_type"),
    Feature("rope_type=proportional", lambda v: v["rope_type"] == "proportional", ("rope_proportion",),
            state="rope_type"),
    Feature("rope_type=yarn", lambda v: v["rope_type"] == "yarn",
            ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_truncate"), state="rope_type"),
    Feature(f"decoder_block={' or '.join(MLA_FAMILIES)} with rope_type=yarn",
            lambda v: family(v).mixer == "mla" and v["rope_type"] != "default", ("rope_mscale_all_dim",),
            fix=f"set rope_type=yarn with decoder_block={' or '.join(MLA_FAMILIES)}", state="rope_type"),
    # sampling (maxtrain.decode, GRPO's completions), the profiler, the data, compilation, the pipeline
    Feature("decode_sampling_strategy=weighted, topk or nucleus", lambda v: v["decode_sampling_strategy"] != "greedy",
            ("decode_sampling_temperature",), fix="set decode_sampling_strategy=weighted (or topk, nucleus)",
            state="decode_sampling_strategy"),
    Feature("decode_sampling_strategy=topk", lambda v: v["decode_sampling_strategy"] == "topk",
            ("decode_sampling_top_k",), state="decode_sampling_strategy"),
    Feature("decode_sampling_strategy=nucleus", lambda v: v["decode_sampling_strategy"] == "nucleus",
            ("decode_sampling_nucleus_p",), state="decode_sampling_strategy"),
    Feature("profiler=xplane", lambda v: bool(v["profiler"]), ("skip_first_n_steps_for_profiler", "profiler_steps")),
    Feature("packing=true", lambda v: v["packing"], ("grain_packing_type",)),
    Feature("compile_topology=<a target>", lambda v: bool(v["compile_topology"]), ("compile_topology_num_slices",),
            fix="set compile_topology (e.g. compile_topology=v5p-128) and run maxtrain.train_compile"),
    Feature("pipeline parallelism", lambda v: ways(v, "stage") != 1, ("num_pipeline_microbatches",),
            fix="set ici_pipeline_parallelism (or dcn_pipeline_parallelism) > 1"),
    Feature("context parallelism", lambda v: ways(v, "context") != 1,
            ("context_parallel_strategy", "context_parallel_reorder_strategy"),
            fix="set ici_context_parallelism (or dcn_context_parallelism) > 1"),
)


def has_gated_deltanet(v) -> bool:
    """Whether the configured model (values or a Config) has gated delta-net layers: a hybrid family (it reads their
    settings) whose inhomogeneous_layer_cycle_interval leaves layers between its full-attention ones."""
    get = v.__getitem__ if isinstance(v, dict) else lambda key: getattr(v, key)
    row = FAMILIES.get(get("decoder_block"))
    return row is not None and "gdn_kernel" in row.settings and get("inhomogeneous_layer_cycle_interval") > 1


GATED_DELTANET_KEYS = tuple(k for k in HYBRID_SETTINGS if k.startswith("gdn_"))

# The second switches. Each key here belongs to a row of FEATURES (its family, its objective: the first switch),
# and does something only where a second switch of that feature is on too: temperature tuning scales the NoPE
# layers' queries, the chunks are the RoPE layers', the gated delta rule's settings need its layers, the grouped
# matmul is the dropless dispatch's. The gate checks a key's first switch, then these.
REQUIRES: tuple[Feature, ...] = (
    Feature("temperature_tuning=true", lambda v: v["temperature_tuning"],
            ("temperature_tuning_scale", "temperature_tuning_floor_scale"), state="temperature_tuning"),
    Feature("NoPE layers (nope_layer_interval >= 1)", lambda v: v["nope_layer_interval"] > 0, ("temperature_tuning",),
            fix="set nope_layer_interval (Llama 4: 4, a NoPE layer every 4th layer)", state="nope_layer_interval"),
    Feature("RoPE layers (nope_layer_interval other than 1)", lambda v: v["nope_layer_interval"] != 1,
            ("chunk_attn_window_size",), fix="set nope_layer_interval=4 (Llama 4's; 1 makes every layer a NoPE layer "
                                             "attending fully) or -1", state="nope_layer_interval"),
    Feature("gated delta-net layers (inhomogeneous_layer_cycle_interval >= 2)", has_gated_deltanet,
            GATED_DELTANET_KEYS, fix="set inhomogeneous_layer_cycle_interval >= 2 (Qwen3-Next and Qwen3.5: 4; 1 makes "
                                     "every layer full attention)", state="inhomogeneous_layer_cycle_interval"),
    # Gemma 4's image tokens attending both ways (models/gemma4/normed_attention.py): a text model has no image tokens
    Feature("a model with a vision tower (vision_config set)", lambda v: v["vision_config"] != "",
            ("bidirectional_image_attention",),
            fix="import an image-and-text checkpoint with its tower (scripts/convert_hf.py import, without --text-only)",
            state="vision_config"),
    # the banded image attention's reach ahead (models/attention/image_band.py): read only with images both ways
    Feature("bidirectional_image_attention=true", lambda v: v["bidirectional_image_attention"],
            ("image_attention_span",), state="bidirectional_image_attention"),
    Feature("moe_dispatch=dropless", lambda v: v["moe_dispatch"] == "dropless", ("moe_grouped_matmul",),
            state="moe_dispatch"),
    Feature("a shared expert (shared_experts >= 1)", lambda v: v["shared_experts"] > 0, ("shared_expert_mlp_dim",),
            fix="set shared_experts=1", state="shared_experts"),
    # DeepSeek Sparse Attention's indexer (models/families/deepseek/indexer.py): its keys do nothing without it
    Feature("a lightning indexer (index_n_heads > 0)", lambda v: v["index_n_heads"] > 0,
            ("index_head_dim", "index_topk", "index_rope_interleave", "indexer_types", "indexer_dtype"),
            fix="set index_n_heads > 0 (DeepSeek-V3.2: 64; GLM-5: 32)", state="index_n_heads"),
    Feature("indexer_training=dense_warmup or sparse", lambda v: v["indexer_training"] != "none", ("indexer_loss_weight",),
            fix="set indexer_training=dense_warmup (or sparse)", state="indexer_training"),
    # GRPO's loss (objective=grpo, training/policy_losses.py): CISPO clips no ratio below (its weight has only a cap,
    # grpo_epsilon_high); the KL's bias correction multiplies a KL term that grpo_beta=0 leaves out
    Feature("a clipped loss (grpo_loss_type=grpo, bnpo, dr_grpo or dapo)", lambda v: v["grpo_loss_type"] != "cispo",
            ("grpo_epsilon",), fix="cispo's weight has only an upper cap, grpo_epsilon_high; use another grpo_loss_type "
                                   "to clip below", state="grpo_loss_type"),
    Feature("a KL term (grpo_beta > 0)", lambda v: v["grpo_beta"] > 0, ("grpo_kl_bias_correction",),
            fix="set grpo_beta > 0 (e.g. 0.04)", state="grpo_beta"),
    # GRPO's rollout keys (training/advantages.py, grpo.py)
    Feature("grpo_scale_rewards=group or batch", lambda v: v["grpo_scale_rewards"] != "none", ("grpo_reward_std_ddof",),
            fix="set grpo_scale_rewards=group (or batch)", state="grpo_scale_rewards"),
    Feature("grpo_overlong_buffer_length > 0", lambda v: v["grpo_overlong_buffer_length"] > 0,
            ("grpo_overlong_penalty_factor",), fix="set grpo_overlong_buffer_length (DAPO: a quarter of the "
                                                   "completion's length)", state="grpo_overlong_buffer_length"),
    Feature("grpo_dynamic_sampling=true", lambda v: v["grpo_dynamic_sampling"], ("grpo_dynamic_sampling_max_batches",),
            state="grpo_dynamic_sampling"),
    # GRPO's multi-turn episodes (training/episodes.py): a single-turn completion has one turn
    Feature("an environment (multi-turn episodes; a single-turn completion has one turn)",
            lambda v: bool(v["grpo_environment"]), ("grpo_max_turns",),
            fix="set grpo_environment=calculator (or module:Class)", state="grpo_environment"),
    # GRPO's rollout workers (training/rollout/): the engine, staleness, correction and chunks are the workers'
    Feature("rollout workers (grpo_rollout_workers > 0)", lambda v: v["grpo_rollout_workers"] > 0,
            ("grpo_rollout_engine", "grpo_off_policy_steps", "grpo_tis_cap", "grpo_rollout_chunk_tokens",
             "grpo_rollout_worker_devices"),
            fix="set grpo_rollout_workers >= 1 (pip install 'maxtrain[rl]')", state="grpo_rollout_workers"),
)


def owner(key: str) -> Feature | None:
    """The feature whose keys include `key`, or None."""
    return next((f for f in FEATURES if key in f.keys), None)


def shown(value: Any) -> str:
    """A value as the user writes it on the command line (true, 0.3, 'text', [q, v])."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _chosen_by_the_user(v: dict[str, Any]) -> Callable[[str], bool]:
    """Whether a key's value is the user's (their YAML or the command line), not base.yml's or the preset's.
    Values without that record (a config built in code) all count as the user's."""
    if "given_keys" not in v:
        return lambda key: True
    given, preset = set(v["given_keys"]), set(v.get("preset_keys", ()))
    return lambda key: key in given and key not in preset


def _refuse_settings_that_do_nothing(v: dict[str, Any], chosen: Callable[[str], bool], where: str = "") -> None:
    settings = table()
    for feature in FEATURES + REQUIRES:  # a key's first switch (FEATURES), then its second (REQUIRES)
        if feature.on(v):
            continue
        for key in feature.keys:
            default = settings[key].default
            if v[key] != default and chosen(key):
                state = v[feature.state] if feature.state else None
                value = (state or '""') if isinstance(state, str) else shown(state)  # an empty string shown as ""
                here = f" (here {feature.state}={value})" if feature.state else ""
                raise ConfigError(f"{where}{key}={shown(v[key])} does nothing without {feature.needs}{here}: "
                                  f"{feature.fix or 'set ' + feature.needs}, or drop {key} (default {shown(default)})")


def settings_of_features_that_are_off(v: dict[str, Any]) -> None:
    """A key of a feature that is off, set by the user to other than its default: refused with the switch."""
    _refuse_settings_that_do_nothing(v, _chosen_by_the_user(v))


def preset_settings_that_do_nothing(path: str, v: dict[str, Any], preset_keys) -> None:
    """A preset the user wrote (model_name=<its path>) describes a model: each of its keys that does nothing in that
    model (`v`: base.yml, the config file and the preset, before the command line) is refused, naming the file. (Its
    values are the model's defaults otherwise: a command line that turns one of its features off refuses nothing.)"""
    keys = set(preset_keys)
    _refuse_settings_that_do_nothing(v, lambda key: key in keys, where=f"model_name={path}: ")


# Keys that only some commands read, and the commands that read them (their module, as `python -m` runs it). A
# command that loads a config says its name (loading.load_config's `command`); a key set for another one is refused.
COMMAND_KEYS: dict[str, tuple[str, ...]] = {
    "compile_topology": ("maxtrain.train_compile",),
    "compile_topology_num_slices": ("maxtrain.train_compile",),
    "compile_report_file": ("maxtrain.train_compile",),
    "compiled_trainstep_file": ("maxtrain.train_compile", "maxtrain.train"),
    "prompt_image": ("maxtrain.decode",),
}


def keys_of_other_commands(v: dict[str, Any], command: str) -> None:
    """A key another command reads (COMMAND_KEYS), set by the user to other than its default, where `command` runs."""
    chosen, settings = _chosen_by_the_user(v), table()
    for key, readers in COMMAND_KEYS.items():
        if command and command not in readers and v[key] != settings[key].default and chosen(key):
            check_value(settings[key], v[key])  # a value no command takes: its range first
            raise ConfigError(f"{key}={shown(v[key])} is read by {' and '.join(readers)}, not by {command}: run "
                              f"python -m {readers[0]} with it, or drop {key} (default {shown(settings[key].default)})")


def what_the_family_is(v: dict[str, Any]) -> None:
    """A family's defining settings (registry.Family.usual) left at a shared default that turns them off."""
    block, usual = v["decoder_block"], dict(family(v).usual)
    if "sliding" in layer_attention(v) and v["sliding_window_size"] == 0:
        source = ("attention_layer_types has sliding layers" if v["attention_layer_types"] else
                  f"decoder_block={block} has sliding-window layers ({' '.join(family(v).attention_pattern)}, "
                  "repeated)")
        window = usual.get("sliding_window_size", 4096)
        raise ConfigError(f"{source}, but sliding_window_size=0 would give them full attention; set sliding_window_size"
                          f"={window} ({block}'s usual window), or attention_layer_types=[full, ...] for full attention "
                          "in every layer")
    if block in MOE_FAMILIES and v["num_experts"] == 1 and not family(v).moe_optional:
        raise ConfigError(f"decoder_block={block} is a mixture of experts, but num_experts=1 (the default) makes each "
                          f"MoE layer one dense MLP; set num_experts={usual.get('num_experts', 8)} ({block}'s usual "
                          "count) and num_experts_per_tok, or use a dense family (e.g. decoder_block=llama)")


def _given(v: dict[str, Any]) -> set:
    """The keys whose value someone chose: the user's YAML and command line, and the preset (its values are the
    model's); empty for values built in code from base.yml's defaults (no record)."""
    return set(v.get("given_keys", ())) | set(v.get("preset_keys", ()))


def resolve_fixed(v: dict[str, Any]) -> None:
    """A family's fixed settings (registry.Family.fixed) that nobody chose and that hold base.yml's default take the
    family's value, in v: base.yml's load_balance_loss_weight (0.01) is the other mixtures of experts' default."""
    settings, given = table(), _given(v)
    for key, value in family(v).fixed:
        if key not in given and v[key] == settings[key].default:
            v[key] = value


def fixed_by_the_family(v: dict[str, Any]) -> None:
    """A value chosen for a family's fixed setting other than its own (resolve_fixed has replaced the defaults)."""
    row = family(v)
    for key, value in row.fixed:
        if v[key] != value:
            raise ConfigError(f"{key}={shown(v[key])} does nothing with decoder_block={row.name}: {row.fixed_why}; "
                              f"drop {key} (it is {shown(value)} for {row.name})")


CHECKS = (what_the_family_is, fixed_by_the_family, settings_of_features_that_are_off)
