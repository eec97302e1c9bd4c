"""MiniMax-M2 (MiniMax 2025; transformers' minimax_m2; M2.1 and M2.5 share its shape): grouped-query attention with
qk-norm over all heads and partial RoPE, and a mixture of experts in every layer routed by sigmoid scores with a
selection bias.

    x = x + attention(rmsnorm(x))    q, k = rmsnorm_{N*H}(x W_q), rmsnorm_{G*H}(x W_k): each norm spans all heads'
                                     features together (one scale of N*H / G*H, as OLMo's), before RoPE; RoPE
                                     rotates the leading partial_rotary_factor of each head (config.json's
                                     rotary_dim / head_dim: 64 of 128), the rest pass
    x = x + moe(rmsnorm(x))          s = sigmoid(router logits); the K experts of highest s + bias
                                     (e_score_correction_bias, aux-loss-free balancing: models/moe/sigmoid_groups.py)
                                     weighted by their s normalised to sum to 1; no groups, no scaling, no shared
                                     expert (shared_experts > 0 builds one, which transformers' class cannot export)

One layer kind, "moe". Mixtral's tensor names on disk (block_sparse_moe.experts.{j}.w1/w2/w3), the selection bias
beside the router. The released config.json's multi-token-prediction fields (use_mtp, num_mtp_modules) describe
modules transformers does not build; the import leaves them out and says so.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, moe, standard_layers
from maxtrain.models.layers import LayerType

FAMILY = registry.FAMILIES["minimax_m2"]  # its Hugging Face model_type and architecture
ROUTER = "sigmoid_group_topk"  # with one group and a scaling of 1: sigmoid scores, top-k by score + bias
DEFAULT_THETA = 5_000_000.0  # transformers' MiniMaxM2Config.default_theta


def layer_types(config) -> list[LayerType]:
    mlp = "moe+shared" if config.shared_experts else "moe"
    return [LayerType(kind="moe", rope_fraction=config.partial_rotary_factor, mlp=mlp)
            for _ in range(config.base_num_decoder_layers)]


def param_specs(model):
    config = model.config
    layer = standard_layers.decoder_specs(config, mlp=moe.specs(config), qk_norm="ones", qk_norm_over_heads=True)
    return {**blocks.embedding_specs(config),
            "layers": standard_layers.stacks(config, model.layer_types, {"moe": layer})}


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    return standard_layers.prenorm_layer(x, p, inputs, layer_type, model, rt, router=ROUTER,
                                         num_moe_layers=model.config.base_num_decoder_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    """moe.flops_per_token's (attention, the router, a token's K routed experts, the head), plus the shared experts
    where there are any (3 x 2 x 3 x D x shared_experts x F_e a token and layer)."""
    config = model.config
    shared = 3.0 * 2 * 3 * config.base_emb_dim * config.shared_experts * moe.expert_dim(config)
    return moe.flops_per_token(config, model.layer_types, dense_attention) + shared * config.base_num_decoder_layers


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_MOE = "model.layers.{i}.block_sparse_moe"
HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    "layers/moe/attn_norm": ("model.layers.{i}.input_layernorm.weight", hf.SAME),
    "layers/moe/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", hf.SAME),
    **hf.for_kind(hf.ATTENTION_NAMES, "moe"),
    "layers/moe/q_norm": ("model.layers.{i}.self_attn.q_norm.weight", hf.FLAT),
    "layers/moe/k_norm": ("model.layers.{i}.self_attn.k_norm.weight", hf.FLAT),
    "layers/moe/router": (f"{_MOE}.gate.weight", hf.Linear(1)),
    "layers/moe/router_bias": (f"{_MOE}.e_score_correction_bias", hf.SAME),
    "layers/moe/w_gate": (f"{_MOE}.experts.{{j}}.w1.weight", hf.Linear(1)),
    "layers/moe/w_up": (f"{_MOE}.experts.{{j}}.w3.weight", hf.Linear(1)),
    "layers/moe/w_down": (f"{_MOE}.experts.{{j}}.w2.weight", hf.Linear(1)),
}


def rotary_factor(config: dict, rope: dict) -> float:
    """The fraction of each head RoPE rotates, as transformers reads it: the RoPE parameters' or the top-level
    partial_rotary_factor, else the released checkpoints' rotary_dim / head_dim, else all of it."""
    for value in (rope.get("partial_rotary_factor"), config.get("partial_rotary_factor")):
        if value is not None:
            return float(value)
    if config.get("rotary_dim") is not None:
        return int(config["rotary_dim"]) / int(config.get("head_dim") or 128)
    return 1.0


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """maxtrain's keys from config.json; a field the file omits takes transformers' MiniMaxM2Config default."""
    hf.refuse(config, {"hidden_act": "silu"})
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise hf.ConversionError(f"config.json's scoring_func={config['scoring_func']!r}: MiniMax-M2's router "
                                 "scores experts with a sigmoid (transformers' MiniMaxM2 does), nothing else")
    if notes is not None and (config.get("use_mtp") or config.get("num_mtp_modules")):
        notes.append(f"num_mtp_modules={config.get('num_mtp_modules')} (MiniMax-M2's multi-token-prediction modules): "
                     "transformers builds none, and the import leaves their weights out")
    rope = hf.rope_dict(config, notes)
    factor = rotary_factor(config, rope)
    without = {k: v for k, v in config.items() if k not in ("partial_rotary_factor", "rotary_dim")}
    return {**hf.common_keys(without, rms_norm_eps=1e-6),
            **hf.rope_keys(without, notes, rope={k: v for k, v in rope.items() if k != "partial_rotary_factor"},
                           default_theta=DEFAULT_THETA),
            "partial_rotary_factor": factor, **hf.experts_keys(config),
            "base_moe_mlp_dim": -1, "routed_bias": True, "norm_topk_prob": True}


def to_hf_config(keys: dict) -> dict:
    if keys["shared_experts"] > 0:
        raise hf.ConversionError(f"shared_experts={keys['shared_experts']}: transformers' MiniMaxM2 has no shared "
                                 "expert, so this model cannot be exported as one")
    if not keys["routed_bias"]:
        raise hf.ConversionError("routed_bias=false: transformers' MiniMaxM2 always adds its selection bias "
                                 "(e_score_correction_bias); export a model trained with routed_bias=true")
    rope = {**hf.rope_parameters(keys), "partial_rotary_factor": keys["partial_rotary_factor"]}
    out = {**hf.common_config(keys, FAMILY), "rope_parameters": rope, "hidden_act": "silu",
           "num_local_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"]}
    if keys["base_moe_mlp_dim"] > 0:
        out["intermediate_size"] = keys["base_moe_mlp_dim"]  # the experts' width; MiniMax-M2 has no dense MLP
    return out


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config)
