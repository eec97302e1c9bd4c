"""Llama 4 with images (Meta 2025; Scout and Maverick as released: Hugging Face's Llama4ForConditionalGeneration):
Llama 4's text decoder (models/llama4/decoder.py: chunked attention, NoPE layers, experts) reading images through
its vision encoder, adapter and projector (models/vision/llama4.py).

    x       = embed(tokens), the rows of the <|patch|> placeholders (image_token_id) replaced, in order, by the
              tower's embeddings: tile after tile of pixel_values [tiles, C, S, S], each tile's (s/k)^2 tokens
              row-major, as transformers' masked_scatter of the flattened features (no scaling)
    layers  llama4_text's, with plain positions (no multimodal RoPE); the tower's parameters under params["vision"]

Text alone is llama4_text exactly. The model keys vision_config (config.json's vision_config as JSON) and
image_token_id carry what the text keys do not. Images enter Model.forward as `images` (`image_inputs`:
pixel_values and tile_mask, 1 for a real tile and 0 for a padding one, so a step compiles once per tile count).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config import registry
from maxtrain.models import contract, hf, image_batch, standard_layers
from maxtrain.models.llama4 import decoder
from maxtrain.models.vision import llama4

FAMILY = registry.FAMILIES["llama4"]
TEXT_FAMILY = registry.FAMILIES["llama4_text"]
PREFIXES = llama4.PREFIXES[FAMILY.hf_architecture]  # vision_model., multi_modal_projector.
TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}  # checkpoint -> text model
IMAGE_KEYS = ("pixel_values", "tile_mask")
IMAGE_TOKEN = 200092  # transformers' Llama4Config default image_token_index (<|patch|>)


@functools.lru_cache(maxsize=16)
def _vision(text: str, text_hidden_size: int) -> llama4.VisionConfig:
    return llama4.VisionConfig.from_hf(json.loads(text), text_hidden_size)


def vision_config(config) -> llama4.VisionConfig:
    """The tower's config from the model key vision_config (config.json's vision_config as JSON)."""
    if not config.vision_config:
        raise ValueError("this llama4 model has no vision tower (vision_config is empty): it reads no images; "
                         "import a Llama4ForConditionalGeneration checkpoint with scripts/convert_hf.py import")
    return _vision(config.vision_config, config.base_emb_dim)


def param_specs(model):
    specs = decoder.param_specs(model)
    if model.config.vision_config:  # without one (a preset, a test): the text decoder alone
        specs["vision"] = llama4.param_specs(vision_config(model.config))
    return specs


def flops_per_token(model, dense_attention: bool = False) -> float:
    """The text decoder's FLOPs per token (the tower's, per image, are Vision.flops': Model.vision_flops)."""
    return decoder.flops_per_token(model, dense_attention)


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


def image_inputs(pixel_values, config, pad_to: int | None = None) -> dict:
    """The `images` Model.forward reads (batch keys IMAGE_KEYS): pixel_values [tiles, C, S, S] as the processor
    makes them (every image's tiles, then its global view, image after image), padded with zero tiles to pad_to."""
    vc = vision_config(config)
    pixels = np.asarray(pixel_values, np.float32)
    shape = (vc.num_channels, vc.image_size, vc.image_size)
    if pixels.ndim != 4 or pixels.shape[1:] != shape:
        raise ValueError(f"pixel_values {pixels.shape} must be tiles [tiles, {', '.join(map(str, shape))}] (the "
                         "processor's layout; data/images_llama4.py makes them)")
    tiles = pixels.shape[0]
    pad_to = tiles if pad_to is None else pad_to
    if pad_to < tiles:
        raise ValueError(f"pad_to={pad_to} tiles is fewer than the images' {tiles}; raise it")
    mask = (np.arange(pad_to) < tiles).astype(np.int32)
    return {"pixel_values": np.concatenate([pixels, np.zeros((pad_to - tiles,) + shape, np.float32)]),
            "tile_mask": mask}


def check_placeholders(tokens, tile_mask, config) -> None:
    """Refuses a batch whose placeholders are not as many as its real tiles' tokens (host arrays)."""
    per_tile = vision_config(config).tokens_per_tile
    placeholders = int(np.sum(np.asarray(tokens) == config.image_token_id))
    tiles = int(np.sum(np.asarray(tile_mask) > 0))
    if placeholders != tiles * per_tile:
        raise ValueError(f"the batch has {placeholders} image placeholders (token {config.image_token_id}) but its "
                         f"{tiles} tiles have {tiles * per_tile} tokens ({per_tile} each); put {per_tile} <|patch|> "
                         "tokens per tile, as the processor does")


