"""Llama 4 text (Meta 2025; Scout and Maverick): Llama 4's language model alone, Hugging Face's Llama4ForCausalLM
(model_type llama4_text; a Llama4ForConditionalGeneration checkpoint imported with `--text-only`). Its decoder,
shared with the llama4 family (the same decoder reading images), is models/llama4/decoder.py.
"""

from __future__ import annotations

import functools

from maxtrain.config import registry
from maxtrain.models import contract, standard_layers
from maxtrain.models.llama4 import decoder

FAMILY = registry.FAMILIES["llama4_text"]  # its Hugging Face model_type and architecture

MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=decoder.param_specs, layer_types=decoder.layer_types, embed=standard_layers.embed,
    layer=decoder.layer, logits=standard_layers.logits, flops_per_token=decoder.flops_per_token,
    hf_names=decoder.HF_NAMES, from_hf_config=decoder.from_hf_config,
    to_hf_config=functools.partial(decoder.to_hf_config, row=FAMILY))
