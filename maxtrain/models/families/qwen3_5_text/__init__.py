"""Qwen3.5 dense models (Qwen Team 2026), their text decoder: Qwen3-Next's hybrid stack (models/recurrent/hybrid.py:
three gated delta-net layers, then one gated full-attention layer with partial RoPE) with a gated MLP in every
layer. The released checkpoints are multimodal: the import reads the language model's weights and says it left
the vision tower out (checkpointing/convert.py); RoPE's multimodal sections reduce to plain RoPE for text.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import contract
from maxtrain.models.recurrent import hybrid

FAMILY = registry.FAMILIES["qwen3_5_text"]


HF_NAMES = hybrid.hf_names(hybrid.QWEN3_5_LINEAR, experts=None)


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    return hybrid.hf_keys(config, notes)


def to_hf_config(keys: dict) -> dict:
    return hybrid.hf_config(keys, FAMILY)


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=hybrid.param_specs, layer_types=hybrid.layer_types, embed=hybrid.embed, layer=hybrid.layer,
    logits=hybrid.logits, flops_per_token=hybrid.flops_per_token, hf_names=HF_NAMES, from_hf_config=from_hf_config,
    to_hf_config=to_hf_config, layer_cache=hybrid.layer_cache)
