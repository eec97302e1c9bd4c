"""The hybrid stack of Qwen3-Next and Qwen3.5: gated delta-net layers beside gated full attention.

    x = x + mixer(rmsnorm(x))        layer i with (i + 1) % inhomogeneous_layer_cycle_interval == 0: attention
                                     with qk-norm, RoPE on the leading partial_rotary_factor of each head, and
                                     its output gated per feature by sigmoid(x W_g) (blocks.attention, "wg");
                                     the other layers: the gated delta-net (models/recurrent/gated_deltanet.py)
    x = x + mlp(rmsnorm(x))          with num_experts > 1: softmax over the E router logits, top K (renormalized
                                     with norm_topk_prob), plus a shared expert of shared_experts x
                                     base_moe_mlp_dim (or its own width, shared_expert_mlp_dim) scaled by
                                     sigmoid(x . w) (sigmoid_groups.shared_experts);
                                     dense where mlp_only_layers / decoder_sparse_step say so (Qwen3-MoE's rule);
                                     without experts, a gated MLP of base_mlp_dim (Qwen3.5's dense models)

Norms are in the (1 + scale) form, scale 0 at initialization (the final norm and qk-norm too). Layer kinds
(parameter stacks): "full_moe", "linear_moe", "full_dense", "linear_dense". The families (qwen3_next,
qwen3_5_text, qwen3_5_moe_text) differ in their Hugging Face layouts only. Decoding (`layer_cache`): the
attention layers keep k and v, the gated delta-net layers their rule state and convolution window.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.models import blocks, contract, hf, moe
from maxtrain.models.moe import sigmoid_groups
from maxtrain.models.recurrent import gated_deltanet, hf_layouts
from maxtrain.models.layers import LayerType
from maxtrain.models.params import ParamSpec, dense
from maxtrain.models.standard_layers import stacks
from maxtrain.parallel.sharding import shard

ROUTER = "softmax_topk"
KINDS = ("full_moe", "linear_moe", "full_dense", "linear_dense")


def is_moe_layer(config, i: int) -> bool:
    return i not in config.mlp_only_layers and config.num_experts > 1 and (i + 1) % config.decoder_sparse_step == 0


def is_full_layer(config, i: int) -> bool:
    return (i + 1) % config.inhomogeneous_layer_cycle_interval == 0


def layer_types(config) -> list[LayerType]:
    out = []
    for i in range(config.base_num_decoder_layers):
        mlp = "moe+shared" if is_moe_layer(config, i) and config.shared_experts else (
            "moe" if is_moe_layer(config, i) else "dense")
        kind = ("full" if is_full_layer(config, i) else "linear") + ("_moe" if mlp != "dense" else "_dense")
        if is_full_layer(config, i):
            out.append(LayerType(kind=kind, rope_fraction=config.partial_rotary_factor, mlp=mlp))
        else:
            out.append(LayerType(kind=kind, mixer="linear", attention="none", rope=None, mlp=mlp))
    return out


def layer_cache(config, layer_type: LayerType, batch: int, max_length: int, kv_heads) -> dict:
    """A layer's decoding cache (the family contract's `layer_cache`): attention's k, v or the gated delta-net's."""
    if layer_type.mixer == "linear":
        return gated_deltanet.cache_spec(config, batch)
    return contract.kv_layer_cache(config, layer_type, batch, max_length, kv_heads)


def _norm(config) -> ParamSpec:
    return blocks.norm_spec(config, "zeros")


def param_specs(model):
    config = model.config
    attention = blocks.attention_specs(config, qk_norm="zeros", out_gate=True)
    mlps = {"moe": {**moe.specs(config), "shared_expert_gate": dense((config.base_emb_dim, 1), ("embed", None),
                                                                     config.base_emb_dim)},
            "dense": blocks.mlp_specs(config)}
    per_kind = {f"{mixer}_{mlp}": {"attn_norm": _norm(config), **mixer_specs, "mlp_norm": _norm(config), **mlp_specs}
                for mixer, mixer_specs in (("full", attention), ("linear", gated_deltanet.specs(config)))
                for mlp, mlp_specs in mlps.items()}
    return {**blocks.embedding_specs(config, norm_init="zeros"),
            "layers": stacks(config, model.layer_types, per_kind)}


def embed(params, tokens, config, rt):
    return blocks.embed(params["token_embedding"], tokens, rt.dtype)


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps = config.normalization_layer_epsilon
    normed = blocks.rms_norm(x, p["attn_norm"], eps, plus_one=True)
    if layer_type.mixer == "linear":
        if inputs.cache is None:
            h, aux = gated_deltanet.mixer(normed, p, inputs.segment_ids, config, rt), {}
        else:  # decoding: the slots from `index`, those before a left-padded row's `first` skipped
            state, window, index, first = inputs.cache
            slots = index + jnp.arange(x.shape[1])[None, :]
            valid = jnp.ones(x.shape[:2], bool) if first is None else slots >= first[:, None]
            h, new = gated_deltanet.mixer(normed, p, inputs.segment_ids, config, rt, cache=(state, window, valid))
            aux = {"cache": new}
    else:
        h, aux = blocks.attention(normed, p, inputs, config, rt, layer_type, norm_plus_one=True)
    x = shard(x + h, ("batch", "length", "embed"))
    normed = blocks.rms_norm(x, p["mlp_norm"], eps, plus_one=True)
    if layer_type.is_moe:
        h, moe_aux = moe.block(normed, p, inputs.segment_ids, config, rt, router=ROUTER,
                               num_moe_layers=model.num_moe_layers, routing=inputs.routing)
        aux = {**aux, **moe_aux}
    else:
        h = blocks.mlp(normed, p, rt, "silu")
    return shard(x + h, ("batch", "length", "embed")), aux


def logits(params, x, config, rt):
    return blocks.logits(params, x, config, rt, norm_plus_one=True)


def flops_per_token(model, dense_attention: bool = False) -> float:
    """Training FLOPs per token: 3 x (2 x the weights a token multiplies + attention's scores and the delta rule)."""
    config = model.config
    d, n, g, h = config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
    types = model.layer_types
    f_e = moe.expert_dim(config)
    shared = sigmoid_groups.shared_width(config.shared_experts, config.shared_expert_mlp_dim, f_e)
    moe_mlp = d * config.num_experts + config.num_experts_per_tok * 3 * d * f_e + 3 * d * shared + d
    matmul = d * config.vocab_size
    for t in types:
        mixer = 3 * d * n * h + 2 * d * g * h if t.mixer == "attention" else gated_deltanet.matmul_params(config)
        matmul += mixer + (moe_mlp if t.is_moe else 3 * d * config.base_mlp_dim)
    rules = sum(gated_deltanet.rule_flops(config) for t in types if t.mixer == "linear")
    full = [t for t in types if t.mixer == "attention"]
    return 3.0 * (2 * matmul + blocks.attention_flops(config, full, dense_attention) + rules)


# --------------------------------------------------------------------------------------------
# Hugging Face names the families share ("{i}": the layer's index in the whole stack)
# --------------------------------------------------------------------------------------------

HF_NORMS = {"attn_norm": ("input_layernorm.weight", hf.SAME), "mlp_norm": ("post_attention_layernorm.weight", hf.SAME)}
HF_FULL = {"wk": ("self_attn.k_proj.weight", hf.Linear(1)), "wv": ("self_attn.v_proj.weight", hf.Linear(1)),
           "wo": ("self_attn.o_proj.weight", hf.Linear(2)), "q_norm": ("self_attn.q_norm.weight", hf.SAME),
           "k_norm": ("self_attn.k_norm.weight", hf.SAME),
           "wq": ("self_attn.q_proj.weight", hf_layouts.Grouped(0, ("wq", "wg"), "wq")),     # per head: query, then gate
           "wg": ("self_attn.q_proj.weight", hf_layouts.Grouped(1, ("wq", "wg"), "wq"))}
HF_LINEAR = {"conv": ("linear_attn.conv1d.weight", hf_layouts.DepthwiseConv()), "dt_bias": ("linear_attn.dt_bias", hf.SAME),
             "a_log": ("linear_attn.A_log", hf.SAME), "lin_norm": ("linear_attn.norm.weight", hf.SAME),
             "lin_wo": ("linear_attn.out_proj.weight", hf.Linear(2))}
HF_SHARED = {"shared_gate": ("mlp.shared_expert.gate_proj.weight", hf.Linear(1)),
             "shared_up": ("mlp.shared_expert.up_proj.weight", hf.Linear(1)),
             "shared_down": ("mlp.shared_expert.down_proj.weight", hf.Linear(1)),
             "shared_expert_gate": ("mlp.shared_expert_gate.weight", hf.Linear(1)),
             "router": ("mlp.gate.weight", hf.Linear(1))}
# Qwen3.5 keeps q, k and v of every head in one in_proj_qkv (all queries, then keys, then values), and z, b and a in
# projections of their own (Qwen3-Next fuses them per key head: its module has its own).
_QKV = ("lin_wq", "lin_wk", "lin_wv")
QWEN3_5_LINEAR = {**{p: ("linear_attn.in_proj_qkv.weight", hf_layouts.Grouped(i, _QKV)) for i, p in enumerate(_QKV)},
                  "lin_wz": ("linear_attn.in_proj_z.weight", hf.Linear(1)),
                  "lin_wb": ("linear_attn.in_proj_b.weight", hf.Linear(1)),
                  "lin_wa": ("linear_attn.in_proj_a.weight", hf.Linear(1))}
HF_DENSE = {"w_gate": ("mlp.gate_proj.weight", hf.Linear(1)), "w_up": ("mlp.up_proj.weight", hf.Linear(1)),
            "w_down": ("mlp.down_proj.weight", hf.Linear(1))}


def hf_names(linear: dict, experts: dict | None) -> dict:
    """A family's HF_NAMES from its gated delta-net projections' names and its experts' (None: a dense model)."""
    mlps = (("dense", HF_DENSE),) if experts is None else (("moe", {**HF_SHARED, **experts}), ("dense", HF_DENSE))
    return {**hf.EMBEDDING_NAMES,
            **{f"layers/{mixer}_{mlp}/{name}": (f"model.layers.{{i}}.{hf_name}", n_in)
               for mixer, mixer_names in (("full", HF_FULL), ("linear", {**HF_LINEAR, **linear}))
               for mlp, mlp_names in mlps
               for name, (hf_name, n_in) in {**HF_NORMS, **mixer_names, **mlp_names}.items()}}


def layer_cycle(config: dict) -> int:
    """inhomogeneous_layer_cycle_interval from config.json's layer_types (a ConversionError for another layout)."""
    layers = int(hf.require(config, "num_hidden_layers"))
    types = config.get("layer_types") or ["linear_attention"] * 3 + ["full_attention"]
    cycle = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), 0)
    expected = ["full_attention" if cycle and (i + 1) % cycle == 0 else "linear_attention" for i in range(layers)]
    if not cycle or list(types) != expected:
        raise hf.ConversionError(f"layer_types {types} is not a repeating cycle of linear_attention layers closed by a "
                                 "full_attention layer, the only layout maxtrain's hybrid stack implements")
    return cycle


