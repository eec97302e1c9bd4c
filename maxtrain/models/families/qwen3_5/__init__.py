"""Qwen3.5 dense image-text models (Qwen Team 2026; transformers' Qwen3_5ForConditionalGeneration): Qwen3.5's
hybrid text decoder (models/recurrent/hybrid.py, as qwen3_5_text) reading images through Qwen3-VL's tower without
deepstack (models/vision/qwen.py), its parameters under params["vision"].

    x        = embed(tokens), the <|image_pad|> placeholders' rows replaced, in order, by the tower's merged embeddings
    M-RoPE   the full-attention layers' partial RoPE turns its frequency pairs by the t, h or w position stream
             (mrope_section, interleaved; models/vision/qwen_images.py); the gated delta-net layers take no positions

`scripts/convert_hf.py import --text-only` reads the text decoder alone, as qwen3_5_text.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import contract, hf
from maxtrain.models.recurrent import hybrid
from maxtrain.models.vision import qwen, qwen_images

FAMILY = registry.FAMILIES["qwen3_5"]
PREFIX = qwen.PREFIXES[FAMILY.hf_architecture]  # model.visual.
MROPE_SECTION = [11, 11, 10]  # transformers' default where rope_parameters name none
IMAGE_TOKEN_ID = 248056       # Qwen3_5Config's default

HF_NAMES = hybrid.hf_names(hybrid.QWEN3_5_LINEAR, experts=None)


def param_specs(model):
    return qwen_images.with_tower(hybrid.param_specs(model), model.config)


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """The whole Qwen3_5Config: text_config (Qwen3.5's text fields, mrope_section), vision_config, image_token_id."""
    text = qwen_images.text_config(config, FAMILY.name)
    return {**hybrid.hf_keys(text, notes),
            **qwen_images.image_keys(config, hf.rope_dict(text), MROPE_SECTION, "qwen3_5_vision", IMAGE_TOKEN_ID)}


def to_hf_config(keys: dict) -> dict:
    vision = {**qwen_images.keys_vision(keys).to_hf(), "model_type": "qwen3_5_vision"}
    return qwen_images.hf_config(hybrid.hf_config(keys, FAMILY), keys, FAMILY, "qwen3_5_text", vision)


_TO_MAXTRAIN, _TO_HF = qwen_images.vision_converters(PREFIX)

MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=hybrid.layer_types, embed=hybrid.embed, layer=hybrid.layer,
    logits=hybrid.logits, flops_per_token=hybrid.flops_per_token, hf_names=HF_NAMES, from_hf_config=from_hf_config,
    to_hf_config=to_hf_config, layer_cache=hybrid.layer_cache, rope_tables=qwen_images.rope_tables,
    vision=contract.Vision(text_family="qwen3_5_text", embed=qwen_images.embed_images,
                           input_keys=qwen_images.IMAGE_KEYS, prefix=PREFIX, text_prefixes=qwen_images.TEXT_PREFIXES,
                           to_maxtrain=_TO_MAXTRAIN, to_hf=_TO_HF, inputs=qwen_images.model_inputs,
                           flops=qwen_images.flops, projector=("merger",)))
