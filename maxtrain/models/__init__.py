"""Model families over shared blocks. `decoder_block` (MaxText's key; presets set it) picks the family.

    params.py     ParamSpec: every parameter declared once (shape, logical axes, initializer)
    rope.py       RoPE and its scaling variants (default, linear, llama3, yarn)
    blocks.py     norms, embedding, attention, gated MLPs, logits; FLOPs helpers
    decoder.py    the stack every family shares: layer types, scan over repeating groups, loss, decoding
    hf.py         what the families share about Hugging Face names and config.json fields
    runtime.py    dtype, attention implementation and remat policy resolved for a platform
    <family>.py   llama, mistral, qwen2, qwen3, gemma2, gemma3: declarations, layer composition,
                  Hugging Face mapping and FLOPs per token, nothing else

Adding a family is one module with the same names as llama.py, listed in FAMILIES below, presets in
configs/models/ and a parity test against transformers (tests/test_families.py); train.py does not change.
"""

from __future__ import annotations

from maxtrain.models import decoder, gemma2, gemma3, llama, mistral, qwen2, qwen3
from maxtrain.models.params import ParamSpec, Params, count, is_spec
from maxtrain.models.runtime import PROJECTION_NAMES, REMAT_POLICIES, Runtime

FAMILIES = {m.DECODER_BLOCK: m for m in (llama, mistral, qwen2, qwen3, gemma2, gemma3)}

# The config keys that describe a model. SHAPE_KEYS fix the parameters' shapes (a checkpoint that
# differs does not fit); SETTING_KEYS change what the same parameters compute (a checkpoint written
# with other values would load and silently compute something else, so loading one is refused).
SHAPE_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers",
              "head_dim", "vocab_size", "logits_via_embedding")
SETTING_KEYS = ("decoder_block", "normalization_layer_epsilon", "rope_max_timescale", "rope_type", "rope_factor",
                "rope_low_freq_factor", "rope_high_freq_factor", "original_max_position_embeddings",
                "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_truncate",
                "local_rope_max_timescale", "sliding_window_size", "attention_layer_types", "attn_logits_soft_cap",
                "final_logits_soft_cap", "query_pre_attn_scalar")
MODEL_KEYS = SHAPE_KEYS + SETTING_KEYS

__all__ = ["FAMILIES", "MODEL_KEYS", "SHAPE_KEYS", "SETTING_KEYS", "ParamSpec", "Params", "Runtime", "REMAT_POLICIES",
           "PROJECTION_NAMES", "family", "param_specs", "num_params", "init_params", "forward", "loss_fn",
           "objective", "init_cache", "forward_with_cache", "flops_per_token", "is_spec"]


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


def init_params(config, key) -> Params:
    from maxtrain.models import params as params_lib  # pylint: disable=import-outside-toplevel

    return params_lib.init_params(param_specs(config), key, config.weight_dtype)


def forward(params: Params, tokens, positions, segment_ids, config, rt: Runtime):
    """(logits [B, T, V] float32, aux dict of scalars) for tokens [B, T]."""
    return decoder.forward(family(config), params, tokens, positions, segment_ids, config, rt)


def loss_fn(params: Params, batch: dict, config, rt: Runtime):
    """(cross-entropy sum, weight sum, aux) for a batch of inputs/targets/positions/segment_ids/loss_weights."""
    return decoder.loss_fn(family(config), params, batch, config, rt)


def objective(loss_sum, weight_sum, aux: dict):
    """What training minimizes: the cross-entropy sum plus each aux loss (`*_loss`, a mean over tokens
    already multiplied by its weight) times the weight sum."""
    for name, value in aux.items():
        if name.endswith("_loss"):
            loss_sum = loss_sum + value * weight_sum
    return loss_sum


def init_cache(config, batch_size: int, max_length: int, dtype) -> dict:
    return decoder.init_cache(config, batch_size, max_length, dtype)


def forward_with_cache(params: Params, tokens, positions, cache: dict, index, config, rt: Runtime):
    return decoder.forward_with_cache(family(config), params, tokens, positions, cache, index, config, rt)


def flops_per_token(config, dense_attention: bool = False) -> float:
    """Training FLOPs per token from the family's formula (causal attention counted once, sliding
    windows counting only the keys attended; dense_attention=True counts every key, as a dense
    implementation computes them)."""
    return family(config).flops_per_token(config, dense_attention)
