"""DeepSeek-V3 (DeepSeek-AI 2024; R1 shares its architecture): multi-head latent attention, and a mixture of
experts with shared experts, a sigmoid group-limited router and aux-loss-free balancing.

    x = x + mla(rmsnorm(x))          low-rank queries and keys/values, one RoPE key for all heads (models/families/deepseek/mla.py)
    x = x + moe(rmsnorm(x))          layers i >= first_num_dense_layers:
                                     s = sigmoid(router logits); experts chosen by s + bias among the
                                     topk_routing_group best of n_routing_groups groups; weights s of the
                                     chosen, normalized, x routed_scaling_factor; plus shared_experts
                                     always-on experts (models/moe/)
    x = x + swiglu_mlp(rmsnorm(x))   the first first_num_dense_layers layers: a dense MLP of base_mlp_dim

The selection bias (`router_bias`, Hugging Face's e_score_correction_bias) is a parameter the optimizer
never changes; with routed_bias_update_rate > 0 the train step moves it after each step by the sign rule
(sigmoid_groups.update_router_bias). Two layer kinds, "dense" then "moe", as qwen3_moe's.

Multi-token prediction (mtp_num_layers; Hugging Face's num_nextn_predict_layers): models/mtp.py, its modules'
blocks of the "moe" kind; their weights are params["mtp"], the layers after num_hidden_layers in a Hugging Face
checkpoint (read by an import with keep_mtp, never written by an export: transformers has no MTP).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, moe, mtp, standard_layers
from maxtrain.models.families.deepseek import mla
from maxtrain.models.layers import LayerType
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["deepseek"]  # its Hugging Face model_type and architecture
ROUTER = "sigmoid_group_topk"


def layer_types(config) -> list[LayerType]:
    return [LayerType(kind="dense", mixer="mla") if i < config.first_num_dense_layers else
            LayerType(kind="moe", mixer="mla", mlp="moe+shared" if config.shared_experts else "moe")
            for i in range(config.base_num_decoder_layers)]


def rope_head_dim(config) -> int:
    """RoPE rotates MLA's qk_rope_head_dim features (one key shared by every head), not the whole head."""
    return config.qk_rope_head_dim


def param_specs(model):
    config = model.config
    attention = {"attn_norm": blocks.norm_spec(config), **mla.specs(config), "mlp_norm": blocks.norm_spec(config)}
    per_kind = {"dense": {**attention, **blocks.mlp_specs(config)}, "moe": {**attention, **moe.specs(config)}}
    out = {**blocks.embedding_specs(config), "layers": standard_layers.stacks(config, model.layer_types, per_kind)}
    if config.mtp_num_layers > 0:
        out["mtp"] = mtp.specs(config, per_kind["moe"])
    return out


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps = config.normalization_layer_epsilon
    h, aux = mla.attention(blocks.rms_norm(x, p["attn_norm"], eps), p, inputs, config, rt)
    x = shard(x + h, ("batch", "length", "embed"))
    normed = blocks.rms_norm(x, p["mlp_norm"], eps)
    if layer_type.is_moe:
        h, moe_aux = moe.block(normed, p, inputs.segment_ids, config, rt, router=ROUTER,
                               num_moe_layers=config.base_num_decoder_layers - config.first_num_dense_layers,
                               routing=inputs.routing)
        aux = {**aux, **moe_aux}
    else:
        h = blocks.mlp(normed, p, rt, "silu")
    return shard(x + h, ("batch", "length", "embed")), aux


def flops_per_token(model, dense_attention: bool = False) -> float:
    """Training FLOPs per token: 3 x (2 x the weights a token multiplies + MLA's scores and values), with
    a token's K routed experts, the shared experts and the router in MoE layers (moe.flops_per_token)."""
    config = model.config
    d, f_e = config.base_emb_dim, moe.expert_dim(config)
    routed = d * config.num_experts + (config.num_experts_per_tok + config.shared_experts) * 3 * d * f_e
    mlps = [routed if t.is_moe else 3 * d * config.base_mlp_dim for t in model.layer_types]
    matmul = sum(mla.matmul_params(config) + m for m in mlps) + d * config.vocab_size
    depth = config.mtp_num_layers  # each MTP module: eh_proj, one MoE block and the shared head (models/mtp.py)
    matmul += depth * (2 * d * d + mla.matmul_params(config) + routed + d * config.vocab_size)
    return 3.0 * (2 * matmul + mla.attention_flops(config, config.base_num_decoder_layers + depth, dense_attention))


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_ATTENTION = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": ("self_attn.q_proj.weight", hf.Linear(1)), "wq_a": ("self_attn.q_a_proj.weight", hf.Linear(1)),
    "q_a_norm": "self_attn.q_a_layernorm.weight", "wq_b": ("self_attn.q_b_proj.weight", hf.Linear(1)),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", hf.Linear(1)), "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": ("self_attn.kv_b_proj.weight", hf.Linear(1)), "wo": ("self_attn.o_proj.weight", hf.Linear(2)),
}
_MOE = {
    "router": ("mlp.gate.weight", hf.Linear(1)), "router_bias": "mlp.gate.e_score_correction_bias",
    "w_gate": ("mlp.experts.{j}.gate_proj.weight", hf.Linear(1)),
    "w_up": ("mlp.experts.{j}.up_proj.weight", hf.Linear(1)),
    "w_down": ("mlp.experts.{j}.down_proj.weight", hf.Linear(1)),
    "shared_gate": ("mlp.shared_experts.gate_proj.weight", hf.Linear(1)),
    "shared_up": ("mlp.shared_experts.up_proj.weight", hf.Linear(1)),
    "shared_down": ("mlp.shared_experts.down_proj.weight", hf.Linear(1)),
}


