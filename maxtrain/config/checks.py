"""The checks of a resolved config: every key against the settings table, then the rules that relate several keys.

    checks.validate(values)   # ConfigError naming the key, the value and the fix, or None

`validate` checks each key against its allowed values in configs/base.yml (settings.check_value), then
runs `CHECKS`: the named rules a per-key range cannot express (heads divisible by kv heads, one mesh
axis filled with -1, tensor parallelism dividing heads/mlp/vocab, ...), each a function of the
resolved values that raises ConfigError. loading.load_config and loading.revalidate call it. Two
settings' parsers live here too, because a rule checks them and the run uses them again:
`parse_eval_tasks` (evaluate.py, evals/runner.py) and `split_address` (parallel/distributed.py).
The objective's rules are its row's (objectives.CHECKS: its data settings, its own rules); context
parallelism's are context_checks.py's, latent attention's and its indexer's mla_checks.py's. CHECKS ends with
two tables' rules: limits.py (a sampler with one choice, a sequence too short for a
setting, an empty path) and features.py (a setting of a feature that is off, a family's defining
setting left at a default that turns it off).

Imports the schema and the registry (what the rules check against), the settings table, the three tables'
modules and the error types.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Any

from maxtrain.config import context_checks, features, limits, mla_checks, objectives, vision_checks
from maxtrain.config import settings as settings_lib
from maxtrain.config.registry import EVAL_TASKS, FAMILIES, MOE_FAMILIES, MOE_PLACEMENT_KEYS
from maxtrain.config.schema import LOGICAL_AXES, MESH_AXES, QUANTIZATION_PLACES, parallelism_key, table, ways
from maxtrain.errors import ConfigError


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def validate(v: dict[str, Any]) -> None:
    """The whole resolved config: each key's allowed values (the table), then the named checks. The one change it
    makes to v comes first: the family's fixed settings left at base.yml's default take the family's value
    (features.resolve_fixed), so every path that builds a config (load_config, a checkpoint's adopted model, an
    import's config.json) resolves them alike."""
    features.resolve_fixed(v)
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



def _layer_head_shapes(v):
    """Layers of their own head shape (global_head_dim, global_num_kv_heads) and shared-KV layers (their keys
    and values from an earlier layer of their attention type): what makes each possible."""
    h, g, n = v["global_head_dim"], v["global_num_kv_heads"], v["base_num_query_heads"]
    _require(h == -1 or h % 2 == 0, f"global_head_dim={h} must be even (RoPE rotates pairs of features)")
    _require(g == -1 or n % g == 0, f"base_num_query_heads={n} must be a multiple of global_num_kv_heads={g}; "
                                    f"e.g. global_num_kv_heads={_divisor_hint(n, max(g, 1))}")
    _require(not (v["attention"] == "cudnn" and max(h, v["head_dim"]) > 256),
             f"attention=cudnn takes heads of at most 256 features, but global_head_dim={h}; use attention=flash "
             "(or autoselected)")
    shared, layers = v["num_kv_shared_layers"], v["base_num_decoder_layers"]
    kinds = features.layer_attention(v)
    _require(shared == 0 or (shared < layers and set(kinds[layers - shared:]) <= set(kinds[:layers - shared])),
             f"num_kv_shared_layers={shared}: each of the last {shared} layers shares the keys and values of an "
             f"earlier layer of its attention type, and the {layers - shared} before them ({kinds[:layers - shared]}) "
             f"leave none for {sorted(set(kinds[layers - shared:]))}; use fewer shared layers")
    _require(shared > 0 or not v["double_wide_mlp"],
             "double_wide_mlp=true widens the shared-KV layers' MLP, but num_kv_shared_layers=0; set "
             "num_kv_shared_layers, or drop double_wide_mlp")


def _vocab_tiling_divides_length(v):
    _require(v["num_vocab_tiling"] == -1 or v["max_target_length"] % v["num_vocab_tiling"] == 0,
             f"num_vocab_tiling={v['num_vocab_tiling']} must divide max_target_length={v['max_target_length']} "
             "(the sequence is cut into that many chunks)")


def _flash_blocks_powers_of_two(v):
    for key in ("sa_block_q", "sa_block_kv"):
        _require(v[key] & (v[key] - 1) == 0, f"{key}={v[key]} must be a power of two (16, 32, 64, 128, ...)")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
CHAT_TEMPLATES = ("chatml", "llama3", "plain")  # maxtrain/data/chat.py: built-in templates


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
        _require(v["rope_high_freq_factor"] >= v["rope_low_freq_factor"] > 0,
                 f"rope_type=llama3 needs rope_high_freq_factor >= rope_low_freq_factor > 0, got "
                 f"{v['rope_high_freq_factor']} and {v['rope_low_freq_factor']} (Llama 3.1 uses 4.0 and 1.0, "
                 "Llama 4 Scout 1.0 and 1.0)")


def _attention_layer_types(v):
    types = v["attention_layer_types"]
    if types:
        _require(len(types) == v["base_num_decoder_layers"] and all(t in ("full", "sliding") for t in types),
                 f"attention_layer_types must list \"full\" or \"sliding\" for each of the "
                 f"{v['base_num_decoder_layers']} layers (or be [] for the family's pattern), got {types}")


def _experts_per_token_at_most_experts(v):
    if v["decoder_block"] not in MOE_FAMILIES:
        return  # features.py refuses num_experts_per_tok where there are no experts
    e, k = v["num_experts"], v["num_experts_per_tok"]
    _require(k <= e, f"num_experts_per_tok={k} is more than num_experts={e}: each token is routed to "
                     f"num_experts_per_tok distinct experts; use num_experts_per_tok <= {e}")


def _moe_layers_of_the_family(v):
    layers = v["mlp_only_layers"]
    _require(all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < v["base_num_decoder_layers"]
                 for i in layers),
             f"mlp_only_layers={layers} must list layer indices in [0, {v['base_num_decoder_layers'] - 1}]")
    block, e = v["decoder_block"], v["num_experts"]
    if block not in MOE_FAMILIES:
        _require(e == 1, f"decoder_block={block} has no experts, but num_experts={e}; use decoder_block="
                         f"{' or '.join(MOE_FAMILIES)} for a mixture of experts, or num_experts=1")


