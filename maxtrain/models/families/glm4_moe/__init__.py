"""GLM-4.5 and GLM-4.6 (Zhipu AI / Z.ai 2025; transformers' glm4_moe): grouped-query attention with partial
RoPE, optional qk-norm and q/k/v biases, dense first layers, then DeepSeek-V3's mixture of experts.

    x = x + attention(rmsnorm(x))    q, k, v = x W (+ b when attention_bias); q, k RMS-normed per head
                                     (use_qk_norm: GLM-4.5, not 4.5-Air); RoPE rotates the leading
                                     partial_rotary_factor (0.5) of each head's features, the rest pass
    x = x + moe(rmsnorm(x))          layers i >= first_num_dense_layers: s = sigmoid(router logits);
                                     experts chosen by s + bias (e_score_correction_bias) among the
                                     topk_routing_group best of n_routing_groups groups; weights s of the
                                     chosen (normalized when norm_topk_prob) x routed_scaling_factor;
                                     plus shared_experts always-on experts (models/moe/, sigmoid_groups.py)
    x = x + swiglu_mlp(rmsnorm(x))   the first first_num_dense_layers layers: a dense MLP of base_mlp_dim

Two layer kinds, "dense" then "moe" (as deepseek's). The next-token-prediction layers
(num_nextn_predict_layers) are models/mtp.py's modules with blocks of the "moe" kind: read by an import
with keep_mtp (the layers after num_hidden_layers in a checkpoint), never written by an export.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, moe, mtp, standard_layers
from maxtrain.models.layers import LayerType

FAMILY = registry.FAMILIES["glm4_moe"]  # its Hugging Face model_type and architecture
ROUTER = "sigmoid_group_topk"
DEFAULT_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig, where config.json states none


def layer_types(config) -> list[LayerType]:
    routed = "moe+shared" if config.shared_experts else "moe"
    return [LayerType(kind="dense" if i < config.first_num_dense_layers else "moe",
                      rope_fraction=config.partial_rotary_factor,
                      mlp="dense" if i < config.first_num_dense_layers else routed)
            for i in range(config.base_num_decoder_layers)]


def param_specs(model):
    config = model.config
    attention = dict(qkv_bias=config.attention_bias, qk_norm="ones" if config.use_qk_norm else None)
    per_kind = {"dense": standard_layers.decoder_specs(config, **attention),
                "moe": standard_layers.decoder_specs(config, mlp=moe.specs(config), **attention)}
    out = {**blocks.embedding_specs(config), "layers": standard_layers.stacks(config, model.layer_types, per_kind)}
    if config.mtp_num_layers > 0:
        out["mtp"] = mtp.specs(config, per_kind["moe"])
    return out


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    return standard_layers.prenorm_layer(x, p, inputs, layer_type, model, rt, router=ROUTER,
                                         num_moe_layers=config.base_num_decoder_layers - config.first_num_dense_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    """moe.flops_per_token's (attention, the router, a token's K routed experts, dense first layers, the head),
    plus the shared experts of each MoE layer (3 x 2 x 3 x D x shared_experts x F_e a token), and each MTP
    module's eh_proj [2D, D], its MoE block (shared experts included) and the shared head."""
    config = model.config
    types = model.layer_types
    d = config.base_emb_dim
    shared = 3.0 * 2 * 3 * d * config.shared_experts * moe.expert_dim(config)
    total = moe.flops_per_token(config, types, dense_attention) + shared * sum(t.is_moe for t in types)
    if config.mtp_num_layers > 0:
        block = moe.flops_per_token(config, types[-1:], dense_attention) - moe.flops_per_token(config, [], False)
        total += config.mtp_num_layers * (block + shared + 3.0 * 2 * (2 * d * d + d * config.vocab_size))
    return total


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
_MOE = {
    "router": ("mlp.gate.weight", hf.Linear(1)), "router_bias": ("mlp.gate.e_score_correction_bias", hf.SAME),
    "w_gate": ("mlp.experts.{j}.gate_proj.weight", hf.Linear(1)),
    "w_up": ("mlp.experts.{j}.up_proj.weight", hf.Linear(1)),
    "w_down": ("mlp.experts.{j}.down_proj.weight", hf.Linear(1)),
    "shared_gate": ("mlp.shared_experts.gate_proj.weight", hf.Linear(1)),
    "shared_up": ("mlp.shared_experts.up_proj.weight", hf.Linear(1)),
    "shared_down": ("mlp.shared_experts.down_proj.weight", hf.Linear(1)),
}
_ATTENTION = {**hf.ATTENTION_NAMES, **hf.QKV_BIAS_NAMES, **hf.QK_NORM_NAMES,
              **{f"layers/decoder/{k}": (f"model.layers.{{i}}.{v}", hf.SAME) for k, v in _NORMS.items()}}
