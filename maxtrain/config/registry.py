"""The names the settings are checked against, each declared once: model families and downstream tasks.

    registry.FAMILIES["qwen3_moe"].moe              # True: its layers may be mixtures of experts
    registry.family_of_hf_model_type("gemma3_text")  # the Family a Hugging Face config.json names

Every reader of these facts reads them here: base.yml's `decoder_block` choices (`{$families}`),
the family checks, `maxtrain.models.families` (which imports `maxtrain/models/families/<name>.py`
for each name), Hugging Face import and export (model_type and architecture), checkpoint checks,
and the presets (each preset's decoder_block must be one of these; tests/house/test_house.py).

Adding a family: a row here, its module in maxtrain/models/families/, presets in configs/models/
and a parity test against transformers (docs/architecture.md).

Plain data: no JAX, and of maxtrain only config/deepseek_v4_dims.py (pure Python: a family's check is a row's field).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from maxtrain.config import deepseek_v4_dims


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                     # decoder_block, and the module maxtrain/models/families/<name>.py
    hf_model_types: tuple[str, ...]  # config.json model_type values imported as this family; the first is exported
    hf_architecture: str          # config.json architectures[0] on export
    moe: bool = False             # its layers may be mixtures of experts (num_experts, decoder_sparse_step, ...)
    moe_optional: bool = False    # num_experts=1 is a dense model of the family (Gemma 4), not a mistake
    attention_sinks: bool = False  # a learned per-head logit in each softmax's denominator (only dot_product has it)
    attention_pattern: tuple[str, ...] = ("full",)  # "full" / "sliding" attention of its layers, repeated over the stack
    window_everywhere: bool = False  # sliding_window_size > 0 makes every layer a sliding-window layer (Mistral)
    per_layer_attention: bool = True  # reads attention_layer_types (deepseek's MLA layers all attend fully)
    # What the family is, and the settings whose shared default would silently turn it off: the family's usual
    # value of each (sliding_window_size 0 = full attention in its sliding layers; num_experts 1 = a dense MLP).
    usual: tuple[tuple[str, int], ...] = ()
    settings: tuple[str, ...] = ()  # the settings of base.yml that only some families' modules read: those it reads
    mixer: str = "attention"      # how its layers mix tokens: "attention" (q, k, v heads), "mla" (latent attention)
    # With index_n_heads > 0 each query attends to the index_topk keys a lightning indexer scores highest (DeepSeek
    # Sparse Attention, DeepSeek-V3.2): beyond index_topk tokens its attention reads each query's chosen keys alone.
    sparse_attention: bool = False
    # Where its layers attend in a form of their own that config.attention's kernels do not run (DeepSeek-V4's
    # compressed attention), why: the summary says so, and an explicit kernel is refused (models/runtime.py).
    own_attention: str = ""
    # Model keys beyond the shared ones (models/__init__.py) that a checkpoint of this family is checked against:
    # those that fix its parameters' shapes, and those that change what the same parameters compute. Each of its
    # `settings` is a model key, shared or its own (tests/house/test_house.py).
    shape_keys: tuple[str, ...] = ()
    setting_keys: tuple[str, ...] = ()
    # Of its `settings`, those that change how, not what, it computes (a kernel's chunk): no model keys.
    kernel_settings: tuple[str, ...] = ()
    # Functions of the resolved values that refuse, with one line (a ValueError), what its layers cannot run:
    # rules the settings table cannot state (config/checks.py calls them after the shared rules).
    checks: tuple[Callable[[dict], None], ...] = ()
    # The sizes tensor parallelism splits (config/checks.py: each must divide by it): DeepSeek-V4's one key/value
    # head and its experts' width (base_moe_mlp_dim) stand where the others' kv heads and MLP width do.
    tensor_keys: tuple[str, ...] = ("base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "vocab_size")
    # Shared settings the family has one value of (key, value), and why (`fixed_why`): a config of the family
    # resolves each to its value where the user set none (base.yml's default serves the other families), and a
    # value the user sets otherwise is refused (config/features.py).
    fixed: tuple[tuple[str, float], ...] = ()
    fixed_why: str = ""

    def pattern(self, num_layers: int) -> list[str]:
        """Its layers' attention without attention_layer_types: attention_pattern repeated over num_layers."""
        return [self.attention_pattern[i % len(self.attention_pattern)] for i in range(num_layers)]

    def attention_plan(self, num_layers: int, sliding_window_size: int, attention_layer_types: list) -> list[str]:
        """"full" or "sliding" for each layer, as its module's layer_types builds them (tests/config/test_config.py
        checks that they agree)."""
        if not self.per_layer_attention:
            return ["full"] * num_layers
        if attention_layer_types:
            return list(attention_layer_types)
        if self.window_everywhere:
            return ["sliding" if sliding_window_size > 0 else "full"] * num_layers
        return self.pattern(num_layers)

    def moe_plan(self, num_layers: int, placement: dict) -> list[bool]:
        """Whether each layer has experts, as its module's layer_types places them: `placement` holds the values of
        MOE_PLACEMENT_KEYS, of which only those the family reads (its `settings`) count (tests/config/test_config.py
        checks that they agree)."""
        def read(key, otherwise):
            return placement[key] if key in self.settings else otherwise
        first, step, only = read("first_num_dense_layers", 0), read("decoder_sparse_step", 1), read("mlp_only_layers", [])
        return [self.moe and i >= first and (i + 1) % step == 0 and i not in only for i in range(num_layers)]


