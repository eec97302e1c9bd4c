"""Latent attention's config rules (DeepSeek-V3's MLA, models/families/deepseek/mla.py) and its lightning indexer's
(DeepSeek-V3.2, GLM-5: indexer.py; indexer_training). Each is a function of the resolved values that raises
ConfigError naming the fix; checks.CHECKS runs CHECKS."""

from __future__ import annotations

from maxtrain.config import features
from maxtrain.errors import ConfigError


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def mla_head_dims(v):
    """MLA's head widths and heads (decoder_block=deepseek)."""
    if features.family(v).mixer != "mla":
        return
    _require(v["qk_rope_head_dim"] % 2 == 0,
             f"qk_rope_head_dim={v['qk_rope_head_dim']} must be even (RoPE rotates pairs of features)")
    qk = v["qk_nope_head_dim"] + v["qk_rope_head_dim"]
    _require(v["head_dim"] == qk, f"head_dim={v['head_dim']} must be the query/key head width qk_nope_head_dim + "
                                  f"qk_rope_head_dim = {qk} for MLA (decoder_block={v['decoder_block']}); set head_dim={qk}")
    _require(v["base_num_kv_heads"] == v["base_num_query_heads"],
             f"base_num_kv_heads={v['base_num_kv_heads']} must equal base_num_query_heads={v['base_num_query_heads']} "
             f"for decoder_block={v['decoder_block']}: MLA expands every head's keys and values from the latent; set "
             f"base_num_kv_heads={v['base_num_query_heads']}")


def indexer_settings(v):
    """DeepSeek-V3.2's indexer (models/families/deepseek/indexer.py) and its training (indexer_training)."""
    if features.family(v).mixer != "mla":
        return
    if v.get("index_n_heads", 0) > 0:
        _require(v["q_lora_rank"] > 0, "index_n_heads > 0 (DeepSeek-V3.2's indexer) reads MLA's query latent: set "
                                       "q_lora_rank > 0, or index_n_heads=0")
        _require(v["index_head_dim"] >= v["qk_rope_head_dim"],
                 f"index_head_dim={v['index_head_dim']} must hold the qk_rope_head_dim={v['qk_rope_head_dim']} "
                 "features the indexer rotates; set index_head_dim >= qk_rope_head_dim")
        _require(v["mtp_num_layers"] == 0, f"mtp_num_layers={v['mtp_num_layers']} with DeepSeek-V3.2's indexer "
                                           "(index_n_heads > 0) is not built yet; set mtp_num_layers=0")
        warmup = v["indexer_training"] == "dense_warmup"  # only the indexer trains, and AdamW trains its weights
        _require(not warmup or v["opt_type"] == "adamw", f"indexer_training=dense_warmup trains the indexer alone, "
                 f"whose weights AdamW trains; opt_type={v['opt_type']} would do nothing: set opt_type=adamw")
        _require(not warmup or v["qk_clip_threshold"] == 0, f"indexer_training=dense_warmup freezes the query and key "
                 f"weights that qk_clip_threshold={v['qk_clip_threshold']} would scale; set qk_clip_threshold=0")
        _require(v["indexer_training"] == "none" or v["lora_rank"] == 0,
                 f"indexer_training={v['indexer_training']} trains the indexer's weights, which lora_rank="
                 f"{v['lora_rank']} freezes; set lora_rank=0 or indexer_training=none")


def indexer_types(v):
    """GLM-5's per-layer indexer: "full" layers choose their keys, "shared" ones reuse the previous full layer's."""
    types = v.get("indexer_types") or []
    if not types or features.family(v).mixer != "mla" or v.get("index_n_heads", 0) == 0:
        return  # without an indexer, features.py names indexer_types as doing nothing
    n = v["base_num_decoder_layers"]
    _require(len(types) == n and all(t in ("full", "shared") for t in types),
             f"indexer_types must list \"full\" or \"shared\" for each of the {n} layers (or be [] for every "
             f"layer full), got {types}")
    _require(types[0] == "full", f"indexer_types starts with {types[0]!r}: a shared layer reuses the previous full "
                                 "layer's chosen keys, and the first layer has none; make the first layer \"full\"")


CHECKS = (mla_head_dims, indexer_settings, indexer_types)
