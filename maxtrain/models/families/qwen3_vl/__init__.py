"""Qwen3-VL dense models (Qwen Team 2025): Qwen 3's decoder reading images through its ViT (models/vision/qwen.py).

    x         = embed(tokens), the rows of the <|image_pad|> placeholders replaced, in order, by the tower's merged
                embeddings (one per m x m window of patches), as transformers' masked_scatter
    M-RoPE    three position streams (t, h, w) [3, B, T] (`rope_index`: text counts on; an image's tokens sit at
                (t0, t0 + row, t0 + column) and the text after it resumes at t0 + max(h, w) / m); frequency pair i
                turns by stream h when i % 3 == 1 and i < 3 mrope_section[1], by w when i % 3 == 2 and
                i < 3 mrope_section[2], else by t (transformers' interleaved layout). Positions [B, T] (text alone)
                are the three streams equal: plain RoPE
    deepstack after decoder layer i < len(deepstack_visual_indexes), the tower's i-th deepstack feature is added
                to the hidden states at the placeholders (a per-layer input, zero elsewhere)
    layers    Qwen 3's (qk-norm, SwiGLU); the tower's parameters under params["vision"]

The deepstack features travel as per-layer inputs [L, B, T, D] (zero after the first len(deepstack_visual_indexes)
layers): simple, at the cost of L copies of the activations' size. Decoding reads a prompt's images in its prefill
(models/sampling.generate, maxtrain.decode prompt_image); M-RoPE goes on past the prompt's largest position.

M-RoPE, the image inputs and the placeholder fill are models/vision/qwen_images.py's (Qwen3.5's families share them).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked
from maxtrain.models.vision import qwen, qwen_images

FAMILY = registry.FAMILIES["qwen3_vl"]
PREFIX = qwen.PREFIXES[FAMILY.hf_architecture]  # model.visual.


def param_specs(model):
    config = model.config
    layer_specs = standard_layers.decoder_specs(config, qk_norm="ones")
    return qwen_images.with_tower({**blocks.embedding_specs(config), "layers": {
        "decoder": stacked(layer_specs, config.base_num_decoder_layers)}}, config)


def layer_types(config) -> list[LayerType]:
    return attention_types(config, ["full"] * config.base_num_decoder_layers)


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    """Qwen 3's layer, then (the first layers, with images) the deepstack feature at the placeholders."""
    x, aux = standard_layers.prenorm_layer(x, p, inputs, layer_type, model, rt)
    if inputs.per_layer is not None:
        x = x + inputs.per_layer.astype(x.dtype)
    return x, aux


def flops_per_token(model, dense_attention: bool = False) -> float:
    """The text decoder's FLOPs per token (the tower's, per image, are Vision.flops': Model.vision_flops)."""
    return blocks.decoder_flops(model.config, model.layer_types, dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


HF_NAMES = {**hf.DECODER_NAMES, **hf.QK_NORM_NAMES}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """The whole Qwen3VLConfig: text_config (Qwen 3's fields, M-RoPE's mrope_section), vision_config, image_token_id."""
    text = qwen_images.text_config(config, FAMILY.name)
    hf.refuse(text, {"hidden_act": "silu", "attention_bias": False})
    rope = hf.rope_dict(text, notes)
    section = list(rope.get("mrope_section") or [24, 20, 20])  # transformers' default
    if len(section) != 3 or sum(section) * 2 > hf.count(text, "head_dim", text["hidden_size"] // text[
            "num_attention_heads"]):
        raise hf.ConversionError(f"mrope_section={section} must be three counts of frequency pairs within head_dim / 2")
    return {**hf.common_keys(text), **hf.rope_keys(text, notes), **hf.qwen_window_keys(text),
            **qwen_images.image_keys(config, rope, section, "qwen3_vl", 151655)}


def to_hf_config(keys: dict) -> dict:
    text = {**hf.common_config(keys, FAMILY), "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": hf.rope_parameters(keys)}
    vision = {**qwen_images.vision_dict(qwen_images.keys_vision(keys)), "model_type": "qwen3_vl"}
    return qwen_images.hf_config(text, keys, FAMILY, "qwen3_vl_text", vision)


_TO_MAXTRAIN, _TO_HF = qwen_images.vision_converters(PREFIX)

MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed,
    layer=layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config, rope_tables=qwen_images.rope_tables,
    vision=contract.Vision(text_family="qwen3", embed=qwen_images.embed_images, input_keys=qwen_images.IMAGE_KEYS,
                           prefix=PREFIX, text_prefixes=qwen_images.TEXT_PREFIXES, to_maxtrain=_TO_MAXTRAIN,
                           to_hf=_TO_HF, inputs=qwen_images.model_inputs, flops=qwen_images.flops,
                           projector=("merger", "deepstack")))