def _names(kind: str, table: dict) -> dict:
    return {f"layers/{kind}/{name}": (f"model.layers.{{i}}.{v}", hf.SAME) if isinstance(v, str)
            else (f"model.layers.{{i}}.{v[0]}", v[1]) for name, v in table.items()}


# The MTP modules (params["mtp"]); "{i}" is num_hidden_layers + the module's index (checkpointing/convert.py).
# Their embed_tokens and shared_head.head are copies of the model's, which maxtrain shares instead.
_MTP = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": ("eh_proj.weight", hf.Linear(1)),
        "final_norm": "shared_head.norm.weight", **_ATTENTION, **_MOE}
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

HF_NAMES = {**hf.EMBEDDING_NAMES, **_names("dense", _ATTENTION), **_names("moe", _ATTENTION), **_names("moe", _MOE),
            **hf.for_kind(hf.MLP_NAMES, "dense"),
            **{k.replace("layers/mtp/", "mtp/"): v for k, v in _names("mtp", _MTP).items()}}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """maxtrain's keys from config.json; a field the file omits takes transformers' DeepseekV3Config default
    (n_group 8, topk_group 4, routed_scaling_factor 2.5, q_lora_rank 1536, ...), as transformers reads it."""
    # DeepSeek-V3's router: sigmoid scores, top-k within the best groups by the biased scores (noaux_tc)
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid",
                       "topk_method": "noaux_tc"})
    rope = hf.rope_dict(config, notes)
    heads = hf.require(config, "num_attention_heads")
    nope, rope_dim = int(hf.require(config, "qk_nope_head_dim")), int(hf.require(config, "qk_rope_head_dim"))
    groups = hf.count(config, "n_group", 8, null=1)
    top_groups = hf.count(config, "topk_group", 4, null=groups)
    return {**hf.common_keys(config), **hf.rope_keys(config, notes, rope=rope),
            "base_num_kv_heads": heads, "head_dim": nope + rope_dim,
            "num_experts": int(hf.require(config, "n_routed_experts")),
            "num_experts_per_tok": int(hf.require(config, "num_experts_per_tok")),
            "base_moe_mlp_dim": int(hf.require(config, "moe_intermediate_size")),
            "shared_experts": hf.count(config, "n_shared_experts", 1, least=0, null=0),
            "n_routing_groups": groups if groups > 1 else -1,
            "topk_routing_group": top_groups if groups > 1 else -1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 2.5)),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)), "routed_bias": True,
            "first_num_dense_layers": hf.count(config, "first_k_dense_replace", 3, least=0, null=0),
            "q_lora_rank": hf.count(config, "q_lora_rank", 1536, least=0, null=0),
            "kv_lora_rank": int(hf.require(config, "kv_lora_rank")),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope_dim, "v_head_dim": int(hf.require(config, "v_head_dim")),
            "rope_interleave": bool(config.get("rope_interleave", True)),
            "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}


def to_hf_config(keys: dict) -> dict:
    rope = hf.rope_parameters(keys)
    if keys["rope_type"] != "default" and keys["rope_mscale_all_dim"] > 0:
        rope["mscale_all_dim"] = keys["rope_mscale_all_dim"]  # the scores' scale; cos and sin: attention_factor
    groups = keys["n_routing_groups"] if keys["n_routing_groups"] > 0 else 1
    out = {**hf.common_config(keys, FAMILY), "rope_parameters": rope, "rope_theta": keys["rope_max_timescale"],
           "hidden_act": "silu", "attention_bias": False,
           "n_routed_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
           "moe_intermediate_size": keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"], "n_shared_experts": keys["shared_experts"],
           "n_group": groups, "topk_group": keys["topk_routing_group"] if keys["topk_routing_group"] > 0 else groups,
           "routed_scaling_factor": keys["routed_scaling_factor"], "norm_topk_prob": keys["norm_topk_prob"],
           "first_k_dense_replace": keys["first_num_dense_layers"], "q_lora_rank": keys["q_lora_rank"] or None,
           "kv_lora_rank": keys["kv_lora_rank"], "qk_nope_head_dim": keys["qk_nope_head_dim"],
           "qk_rope_head_dim": keys["qk_rope_head_dim"], "v_head_dim": keys["v_head_dim"],
           "rope_interleave": keys["rope_interleave"], "num_nextn_predict_layers": 0}
    out["head_dim"] = keys["qk_rope_head_dim"]  # transformers' DeepseekV3Config: the RoPE width
    return out


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config, rope_head_dim=rope_head_dim,
    cache_heads=mla.cache_heads, mtp_copies=MTP_COPIES)