# The settings that say which layers of a mixture-of-experts family have experts (Family.moe_plan), the others a
# dense MLP of base_mlp_dim.
MOE_PLACEMENT_KEYS = ("first_num_dense_layers", "decoder_sparse_step", "mlp_only_layers")


# The settings of the gated delta-net hybrids (Qwen3-Next, Qwen3.5: models/recurrent/hybrid.py), and those of them that fix
# the parameters' shapes.
HYBRID_SHAPE_KEYS = ("inhomogeneous_layer_cycle_interval", "gdn_num_key_heads", "gdn_num_value_heads",
                     "gdn_key_head_dim", "gdn_value_head_dim", "gdn_conv_kernel_dim")
HYBRID_KERNEL_SETTINGS = ("gdn_chunk_size", "gdn_kernel")  # how, not what, the gated delta rule computes
HYBRID_SETTINGS = ("partial_rotary_factor", *HYBRID_SHAPE_KEYS, *HYBRID_KERNEL_SETTINGS)

# Llama 4's decoder (models/llama4/): the settings its two families (llama4_text, llama4) read.
LLAMA4_SETTING_KEYS = ("chunk_attn_window_size", "nope_layer_interval", "use_qk_norm", "temperature_tuning",
                       "temperature_tuning_scale", "temperature_tuning_floor_scale")
LLAMA4_SETTINGS = ("decoder_sparse_step",) + LLAMA4_SETTING_KEYS
# Gemma 4's text decoder's settings (gemma4_text, and gemma4 with its vision tower), all fixing parameter shapes.
_GEMMA4_SHAPE_KEYS = ("global_head_dim", "global_num_kv_heads", "attention_k_eq_v", "per_layer_input_dim",
                      "num_kv_shared_layers", "double_wide_mlp")
