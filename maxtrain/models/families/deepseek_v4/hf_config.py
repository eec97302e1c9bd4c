"""DeepSeek-V4's config.json <-> maxtrain's model keys, as transformers 5.24's DeepseekV4Config reads the file
(its legacy fields folded in: compress_rate_csa / _hca, compress_ratios, num_hash_layers, qk_rope_head_dim)."""

from __future__ import annotations

from maxtrain.config import deepseek_v4_dims, registry
from maxtrain.config.deepseek_v4_dims import ATTENTION_KINDS, default_layer_types
from maxtrain.models import hf

_RATIO_KIND = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _rope_theta(config: dict, label: str, fallback: float) -> float:
    sub = (config.get("rope_parameters") or {}).get(label) or {}
    return float(sub.get("rope_theta", fallback))


def _rope_keys(config: dict, notes: list | None) -> dict:
    """maxtrain's rope_* keys for the compressed layers' RoPE (DeepSeek-V4 scales only theirs), from a nested
    rope_parameters {"main": ..., "compress": ...} or, as transformers folds them, flat YaRN keys in rope_parameters
    or rope_scaling; the sliding layers' ("main") must be default RoPE."""
    nested = config.get("rope_parameters") or {}
    if isinstance(nested.get("compress"), dict):
        main, sub = nested.get("main") or {}, dict(nested["compress"])
    else:
        main, sub = {}, {k: v for k, v in hf.rope_dict(config, notes).items() if k not in ("main", "compress")}
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise hf.ConversionError(f"config.json: rope_parameters['main'] is {main.get('rope_type', main.get('type'))!r} "
                                 "RoPE; DeepSeek-V4's sliding-window layers rotate by default RoPE (transformers too)")
    if sub.get("rope_type", sub.get("type", "default")) == "yarn" and sub.get("factor") is None:
        original = sub.get("original_max_position_embeddings")
        if not original or not config.get("max_position_embeddings"):
            raise hf.ConversionError("config.json: YaRN RoPE needs a 'factor' (or original_max_position_embeddings and "
                                     "max_position_embeddings to derive it)")
        sub["factor"] = config["max_position_embeddings"] / original
    try:
        yarn = deepseek_v4_dims.compress_yarn_from_hf(sub)
    except ValueError as e:
        raise hf.ConversionError(f"config.json: {e}") from None
    if not yarn:
        return {}
    return {"rope_type": "yarn", "rope_factor": yarn["compress_rope_factor"],
            "original_max_position_embeddings": yarn["compress_rope_original_max"],
            "rope_beta_fast": yarn["compress_rope_beta_fast"], "rope_beta_slow": yarn["compress_rope_beta_slow"]}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"scoring_func": "sqrtsoftplus", "hidden_act": "silu", "attention_bias": False,
                       "mlp_bias": False, "num_key_value_heads": 1, "n_shared_experts": 1, "norm_topk_prob": True,
                       "tie_word_embeddings": False})
    n = hf.require(config, "num_hidden_layers")
    head_dim = hf.count(config, "head_dim", 512)
    rates = dict(config.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    rates["compressed_sparse_attention"] = config.get("compress_rate_csa", rates["compressed_sparse_attention"])
    rates["heavily_compressed_attention"] = config.get("compress_rate_hca", rates["heavily_compressed_attention"])
    types = config.get("layer_types")
    if types is None and config.get("compress_ratios") is not None:
        types = [_RATIO_KIND[r] for r in config["compress_ratios"]]
    types = list(types or default_layer_types(n))[:n]
    if any(t not in ATTENTION_KINDS for t in types):
        raise hf.ConversionError(f"config.json: layer_types {types} has entries outside {ATTENTION_KINDS}")
    mlp = config.get("mlp_layer_types")
    if mlp is None:
        hashed = hf.count(config, "num_hash_layers", 3, least=0)
        mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    mlp = list(mlp)[:n]
    hashed = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * hashed + ["moe"] * (n - hashed):
        raise hf.ConversionError(f"config.json: mlp_layer_types {mlp}: maxtrain's deepseek_v4 takes hash_moe layers "
                                 "only first, then moe (num_hash_layers)")
    prf = config.get("partial_rotary_factor")
    if prf is None:
        prf = config["qk_rope_head_dim"] / head_dim if config.get("qk_rope_head_dim") else 64 / 512
    rope_theta = float(config.get("rope_theta", 10000.0))
    return {
        "base_emb_dim": hf.require(config, "hidden_size"), "base_num_query_heads": hf.require(config, "num_attention_heads"),
        "base_num_kv_heads": 1, "base_num_decoder_layers": n, "head_dim": head_dim,
        "vocab_size": hf.require(config, "vocab_size"),
        "normalization_layer_epsilon": float(config.get("rms_norm_eps", 1e-6)), "logits_via_embedding": False,
        "rope_max_timescale": _rope_theta(config, "main", rope_theta),
        "compress_rope_theta": _rope_theta(config, "compress", float(config.get("compress_rope_theta", 160000.0))),
        "partial_rotary_factor": float(prf), "q_lora_rank": hf.count(config, "q_lora_rank", 1024),
        "o_groups": hf.count(config, "o_groups", 8), "o_lora_rank": hf.count(config, "o_lora_rank", 1024),
        "sliding_window_size": hf.count(config, "sliding_window", 128),
        "compress_rate_csa": int(rates["compressed_sparse_attention"]),
        "compress_rate_hca": int(rates["heavily_compressed_attention"]),
        "compress_layer_types": [] if types == default_layer_types(n) else types, "num_hash_layers": hashed,
        "index_n_heads": hf.count(config, "index_n_heads", 64), "index_head_dim": hf.count(config, "index_head_dim", 128),
        "index_topk": hf.count(config, "index_topk", 512), "hc_mult": hf.count(config, "hc_mult", 4),
        "hc_sinkhorn_iters": hf.count(config, "hc_sinkhorn_iters", 20), "hc_eps": float(config.get("hc_eps", 1e-6)),
        "num_experts": hf.count(config, "n_routed_experts", 256),
        "num_experts_per_tok": hf.count(config, "num_experts_per_tok", 6),
        "base_moe_mlp_dim": hf.count(config, "moe_intermediate_size", 2048),
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.5)),
        "mlp_activations_limit": float(config.get("swiglu_limit", 10.0)),
        **_rope_keys(config, notes),
    }