_MOE_NAMES = {f"layers/moe/{k}": (f"model.layers.{{i}}.{name}", n_in) for k, (name, n_in) in _MOE.items()}
# The MTP modules (params["mtp"]); "{i}" is num_hidden_layers + the module's index (checkpointing/convert.py).
# Their embed_tokens and shared_head.head are copies of the model's, which maxtrain shares instead.
_MTP_OWN = {"enorm": ("enorm.weight", hf.SAME), "hnorm": ("hnorm.weight", hf.SAME),
            "eh_proj": ("eh_proj.weight", hf.Linear(1)),
            "final_norm": ("shared_head.norm.weight", hf.SAME)}
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

HF_NAMES = {**hf.EMBEDDING_NAMES, **hf.for_kind(_ATTENTION, "dense"), **hf.for_kind(_ATTENTION, "moe"),
            **hf.for_kind(hf.MLP_NAMES, "dense"), **_MOE_NAMES,
            **{k.replace("layers/moe/", "mtp/"): v
               for k, v in {**hf.for_kind(_ATTENTION, "moe"), **_MOE_NAMES}.items()},
            **{f"mtp/{k}": (f"model.layers.{{i}}.{name}", n_in) for k, (name, n_in) in _MTP_OWN.items()}}


def rotary_factor(config: dict, rope: dict) -> float:
    """partial_rotary_factor as transformers reads it: the RoPE parameters' own, else the top-level field,
    else Glm4MoeConfig's default 0.5."""
    for value in (rope.get("partial_rotary_factor"), config.get("partial_rotary_factor")):
        if value is not None:
            return float(value)
    return DEFAULT_ROTARY_FACTOR


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """maxtrain's keys from config.json; a field the file omits takes transformers' Glm4MoeConfig default
    (first_k_dense_replace 1, n_group 1, routed_scaling_factor 1.0, partial_rotary_factor 0.5, ...)."""
    hf.refuse(config, {"hidden_act": "silu"})
    rope = hf.rope_dict(config, notes)
    factor = rotary_factor(config, rope)
    without = {k: v for k, v in config.items() if k != "partial_rotary_factor"}  # hf refuses partial RoPE
    groups = hf.count(config, "n_group", 1)
    top_groups = hf.count(config, "topk_group", 1, null=groups)
    experts = config.get("n_routed_experts", config.get("num_local_experts"))
    if experts is None:
        raise hf.ConversionError("config.json has no 'n_routed_experts', which the model's shape needs")
    return {**hf.common_keys(without, rms_norm_eps=1e-5),
            **hf.rope_keys(without, notes, rope={k: v for k, v in rope.items() if k != "partial_rotary_factor"}),
            "partial_rotary_factor": factor,
            "use_qk_norm": bool(config.get("use_qk_norm", False)),
            "attention_bias": bool(config.get("attention_bias", False)),
            "num_experts": int(experts), "num_experts_per_tok": int(config.get("num_experts_per_tok", 8)),
            "base_moe_mlp_dim": int(config.get("moe_intermediate_size", 1408)),
            "shared_experts": hf.count(config, "n_shared_experts", 1, least=0, null=0),
            "n_routing_groups": groups if groups > 1 else -1,
            "topk_routing_group": top_groups if groups > 1 else -1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)), "routed_bias": True,
            "first_num_dense_layers": hf.count(config, "first_k_dense_replace", 1, least=0, null=0)}


def to_hf_config(keys: dict) -> dict:
    rope = {**hf.rope_parameters(keys), "partial_rotary_factor": keys["partial_rotary_factor"]}
    groups = keys["n_routing_groups"] if keys["n_routing_groups"] > 0 else 1
    return {**hf.common_config(keys, FAMILY), "rope_parameters": rope, "hidden_act": "silu",
            "attention_bias": keys["attention_bias"], "use_qk_norm": keys["use_qk_norm"],
            "n_routed_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "moe_intermediate_size": keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"],
            "n_shared_experts": keys["shared_experts"],
            "n_group": groups, "topk_group": keys["topk_routing_group"] if keys["topk_routing_group"] > 0 else groups,
            "routed_scaling_factor": keys["routed_scaling_factor"], "norm_topk_prob": keys["norm_topk_prob"],
            "first_k_dense_replace": keys["first_num_dense_layers"], "num_nextn_predict_layers": 0}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config, mtp_copies=MTP_COPIES)
