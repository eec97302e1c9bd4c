"""The model: params, RoPE, blocks, attention, MoE, the decoder stack, and the families over them.

    params.py     ParamSpec: every parameter declared once (shape, logical axes, initializer)
    rope.py       RoPE and its scaling variants (default, linear, llama3, yarn)
    ops.py        the matmul (`dense`) and small array helpers, with their CPU formulations
    attention.py  masks, the plain-jnp reference, the kernels' dispatch, the context-parallel form
    attention_check.py  implementations against the float32 reference; attention FLOPs (gpu_report.py)
    attention_choice.py what each attention implementation supports, autoselected's choice (per layer kind)
    mla.py        multi-head latent attention (DeepSeek): low-rank queries, a cached latent for keys and values
    blocks.py     norms, embedding, attention, gated MLPs, logits; FLOPs helpers
    layers.py     a layer's kind as data (LayerType): its parameter stack, mixer, attention, RoPE, head dim, MLP
    contract.py   the family contract (FamilyModel): everything the rest of maxtrain uses from a family
    standard_layers.py  the decoder layers several families share (pre-norm, Gemma's sandwich), embed, heads
    moe.py        the mixture-of-experts block: routers, dropless and capacity dispatch, experts,
                  balance losses, expert parallelism (docs/moe.md)
    moe_deepseek.py  DeepSeek's parts of it: sigmoid group-limited router, the selection bias and its
                  update outside the gradient, shared experts (docs/deepseek.md)
    moe_llama4.py Llama 4's router: sigmoid weights of the top-k logits on the experts' inputs
    decoder.py    the stack every family shares: layer types, scan over repeating groups, loss, decoding
    mtp.py        multi-token prediction (DeepSeek-V3): modules after the stack, predicting tokens further ahead
    distill.py    distillation's loss: KL to a frozen teacher's logits mixed with the next-token loss, tiled
    runtime.py    dtype, attention implementation, remat policy and vocab tiles resolved for a platform
    lora.py       LoRA adapters: their declarations, initialization and merge into the weights
    sampling.py   sampling with the KV cache: greedy, temperature, top-k, top-p
    hf.py         what the families share about Hugging Face names and config.json fields
    families/     one module per family of config/registry.py (llama, mistral, qwen2, qwen3, gemma2,
                  gemma3, mixtral, qwen3_moe, gpt_oss, deepseek, llama4_text, glm4_moe): declarations, layer
                  composition, HF mapping, FLOPs

`decoder_block` (MaxText's key; presets set it) picks the family. Every function here is a pure
function of (params, inputs, config, runtime). May import config, parallel and kernels (and errors);
never training, checkpointing, data or the commands.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import decoder, distill, moe, moe_deepseek
from maxtrain.models import params as params_lib
from maxtrain.models.families import FAMILIES
from maxtrain.models.params import ParamSpec, Params, count, is_spec
from maxtrain.models.runtime import PROJECTION_NAMES, REMAT_POLICIES, Runtime

# The config keys that describe a model. SHAPE_KEYS fix the parameters' shapes (a checkpoint that
# differs does not fit); SETTING_KEYS change what the same parameters compute (a checkpoint written
# with other values would load and silently compute something else, so loading one is refused). The
# keys every family shares are listed here; each family adds its own in its registry row
# (registry.Family.shape_keys, .setting_keys), and a family's `settings` are all model keys (test_house).
SHARED_SHAPE_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
                     "base_num_decoder_layers", "head_dim", "vocab_size", "logits_via_embedding", "num_experts",
                     "base_moe_mlp_dim", "decoder_sparse_step", "mlp_only_layers")
SHARED_SETTING_KEYS = ("decoder_block", "normalization_layer_epsilon", "rope_max_timescale", "rope_type",
                       "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow",
                       "rope_attention_factor", "rope_truncate", "local_rope_max_timescale", "sliding_window_size",
                       "attention_layer_types", "attn_logits_soft_cap", "final_logits_soft_cap",
                       "query_pre_attn_scalar", "num_experts_per_tok", "norm_topk_prob")


def _families_keys(field: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for row in registry.FAMILIES.values() for k in getattr(row, field)))


FAMILY_KEYS = tuple(dict.fromkeys(_families_keys("shape_keys") + _families_keys("setting_keys")))
SHAPE_KEYS = SHARED_SHAPE_KEYS + tuple(k for k in _families_keys("shape_keys") if k not in SHARED_SHAPE_KEYS)
SETTING_KEYS = SHARED_SETTING_KEYS + tuple(k for k in _families_keys("setting_keys") if k not in SHARED_SETTING_KEYS)
MODEL_KEYS = SHAPE_KEYS + SETTING_KEYS
# Model keys a checkpoint written before them may lack, which their base.yml defaults then describe: those
# added with the mixture-of-experts families (such a checkpoint is a dense model) and every family's own keys
# (a checkpoint of another family never reads them).
MOE_KEYS = ("num_experts", "base_moe_mlp_dim", "decoder_sparse_step", "mlp_only_layers", "num_experts_per_tok",
            "norm_topk_prob")
LATER_KEYS = MOE_KEYS + tuple(k for k in FAMILY_KEYS if k not in MOE_KEYS)

__all__ = ["FAMILIES", "MODEL_KEYS", "MOE_KEYS", "LATER_KEYS", "SHAPE_KEYS", "SETTING_KEYS", "ParamSpec", "Params",
           "Runtime", "REMAT_POLICIES", "PROJECTION_NAMES", "family", "param_specs", "num_params", "num_active_params",
           "is_moe", "init_params", "forward", "loss_fn", "distill_loss_fn", "objective", "update_outside_gradient",
           "split_step_stats", "init_cache", "forward_with_cache", "flops_per_token", "is_spec"]


def family(config):
    """The family module that `config.decoder_block` names."""
    try:
        return FAMILIES[config.decoder_block]
    except KeyError:
        raise ValueError(f"decoder_block={config.decoder_block!r} is not a model family; "
                         f"use one of {', '.join(FAMILIES)}") from None


def param_specs(config) -> Params:
    """The declaration of every parameter, as a nested dict of ParamSpec."""
    return family(config).param_specs(config)


def num_params(config) -> int:
    return count(param_specs(config))


def num_active_params(config) -> int:
    """Parameters one token uses: all of a dense model; of a mixture of experts, K of its E experts."""
    return moe.active_params(param_specs(config), config)


def is_moe(config) -> bool:
    """Whether some layer of the model is a mixture of experts."""
    return any(t.is_moe for t in family(config).layer_types(config))


def init_params(config, key) -> Params:
    return params_lib.init_params(param_specs(config), key, config.weight_dtype)


def forward(params: Params, tokens, positions, segment_ids, config, rt: Runtime):
    """(logits [B, T, V] float32, aux dict of scalars) for tokens [B, T]."""
    return decoder.forward(family(config), params, tokens, positions, segment_ids, config, rt)


def loss_fn(params: Params, batch: dict, config, rt: Runtime):
    """(cross-entropy sum, weight sum, aux) for a batch of inputs/targets/positions/segment_ids/loss_weights."""
    return decoder.loss_fn(family(config), params, batch, config, rt)


def distill_loss_fn(params: Params, teacher_params: Params, batch: dict, config, teacher_config, rt: Runtime,
                    alpha: float, temperature: float):
    """(mixed loss sum, weight sum, aux, KL sum, next-token sum) of a student distilled from a frozen
    teacher of the same vocabulary (models/distill.py)."""
    return distill.loss_fn(family(config), params, family(teacher_config), teacher_params, batch, config,
                           teacher_config, rt, alpha, temperature)


def objective(loss_sum, weight_sum, aux: dict):
    """What training minimizes: the cross-entropy sum plus each aux loss (`*_loss`, a mean over tokens
    already multiplied by its weight) times the weight sum."""
    for name, value in aux.items():
        if name.endswith("_loss"):
            loss_sum = loss_sum + value * weight_sum
    return loss_sum


def update_outside_gradient(params: Params, old_params: Params, step_stats: dict, config) -> Params:
    """The state a train step changes outside the gradient, after the optimizer's update: the MoE router's
    selection bias (models/moe.py), from the step's statistics (aux entries named decoder.STEP_STATS)."""
    return moe_deepseek.update_router_bias(params, old_params, step_stats, config, family(config).layer_types(config))


def split_step_stats(aux: dict) -> tuple[dict, dict]:
    """(the aux metrics, the step statistics for update_outside_gradient) of one forward's aux."""
    stats = {k: v for k, v in aux.items() if k.startswith(decoder.STEP_STATS)}
    return {k: v for k, v in aux.items() if k not in stats}, stats


def init_cache(config, batch_size: int, max_length: int, dtype) -> dict:
    return decoder.init_cache(config, batch_size, max_length, dtype, family(config))


def forward_with_cache(params: Params, tokens, positions, cache: dict, index, config, rt: Runtime, first=None):
    return decoder.forward_with_cache(family(config), params, tokens, positions, cache, index, config, rt, first)


def flops_per_token(config, dense_attention: bool = False) -> float:
    """Training FLOPs per token from the family's formula (causal attention counted once, sliding
    windows counting only the keys attended; dense_attention=True counts every key, as a dense
    implementation computes them)."""
    return family(config).flops_per_token(config, dense_attention)