def to_hf_config(keys: dict) -> dict:
    family = registry.FAMILIES["deepseek_v4"]
    n = keys["base_num_decoder_layers"]
    hashed = min(n, keys["num_hash_layers"])
    return {
        "architectures": [family.hf_architecture], "model_type": family.hf_model_types[0],
        "hidden_size": keys["base_emb_dim"], "num_hidden_layers": n, "num_attention_heads": keys["base_num_query_heads"],
        "num_key_value_heads": 1, "head_dim": keys["head_dim"], "vocab_size": keys["vocab_size"],
        "rms_norm_eps": keys["normalization_layer_epsilon"], "tie_word_embeddings": False,
        "q_lora_rank": keys["q_lora_rank"], "o_groups": keys["o_groups"], "o_lora_rank": keys["o_lora_rank"],
        "sliding_window": keys["sliding_window_size"], "partial_rotary_factor": keys["partial_rotary_factor"],
        "rope_theta": hf.whole(keys["rope_max_timescale"]),
        "compress_rope_theta": hf.whole(keys["compress_rope_theta"]),
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": hf.whole(keys["rope_max_timescale"])},
                            "compress": _compress_rope(keys)},
        "compress_rates": {"compressed_sparse_attention": keys["compress_rate_csa"],
                           "heavily_compressed_attention": keys["compress_rate_hca"]},
        "layer_types": list(keys["compress_layer_types"]) or default_layer_types(n),
        "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (n - hashed),
        "index_n_heads": keys["index_n_heads"], "index_head_dim": keys["index_head_dim"],
        "index_topk": keys["index_topk"], "hc_mult": keys["hc_mult"], "hc_sinkhorn_iters": keys["hc_sinkhorn_iters"],
        "hc_eps": keys["hc_eps"], "n_routed_experts": keys["num_experts"], "n_shared_experts": 1,
        "num_experts_per_tok": keys["num_experts_per_tok"], "moe_intermediate_size": keys["base_moe_mlp_dim"],
        "routed_scaling_factor": keys["routed_scaling_factor"], "swiglu_limit": keys["mlp_activations_limit"],
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False,
        **({"max_position_embeddings": hf.whole(keys["original_max_position_embeddings"] * keys["rope_factor"])}
           if keys.get("rope_type", "default") == "yarn" else {}),
    }


def _compress_rope(keys: dict) -> dict:
    """rope_parameters['compress'] as transformers' DeepseekV4Config writes it (YaRN: attention_factor 1.0)."""
    rope = {"rope_type": "default", "rope_theta": hf.whole(keys["compress_rope_theta"])}
    if keys.get("rope_type", "default") == "yarn":
        rope.update(rope_type="yarn", factor=hf.whole(keys["rope_factor"]), attention_factor=1.0,
                    original_max_position_embeddings=int(keys["original_max_position_embeddings"]),
                    beta_fast=hf.whole(keys["rope_beta_fast"]), beta_slow=hf.whole(keys["rope_beta_slow"]))
    return rope