def hf_keys(config: dict, notes: list | None, dense_mlp: bool = True) -> dict:
    """The keys every hybrid family reads from config.json: attention, partial RoPE, the gated delta-net, the cycle.
    dense_mlp=False: a family whose every layer has experts, whose config class writes no intermediate_size (Qwen3.5's
    mixtures of experts), so base_mlp_dim is not read."""
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False})
    rope = dict(hf.rope_dict(config, notes))
    partial = float(rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    return {**hf.common_keys(config, dense_mlp=dense_mlp), **hf.rope_keys(config, notes, rope=rope),
            "partial_rotary_factor": partial, "inhomogeneous_layer_cycle_interval": layer_cycle(config),
            "gdn_num_key_heads": int(hf.require(config, "linear_num_key_heads")),
            "gdn_num_value_heads": int(hf.require(config, "linear_num_value_heads")),
            "gdn_key_head_dim": int(hf.require(config, "linear_key_head_dim")),
            "gdn_value_head_dim": int(hf.require(config, "linear_value_head_dim")),
            "gdn_conv_kernel_dim": int(hf.require(config, "linear_conv_kernel_dim"))}


def experts_hf_keys(config: dict) -> dict:
    """The experts and the gated shared expert: one MLP of its own width (shared_expert_intermediate_size; 0 or absent:
    none), kept as shared_experts whole experts' widths where it is a multiple of theirs, else as
    shared_expert_mlp_dim."""
    moe_width = int(hf.require(config, "moe_intermediate_size"))
    shared_width = hf.count(config, "shared_expert_intermediate_size", 0, least=0)
    whole = shared_width % moe_width == 0
    return {**hf.experts_keys(config), "base_moe_mlp_dim": moe_width,
            "shared_experts": shared_width // moe_width if whole else 1,
            "shared_expert_mlp_dim": -1 if whole else shared_width}


def hf_config(keys: dict, family) -> dict:
    """config.json's fields every hybrid family writes (`family`: its registry row)."""
    layers, cycle = keys["base_num_decoder_layers"], keys["inhomogeneous_layer_cycle_interval"]
    rope = {**hf.rope_parameters(keys), "partial_rotary_factor": keys["partial_rotary_factor"]}
    return {**hf.common_config(keys, family), "rope_parameters": rope, "rope_theta": keys["rope_max_timescale"],
            "hidden_act": "silu", "attention_bias": False,
            "layer_types": ["full_attention" if (i + 1) % cycle == 0 else "linear_attention" for i in range(layers)],
            "linear_num_key_heads": keys["gdn_num_key_heads"], "linear_num_value_heads": keys["gdn_num_value_heads"],
            "linear_key_head_dim": keys["gdn_key_head_dim"], "linear_value_head_dim": keys["gdn_value_head_dim"],
            "linear_conv_kernel_dim": keys["gdn_conv_kernel_dim"]}


def experts_hf_config(keys: dict) -> dict:
    moe_width = keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"]
    return {"num_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "moe_intermediate_size": moe_width,
            "shared_expert_intermediate_size": sigmoid_groups.shared_width(keys["shared_experts"],
                                                                         keys["shared_expert_mlp_dim"], moe_width)}
