"""The config keys that describe a model, which a checkpoint is checked against.

SHAPE_KEYS fix the parameters' shapes (a checkpoint that differs does not fit); SETTING_KEYS change what the
same parameters compute (a checkpoint written with other values would load and silently compute something
else, so loading one is refused). The keys every family shares are listed here; each family adds its own in
its registry row (registry.Family.shape_keys, .setting_keys), and a family's `settings` are all model keys
(test_house). Plain data from the registry: no JAX.
"""

from __future__ import annotations

from maxtrain.config import registry

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