def _experts_in_some_layer(v):
    """The family's rules that place its experts (registry.MOE_PLACEMENT_KEYS) leave at least one layer of experts:
    a mixture-of-experts family with none would silently be a dense model."""
    family, layers = features.family(v), v["base_num_decoder_layers"]
    if not family.moe or v["num_experts"] <= 1:
        return  # no experts at all: what_the_family_is (features.py) names num_experts=1 where it is a mistake
    if any(family.moe_plan(layers, v)):
        return
    defaults = table()
    placing = [k for k in MOE_PLACEMENT_KEYS if k in family.settings and v[k] != defaults[k].default]
    fixes = {"first_num_dense_layers": f"first_num_dense_layers < {layers}",
             "decoder_sparse_step": f"decoder_sparse_step <= {layers}",
             "mlp_only_layers": "mlp_only_layers that leave out a layer of experts"}
    raise ConfigError(f"{' with '.join(f'{k}={features.shown(v[k])}' for k in placing)} leaves no layer of experts "
                      f"among base_num_decoder_layers={layers}: decoder_block={v['decoder_block']} would be a dense "
                      f"model; use {' or '.join(fixes[k] for k in placing)}, or a dense family for a dense model "
                      "(e.g. decoder_block=llama)")


def _expert_parallelism_divides_experts(v):
    ici, dcn, e = v["ici_expert_parallelism"], v["dcn_expert_parallelism"], v["num_experts"]
    ep = ici * dcn
    if ici > 0 and dcn > 0 and e % ep:  # -1 (fill) is resolved with the devices; the mesh checks it then
        raise ConfigError(f"expert parallelism {ep} (ici_expert_parallelism x dcn_expert_parallelism) must divide "
                          f"num_experts={e}: each device holds num_experts / {ep} whole experts; e.g. "
                          f"ici_expert_parallelism={_divisor_hint(e, ep)}")