# The settings of the families that read images through Qwen's tower (models/vision/qwen_images.py).
IMAGE_SETTINGS = ("vision_config", "image_token_id", "mrope_section")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), "LlamaForCausalLM"),
    Family("mistral", ("mistral",), "MistralForCausalLM", window_everywhere=True),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM"),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM"),
    Family("qwen3_vl", ("qwen3_vl",), "Qwen3VLForConditionalGeneration",
           settings=IMAGE_SETTINGS, shape_keys=("vision_config",),
           setting_keys=("image_token_id", "mrope_section")),
    Family("gemma2", ("gemma2",), "Gemma2ForCausalLM", attention_pattern=("sliding", "full"),
           usual=(("sliding_window_size", 4096),), settings=("attn_logits_soft_cap", "query_pre_attn_scalar")),
    Family("gemma3", ("gemma3_text", "gemma3"), "Gemma3ForCausalLM", attention_pattern=("sliding",) * 5 + ("full",),
           usual=(("sliding_window_size", 1024),),  # 512 in Gemma 3 1B
           settings=("attn_logits_soft_cap", "query_pre_attn_scalar")),
    Family("gemma4_text", ("gemma4_text",), "Gemma4ForCausalLM", moe=True, moe_optional=True,
           attention_pattern=("sliding",) * 5 + ("full",),
           usual=(("sliding_window_size", 512),), settings=_GEMMA4_SHAPE_KEYS, shape_keys=_GEMMA4_SHAPE_KEYS,
           setting_keys=("rope_proportion",)),
    Family("gemma4", ("gemma4",), "Gemma4ForConditionalGeneration", moe=True, moe_optional=True,
           attention_pattern=("sliding",) * 5 + ("full",), usual=(("sliding_window_size", 512),),
           settings=_GEMMA4_SHAPE_KEYS + ("vision_config", "image_token_id", "bidirectional_image_attention",
                                             "image_attention_span"),
           shape_keys=_GEMMA4_SHAPE_KEYS + ("vision_config",),
           setting_keys=("rope_proportion", "image_token_id", "bidirectional_image_attention"),
           kernel_settings=("image_attention_span",)),  # how far the banded image attention reads ahead
    Family("mixtral", ("mixtral",), "MixtralForCausalLM", moe=True, window_everywhere=True,
           usual=(("num_experts", 8),)),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", moe=True, window_everywhere=True,
           usual=(("num_experts", 128),), settings=("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")),
    Family("gpt_oss", ("gpt_oss",), "GptOssForCausalLM", moe=True, attention_sinks=True,
           attention_pattern=("sliding", "full"), usual=(("sliding_window_size", 128), ("num_experts", 32)),
           settings=("mlp_activations_limit", "swiglu_alpha"), setting_keys=("mlp_activations_limit", "swiglu_alpha")),
    Family("olmo3", ("olmo3",), "Olmo3ForCausalLM", attention_pattern=("sliding",) * 3 + ("full",),
           usual=(("sliding_window_size", 4096),)),
    Family("qwen3_next", ("qwen3_next",), "Qwen3NextForCausalLM", moe=True, per_layer_attention=False,
           usual=(("num_experts", 512),),
           settings=HYBRID_SETTINGS + ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                                       "shared_expert_mlp_dim"),
           shape_keys=HYBRID_SHAPE_KEYS + ("shared_experts", "shared_expert_mlp_dim"), setting_keys=("partial_rotary_factor",),
           kernel_settings=HYBRID_KERNEL_SETTINGS),
    Family("qwen3_5_text", ("qwen3_5_text",), "Qwen3_5ForCausalLM", per_layer_attention=False,
           settings=HYBRID_SETTINGS, shape_keys=HYBRID_SHAPE_KEYS,
           setting_keys=("partial_rotary_factor",), kernel_settings=HYBRID_KERNEL_SETTINGS),
    Family("qwen3_5_moe_text", ("qwen3_5_moe_text",), "Qwen3_5MoeForCausalLM", moe=True,
           per_layer_attention=False, usual=(("num_experts", 256),), settings=HYBRID_SETTINGS + ("shared_expert_mlp_dim",),
           shape_keys=HYBRID_SHAPE_KEYS + ("shared_experts", "shared_expert_mlp_dim"), setting_keys=("partial_rotary_factor",),
           kernel_settings=HYBRID_KERNEL_SETTINGS),
    # Qwen3.5's released checkpoints: the text decoders above with Qwen3-VL's tower (no deepstack) and M-RoPE
    Family("qwen3_5", ("qwen3_5",), "Qwen3_5ForConditionalGeneration", per_layer_attention=False,
           settings=HYBRID_SETTINGS + IMAGE_SETTINGS, shape_keys=HYBRID_SHAPE_KEYS + ("vision_config",),
           setting_keys=("partial_rotary_factor", "image_token_id", "mrope_section"),
           kernel_settings=HYBRID_KERNEL_SETTINGS),
    Family("qwen3_5_moe", ("qwen3_5_moe",), "Qwen3_5MoeForConditionalGeneration", moe=True,
           per_layer_attention=False, usual=(("num_experts", 256),),
           settings=HYBRID_SETTINGS + ("shared_expert_mlp_dim",) + IMAGE_SETTINGS,
           shape_keys=HYBRID_SHAPE_KEYS + ("shared_experts", "shared_expert_mlp_dim", "vision_config"),
           setting_keys=("partial_rotary_factor", "image_token_id", "mrope_section"),
           kernel_settings=HYBRID_KERNEL_SETTINGS),
    Family("deepseek", ("deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa"), "DeepseekV3ForCausalLM", moe=True, per_layer_attention=False,
           usual=(("num_experts", 256),),
           settings=("norm_topk_prob", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "rope_interleave", "first_num_dense_layers", "n_routing_groups",
                     "topk_routing_group", "routed_scaling_factor", "mtp_num_layers", "index_n_heads",
                     "index_head_dim", "index_topk", "index_rope_interleave", "indexer_types", "indexer_dtype"),
           mixer="mla", sparse_attention=True,
           shape_keys=("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                       "first_num_dense_layers", "shared_experts", "routed_bias", "mtp_num_layers", "index_n_heads",
                       "index_head_dim", "indexer_types"),
           setting_keys=("rope_interleave", "rope_mscale_all_dim", "n_routing_groups", "topk_routing_group",
                         "routed_scaling_factor", "index_topk", "index_rope_interleave"),
           kernel_settings=("indexer_dtype",)),  # the precision the indexer scores in, as dtype: not a model key
    Family("deepseek_v4", ("deepseek_v4",), "DeepseekV4ForCausalLM", moe=True, attention_pattern=("sliding",),
           usual=(("num_experts", 256), ("sliding_window_size", 128)),
           settings=("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "routed_scaling_factor",
                     "partial_rotary_factor", "mlp_activations_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
                     "o_groups", "o_lora_rank", "compress_rate_csa", "compress_rate_hca", "compress_rope_theta",
                     "compress_layer_types", "num_hash_layers"),
           shape_keys=("q_lora_rank", "index_n_heads", "index_head_dim", "hc_mult", "o_groups", "o_lora_rank",
                       "compress_rate_csa", "compress_rate_hca", "compress_layer_types", "num_hash_layers"),
           setting_keys=("index_topk", "routed_scaling_factor", "partial_rotary_factor", "mlp_activations_limit",
                         "hc_sinkhorn_iters", "hc_eps", "compress_rope_theta"),
           checks=(deepseek_v4_dims.check_config,),
           own_attention="its layers attend in their own plain-jnp form (the sliding window beside the compressed "
                         "entries and the CSA indexer's top-k, models/families/deepseek_v4/compressed.py), which no "
                         "kernel takes yet",
           tensor_keys=("base_num_query_heads", "index_n_heads", "base_moe_mlp_dim", "vocab_size"),
           fixed=(("load_balance_loss_weight", 0.0), ("router_z_loss_weight", 0.0)),
           fixed_why="its layers route by sqrt(softplus) scores and token hashes, with no router logits for a "
                     "balance or z loss (moe_load_min/max report the loads)"),
    Family("llama4_text", ("llama4_text",), "Llama4ForCausalLM", moe=True, per_layer_attention=False,
           usual=(("num_experts", 16),), settings=LLAMA4_SETTINGS, shape_keys=("shared_experts",),
           setting_keys=LLAMA4_SETTING_KEYS),
    # Llama 4 reading images (Llama4ForConditionalGeneration): llama4_text's decoder and the vision tower
    Family("llama4", ("llama4",), "Llama4ForConditionalGeneration", moe=True, per_layer_attention=False,
           usual=(("num_experts", 16),), settings=LLAMA4_SETTINGS + ("vision_config", "image_token_id"),
           shape_keys=("shared_experts", "vision_config"), setting_keys=LLAMA4_SETTING_KEYS + ("image_token_id",)),
    Family("minimax_m2", ("minimax_m2",), "MiniMaxM2ForCausalLM", moe=True, per_layer_attention=False,
           usual=(("num_experts", 256),), settings=("partial_rotary_factor",), shape_keys=("shared_experts", "routed_bias"),
           setting_keys=("partial_rotary_factor",)),
    Family("glm4_moe", ("glm4_moe",), "Glm4MoeForCausalLM", moe=True, per_layer_attention=False,
           usual=(("num_experts", 128),),
           settings=("norm_topk_prob", "first_num_dense_layers", "n_routing_groups", "topk_routing_group",
                     "routed_scaling_factor", "mtp_num_layers", "partial_rotary_factor", "use_qk_norm",
                     "attention_bias"),
           shape_keys=("first_num_dense_layers", "shared_experts", "routed_bias", "mtp_num_layers", "attention_bias"),
           # use_qk_norm fixes its shapes (q_norm, k_norm) but is llama4_text's setting key too: one list holds it
           setting_keys=("n_routing_groups", "topk_routing_group", "routed_scaling_factor", "partial_rotary_factor",
                         "use_qk_norm")),
)}

MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.moe)

# Downstream tasks of eval_tasks (maxtrain/evals/tasks.py builds each of these, and only these).
EVAL_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "lambada", "mmlu")

# Named choices a line of base.yml may use as its allowed values: `{$families}`.
NAMED_CHOICES = {"families": tuple(FAMILIES)}


def family_of_hf_model_type(model_type) -> Family | None:
    """The family that imports a Hugging Face config.json of this model_type, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)