def model_inputs(config, input_ids, pixel_values, pad_to: int | None = None) -> tuple:
    """(positions [B, T], images) of Model.forward for input_ids [B, T] whose placeholders the tiles fill (host)."""
    if config.image_token_id < 0:
        raise ValueError("image_token_id is -1: this llama4 model names no image placeholder token; set "
                         "image_token_id (config.json's image_token_index)")
    images = image_inputs(pixel_values, config, pad_to)
    check_placeholders(input_ids, images["tile_mask"], config)
    ids = np.asarray(input_ids)
    return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape), images


def embed_images(params, x, tokens, images: dict, model, rt):
    """(x with the placeholders' rows replaced by the tiles' embeddings, in order; no per-layer inputs)."""
    config = model.config
    images, by_row = image_batch.by_row(images, IMAGE_KEYS, tokens.shape[0])
    missing = [k for k in IMAGE_KEYS if k not in images]
    if missing:
        raise ValueError(f"images lack {missing}; make them with models.families.llama4.image_inputs(pixel_values, config)")
    try:  # concrete arrays are checked here; traced ones were by model_inputs, on the host
        check_placeholders(np.asarray(tokens), np.asarray(images["tile_mask"]), config)
    except jax.errors.TracerArrayConversionError:
        pass
    rows = llama4.forward(params["vision"], jnp.asarray(images["pixel_values"]), vision_config(config), rt.dtype,
                          remat=rt.remat_policy != "none")
    mask = tokens == config.image_token_id                                   # [B, T]
    index = image_batch.placeholder_index(mask, by_row, rows.shape[0])      # flat or by row (models/image_batch.py)
    return jnp.where(mask[..., None], rows[index].astype(x.dtype), x), None


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """The whole Llama4Config: text_config (llama4_text's fields), vision_config, image_token_index."""
    if not isinstance(config.get("text_config"), dict) or not isinstance(config.get("vision_config"), dict):
        raise hf.ConversionError("config.json of a llama4 model needs text_config and vision_config (import a "
                                 "Llama4ForCausalLM directory, model_type llama4_text, as llama4_text)")
    text = {**config["text_config"], "tie_word_embeddings": config.get(
        "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}
    keys = decoder.from_hf_config(text, notes)
    vision = llama4.VisionConfig.from_hf(config["vision_config"], keys["base_emb_dim"])
    image = config.get("image_token_index", config.get("image_token_id", IMAGE_TOKEN))
    return {**keys, "image_token_id": int(image), "vision_config": json.dumps(vision.to_hf(), sort_keys=True)}


def to_hf_config(keys: dict) -> dict:
    text = decoder.to_hf_config(keys, TEXT_FAMILY)
    text = {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")}
    return {"architectures": [FAMILY.hf_architecture], "model_type": FAMILY.hf_model_types[0],
            "image_token_index": keys["image_token_id"], "tie_word_embeddings": keys["logits_via_embedding"],
            "text_config": text, "vision_config": {**_keys_vision(keys).to_hf(), "model_type": "llama4_vision_model"}}


def _keys_vision(keys: dict) -> llama4.VisionConfig:
    if not keys.get("vision_config"):
        raise hf.ConversionError("this llama4 model has no vision tower (its vision_config is empty); Hugging Face "
                                 "conversion needs one: import a Llama4ForConditionalGeneration checkpoint")
    return _vision(keys["vision_config"], keys["base_emb_dim"])


def vision_to_maxtrain(tensors: dict, keys: dict, dtype=np.float32) -> dict:
    return llama4.to_maxtrain(tensors, _keys_vision(keys), PREFIXES, dtype)


def vision_flops(config, patches: int) -> dict:
    """The tower's forward matmul FLOPs by part for one image of `patches` patches (contract.Vision.flops)."""
    return llama4.flops(vision_config(config), patches)


def vision_to_hf(params: dict, keys: dict, dtype=np.float32) -> dict:
    return llama4.to_hf(params, _keys_vision(keys), PREFIXES, dtype)


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=decoder.layer_types, embed=standard_layers.embed,
    layer=decoder.layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=decoder.HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config,
    vision=contract.Vision(text_family=TEXT_FAMILY.name, embed=embed_images, input_keys=IMAGE_KEYS, prefix=PREFIXES,
                           text_prefixes=TEXT_PREFIXES, to_maxtrain=vision_to_maxtrain, to_hf=vision_to_hf,
                           inputs=model_inputs, flops=vision_flops, projector=("projector",)))