def _hidden_tiling_divides_expert_width(v):
    n, width = v["num_moe_hidden_tiling"], v["base_moe_mlp_dim"] if v["base_moe_mlp_dim"] > 0 else v["base_mlp_dim"]
    if v["num_experts"] > 1 and n > 1 and width % n:
        raise ConfigError(f"num_moe_hidden_tiling={n} must divide the experts' hidden width {width} (base_moe_mlp_dim, "
                          f"or base_mlp_dim when that is -1); e.g. num_moe_hidden_tiling={_divisor_hint(width, n)}, "
                          "or -1 to have it chosen")


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


def _stages_divide_layers(v):
    """Each pipeline stage holds the same number of layers (sharding.create_mesh checks again once -1 is
    resolved)."""
    stages, layers = ways(v, "stage"), v["base_num_decoder_layers"]
    if stages and stages > 1:
        _require(layers % stages == 0,
                 f"pipeline parallelism {stages} (ici_pipeline_parallelism x dcn_pipeline_parallelism) must divide "
                 f"base_num_decoder_layers={layers}: each stage holds the same number of layers; e.g. "
                 f"ici_pipeline_parallelism={_divisor_hint(layers, stages)}")


def _no_pipeline_stages_with_experts(v):
    """Mixture-of-experts layers run their own shard_map over the expert axis, and report per-layer
    figures; neither is wired through a pipeline stage yet."""
    stages = ways(v, "stage")
    _require(v["decoder_block"] not in MOE_FAMILIES or stages == 1,
             f"decoder_block={v['decoder_block']} (mixture of experts) does not run with pipeline parallelism yet; "
             "set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1 (use expert, fsdp or tensor parallelism)")


def _tensor_parallelism_divides(v):
    tp = v["ici_tensor_parallelism"] * v["dcn_tensor_parallelism"]
    if tp > 1:
        for key in FAMILIES[v["decoder_block"]].tensor_keys:
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


def _run_name_is_one_directory(v):
    """The run is written to base_output_directory/run_name: a run_name with a '/', '..' or an absolute path
    would write it elsewhere. ("" is fine: the run gets a timestamped name.)"""
    name = v["run_name"]
    separators = {"/", os.sep, os.altsep or "/"}
    if not name or (name not in (".", "..") and not any(s in name for s in separators) and "\0" not in name):
        return
    head, tail = os.path.split(name.rstrip("/" + os.sep))
    where = head if "://" in head else os.path.normpath(os.path.join(v["base_output_directory"], head))
    hint = (f"; e.g. base_output_directory={where} run_name={tail}"
            if head and tail not in ("", ".", "..") and "\0" not in name else "")
    raise ConfigError(f"run_name={name!r} must be one directory name (no '/', not '.' or '..'): the run is written "
                      f"to base_output_directory/run_name, here {v['base_output_directory']!r}. To write runs "
                      f"elsewhere, set base_output_directory{hint}")


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


# --- Group-limited routing, aux-loss-free balancing, MLA, multi-token prediction (DeepSeek-V3, GLM-4.5) --------


