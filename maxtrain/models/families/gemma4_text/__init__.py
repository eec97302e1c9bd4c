"""Gemma 4 text models (transformers' Gemma4ForCausalLM, model_type gemma4_text; a Gemma4ForConditionalGeneration
checkpoint imported with --text-only): Gemma 4's text decoder (models/gemma4/decoder.py, shared with the gemma4
family, which adds the vision tower)."""

from __future__ import annotations

from maxtrain.models import contract, standard_layers
from maxtrain.models.gemma4 import decoder

FAMILY = decoder.FAMILY

MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=decoder.param_specs, layer_types=decoder.layer_types, embed=standard_layers.scaled_embed,
    layer=decoder.layer, logits=standard_layers.logits, flops_per_token=decoder.flops_per_token,
    hf_names=decoder.HF_NAMES, from_hf_config=decoder.from_hf_config, to_hf_config=decoder.to_hf_config,
    cache_heads=decoder.cache_heads, per_layer_inputs=decoder.per_layer_inputs, layer_state=decoder.layer_state)