def _routing_groups(v):
    e, k, groups, top = v["num_experts"], v["num_experts_per_tok"], v["n_routing_groups"], v["topk_routing_group"]
    if groups == -1:
        _require(top == -1, f"topk_routing_group={top} needs n_routing_groups (the experts' groups to choose "
                            "among); set n_routing_groups, or topk_routing_group=-1")
        return
    _require(e % groups == 0, f"n_routing_groups={groups} must divide num_experts={e} (the groups are equal); "
                              f"e.g. n_routing_groups={_divisor_hint(e, groups)}")
    top = groups if top == -1 else top
    _require(top <= groups, f"topk_routing_group={top} is more than n_routing_groups={groups}: a token chooses "
                            f"among at most all the groups; use topk_routing_group <= {groups}")
    allowed = top * (e // groups)
    _require(k <= allowed, f"num_experts_per_tok={k} is more than the {allowed} experts that topk_routing_group={top} "
                           f"groups of {e // groups} hold; use num_experts_per_tok <= {allowed}, or more groups")


def _expert_balancing_needs_experts(v):
    moe = v["decoder_block"] in MOE_FAMILIES
    for key, off in (("shared_experts", 0), ("routed_bias", False), ("routed_bias_update_rate", 0.0),
                     ("seq_balance_loss_weight", 0.0)):
        _require(moe or v[key] == off, f"{key}={v[key]} needs a mixture of experts, but decoder_block="
                                       f"{v['decoder_block']} has none; use one of {', '.join(MOE_FAMILIES)}")
    _require(v["routed_bias"] or v["routed_bias_update_rate"] == 0,
             f"routed_bias_update_rate={v['routed_bias_update_rate']} updates the router's selection bias, but "
             "routed_bias=false: set routed_bias=true (aux-loss-free balancing), or routed_bias_update_rate=0")


def _gated_deltanet(v):
    """The gated delta-net layers' shapes, for a family that has them (its registry row reads their settings)."""
    if "gdn_num_key_heads" not in features.family(v).settings:
        return
    nk, nv = v["gdn_num_key_heads"], v["gdn_num_value_heads"]
    _require(nv % nk == 0, f"gdn_num_value_heads={nv} must be a multiple of gdn_num_key_heads={nk} (each key head "
                           f"serves a whole group of value heads); e.g. gdn_num_value_heads={nk * max(1, nv // nk)}")
    cycle, layers = v["inhomogeneous_layer_cycle_interval"], v["base_num_decoder_layers"]
    _require(cycle <= layers, f"inhomogeneous_layer_cycle_interval={cycle} leaves no full-attention layer among "
                              f"base_num_decoder_layers={layers}; use inhomogeneous_layer_cycle_interval <= {layers}")
    # The recurrent state runs through every layer in order: pipeline stages would need it handed from stage to
    # stage, which the gated delta-net does not do yet. (Along the sequence, context parallelism hands it over.)
    split = ways(v, "stage")
    _require(split in (1, None), f"decoder_block={v['decoder_block']}'s gated delta-net layers do not run with stage "
                                 f"parallelism {split} yet (their state would pass from shard to shard); set "
                                 "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1, and split the model with "
                                 "ici_fsdp_parallelism or ici_tensor_parallelism instead")
    context_checks.gated_deltanet_chunks(v)


def _partial_rotary_factor(v):
    rotated = int(v["head_dim"] * v["partial_rotary_factor"])
    _require(rotated >= 2 and rotated % 2 == 0,
             f"partial_rotary_factor={v['partial_rotary_factor']} rotates {rotated} of head_dim={v['head_dim']} "
             "features, but RoPE rotates an even number of them (at least 2); choose a factor that gives one")


def _multi_token_prediction(v):
    """MTP (models/mtp.py): DeepSeek's modules after its MoE layers, on the next-token objectives, in one program
    without pipeline stages, context parallelism or LoRA (none is wired through the MTP modules)."""
    n = v["mtp_num_layers"]
    if n == 0:
        return
    _require(objectives.of(v).next_token, f"mtp_num_layers={n} with objective={v['objective']}: multi-token prediction "
             "is a loss of the next-token objectives (lm, sft); set mtp_num_layers=0")
    _require(v["lora_rank"] == 0, f"mtp_num_layers={n} with lora_rank={v['lora_rank']}: LoRA would leave the MTP "
                                  "modules untrained; set mtp_num_layers=0 (or lora_rank=0)")
    for axis, keys in (("stage", "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1"),
                       ("context", "ici_context_parallelism=1 and dcn_context_parallelism=1")):
        split = ways(v, axis)
        _require(split in (1, None), f"mtp_num_layers={n} does not run with {axis} parallelism {split} yet; set {keys} "
                                    "(use fsdp, tensor or expert parallelism), or mtp_num_layers=0")


ROUTING_MLA_AND_MTP_CHECKS = (_routing_groups, _expert_balancing_needs_experts, *mla_checks.CHECKS,
                              _multi_token_prediction, *vision_checks.CHECKS)


# quantization (models/fp8.py). Whether the devices have float8 matmuls is checked with the devices, before
# compiling (training/builder.check_float8_devices): compile_topology's chips are known by compile/targets.py.
def _quantization_known(v):
    _require(v["quantization"] in QUANTIZATION_PLACES,
             f"quantization={v['quantization']!r} is not supported; use quantization=fp8 (attention projections, MLP and "
             "experts in float8), quantization=fp8_mlp (MLP and experts only), or leave it empty")
    _require(not v["quantize_output_head"] or v["quantization"],
             "quantize_output_head=true only applies with quantization=fp8 or fp8_mlp; set one, or drop quantize_output_head")


def _fp8_not_with_float16(v):
    _require(not v["quantization"] or v["dtype"] != "float16",
             f"quantization={v['quantization']} with dtype=float16 is not supported: float8 scales each tensor itself, and "
             "float16's loss scaling would scale the gradients a second time; use dtype=bfloat16 (no loss scaling needed)")


def _attention_kernels_inside_the_ring(v):
    """attention=flash runs per block pair of the ring (models/attention/ring_flash.py), each device's runs of tokens
    (two chunks under dual_chunk_swap, one under striped) a multiple of the kernel's smallest block (16); attention=cudnn
    runs cuDNN per block pair (ring_cudnn.py; the same kernel's backward where the installed jax's cuDNN backward is
    not one it binds), so the same runs; tokamax does not run inside the ring."""
    cp, name = ways(v, "context"), v["attention"]
    if v["context_parallel_strategy"] != "ring" or cp in (1, None):
        return
    _require(name != "tokamax",
             f"attention={name} does not run inside context_parallel_strategy=ring (its backward cannot take the "
             "ring's global softmax statistics); use attention=flash, whose kernel runs per block pair of the ring "
             "(or attention=cudnn: cuDNN per block pair, its backward given the ring's global statistics)")
    if name not in ("flash", "cudnn"):
        return
    length = v["max_target_length"]
    chunks = cp * (2 if v["context_parallel_reorder_strategy"] == "dual_chunk_swap" else 1)
    unit = chunks * 16
    _require(length % unit == 0,
             f"attention={name} with context_parallel_strategy=ring cuts each sequence into {chunks} runs of a "
             f"multiple of 16 tokens (the flash kernel's smallest block), so max_target_length={length} must be a "
             f"multiple of {unit}; e.g. max_target_length={max(unit, length // unit * unit)}")


def _family_rules(v):
    """The family's own rules (registry.Family.checks: DeepSeek-V4's sizes and schedule, ...)."""
    for check in features.family(v).checks:
        try:
            check(v)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _muon_without_lora(v):
    _require(v["opt_type"] != "muon" or v["lora_rank"] == 0,
             f"opt_type=muon trains whole weight matrices, but lora_rank={v['lora_rank']} trains low-rank adapters: "
             "set opt_type=adamw for LoRA (or lora_rank=0 for Muon)")


CHECKS = (_heads_divisible_by_kv_heads, _head_dim_even, _layer_head_shapes, _vocab_tiling_divides_length, _llama3_rope_factors,
          _attention_layer_types, _flash_blocks_powers_of_two, _gated_deltanet, _partial_rotary_factor,
          *objectives.CHECKS, _chat_template_known, _lora_targets_known,
          _default_corpus_needs_eval_split, _files_for_file_datasets, _one_starting_point, _one_filled_mesh_axis,
          _stages_divide_layers, _no_pipeline_stages_with_experts,
          lambda v: _validate_rules(v["logical_axis_rules"]), _tensor_parallelism_divides, *context_checks.CHECKS,
          _coordinator_address,
          _run_name_is_one_directory, _metrics_file_is_a_file_path, _optional_packages_installed, _known_profiler,
          _experts_per_token_at_most_experts, _moe_layers_of_the_family, _experts_in_some_layer,
          _expert_parallelism_divides_experts, _hidden_tiling_divides_expert_width,
          _eval_tasks_known, _quantization_known, _fp8_not_with_float16, _muon_without_lora,
          _attention_kernels_inside_the_ring) + ROUTING_MLA_AND_MTP_CHECKS


def _objective_with_pipeline_stages(v):
    """An objective whose frozen model is not wired through pipeline stages (objectives.Objective.pipeline)."""
    _require(objectives.of(v).pipeline or ways(v, "stage") in (1, None),
             f"objective={v['objective']} does not run with pipeline parallelism yet; set ici_pipeline_parallelism=1 "
             "and dcn_pipeline_parallelism=1")


# limits.py: samplers with one choice, lengths, paths; features.py last: the rules above name the more particular
# mistakes of a setting that does nothing
CHECKS += (_objective_with_pipeline_stages,) + limits.CHECKS + features.CHECKS + (_family_rules,)


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
