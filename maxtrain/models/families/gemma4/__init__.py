"""Gemma 4 with images (transformers' Gemma4ForConditionalGeneration, model_type gemma4): Gemma 4's text decoder
(models/gemma4/decoder.py: everything gemma4_text computes) reading images through the vision encoder and
projector (models/vision/gemma4.py), as transformers' Gemma4Model.forward does:

    ids'      = ids with every multimodal placeholder (image, video, audio token) replaced by the pad token
    x         = embed(ids') * sqrt(D), then the rows of the image placeholders replaced, in order, by the images'
                soft tokens (the projector's output, neither scaled nor normed again: masked_scatter)
    per-layer inputs (per_layer_input_dim > 0): the table at ids' and the projection of that merged x
    attention causal, except with bidirectional_image_attention (text_config.use_bidirectional_attention
                "vision", as transformers' create_masks_for_vision_model with the processor's mm_token_type_ids):
                in the sliding layers query t sees key s of its document when (s <= t or both lie in one run
                of image (or video) placeholders: `blocks`; boi and eoi are text) and t - s < W; the
                full-attention layers stay causal. "all" (every token both ways) is refused at import

The model keys vision_config (as JSON: config.json's vision_config, and the multimodal token ids beside it) and
image_token_id carry what the text keys do not. Images enter Model.forward as `images` {pixel_values [N, M, p*p*3],
image_position_ids [N, M, 2]}: the processor's arrays (data/images.py gemma4) under transformers' names, padded to a
fixed image count with all-padding images so that a step compiles once. The audio tower is left out at import (a
note says so). Decoding from an image prompt (maxtrain.decode prompt_image, data/image_prompts.py) runs the tower in the
prefill under the full forward's mask, the cache going on causally after it; the tower's FLOPs are not counted.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config import registry
from maxtrain.models import contract, hf, image_batch, standard_layers
from maxtrain.models.attention import image_band
from maxtrain.models.gemma4 import decoder
from maxtrain.models.vision import gemma4 as gemma4_vision

FAMILY = registry.FAMILIES["gemma4"]
PREFIX = gemma4_vision.PREFIXES[FAMILY.hf_architecture]  # model.
AUDIO = (PREFIX + "audio_tower.", PREFIX + "embed_audio.")
TEXT_PREFIXES = {"model.language_model.": "model.", "lm_head.": "lm_head."}  # checkpoint -> the text model's names
IMAGE_KEYS = ("pixel_values", "image_position_ids")  # transformers' forward-argument names
# Gemma4Config's token ids (transformers' defaults), kept beside the tower's config for the export.
TOKEN_IDS = {"boi_token_id": 255_999, "eoi_token_id": 258_882, "video_token_id": 258_884, "boa_token_id": 256_000,
             "eoa_token_index": 258_883, "audio_token_id": 258_881}


@functools.lru_cache(maxsize=16)
def _stored(text: str) -> dict:
    return json.loads(text)


def vision_config(config) -> gemma4_vision.VisionConfig:
    """The tower's config from the model keys (vision_config's JSON; the projector's width is base_emb_dim)."""
    if not config.vision_config:
        raise ValueError("this gemma4 model has no vision tower (vision_config is empty): it reads no images; import "
                         "a Gemma4ForConditionalGeneration checkpoint with scripts/convert_hf.py import")
    return _tower(config.vision_config, config.base_emb_dim)


@functools.lru_cache(maxsize=16)
def _tower(text: str, width: int) -> gemma4_vision.VisionConfig:
    return gemma4_vision.VisionConfig.from_hf({"vision_config": _stored(text)["vision_config"],
                                       "text_config": {"hidden_size": width}})


def _placeholder_ids(config) -> tuple[list[int], int]:
    """(the multimodal placeholder ids, the pad id that replaces them in the embedding lookups)."""
    if not config.vision_config:
        return [], 0
    stored = _stored(config.vision_config)
    ids = stored["token_ids"]
    return [config.image_token_id, ids["video_token_id"], ids["audio_token_id"]], stored["pad_token_id"]


def text_ids(tokens, config):
    """The ids the embeddings look up: every multimodal placeholder as the pad token (transformers' llm_input_ids)."""
    placeholders, pad = _placeholder_ids(config)
    out = tokens
    for i in placeholders:
        out = jnp.where(tokens == i, pad, out)
    return out


def blocks(tokens, segment_ids, config):
    """LayerInputs.blocks [B, T] with bidirectional_image_attention (else None): each run of image or video placeholders
    of one document numbered from 0 (transformers' get_block_sequence_ids_for_mask), -1 elsewhere."""
    if not config.bidirectional_image_attention:
        return None
    placeholders, _ = _placeholder_ids(config)
    vision = (tokens == placeholders[0]) | (tokens == placeholders[1]) if placeholders else jnp.zeros_like(tokens, bool)
    before = jnp.pad(vision[:, :-1] & (segment_ids[:, :-1] == segment_ids[:, 1:]), ((0, 0), (1, 0)))
    starts = vision & ~before
    return jnp.where(vision, jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1, -1)


def param_specs(model):
    specs = decoder.param_specs(model)
    if model.config.vision_config:  # without one (a preset, a test): the text decoder alone
        specs["vision"] = gemma4_vision.param_specs(vision_config(model.config))
    return specs


def embed(params, tokens, config, rt):
    return standard_layers.scaled_embed(params, text_ids(tokens, config), config, rt)


def per_layer_inputs(params, tokens, x, config, rt):
    return decoder.per_layer_inputs(params, text_ids(tokens, config), x, config, rt)


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


def image_inputs(pixel_values, image_position_ids, config, pad_to: int | None = None) -> dict:
    """The `images` Model.forward reads: pixel_values [N, M, p*p*3] and image_position_ids [N, M, 2] as the
    processor makes them, padded to pad_to images with all-padding ones (no soft tokens)."""
    vc = vision_config(config)
    pixels = np.asarray(pixel_values, np.float32)
    positions = np.asarray(image_position_ids)
    if pixels.ndim != 3 or pixels.shape[2] != vc.patch_dim or positions.shape != pixels.shape[:2] + (2,):
        raise ValueError(f"pixel_values {pixels.shape} and image_position_ids {positions.shape} must be "
                         f"[images, patches, {vc.patch_dim}] and [images, patches, 2] (the processor's arrays)")
    n = pixels.shape[0] if pad_to is None else pad_to
    if n < pixels.shape[0]:
        raise ValueError(f"{pixels.shape[0]} images do not fit pad_to={pad_to}; raise it")
    more = n - pixels.shape[0]
    return {"pixel_values": np.concatenate([pixels, np.zeros((more,) + pixels.shape[1:], np.float32)]),
            "image_position_ids": np.concatenate([positions.astype(np.int32),
                                                  np.full((more,) + positions.shape[1:], -1, np.int32)])}


def check_placeholders(tokens, images: dict, config) -> None:
    """Refuses a batch whose image placeholders are not as many as the images' soft tokens (host arrays)."""
    placeholders = int(np.sum(np.asarray(tokens) == config.image_token_id))
    soft = int(gemma4_vision.soft_tokens(images["image_position_ids"], vision_config(config)).sum())
    if placeholders != soft:
        raise ValueError(f"the batch has {placeholders} image placeholders (token {config.image_token_id}) but its "
                         f"images have {soft} soft tokens; expand each image to its soft tokens' count of image "
                         "tokens, as the processor does")


def check_image_runs(tokens, config) -> None:
    """With bidirectional_image_attention: refuses (host arrays) a run of image or video placeholders longer than
    image_attention_span, which the sliding layers' banded attention (models/attention/image_band.py) would cut."""
    placeholders, _ = _placeholder_ids(config)
    if not config.bidirectional_image_attention or not placeholders:
        return
    ids = np.asarray(tokens)
    longest = image_band.longest_run((ids == placeholders[0]) | (ids == placeholders[1]))
    if longest > config.image_attention_span:
        raise ValueError(f"a run of {longest} image placeholders is longer than image_attention_span="
                         f"{config.image_attention_span}, the image tokens the sliding layers' banded attention lets a "
                         f"token see ahead; set image_attention_span={longest} or more")


def model_inputs(config, input_ids, pixel_values, image_position_ids, pad_to: int | None = None) -> tuple:
    """(positions [B, T], images) of Model.forward for input_ids [B, T] whose placeholders the images fill (host)."""
    images = image_inputs(pixel_values, image_position_ids, config, pad_to)
    check_placeholders(input_ids, images, config)
    check_image_runs(input_ids, config)
    ids = np.asarray(input_ids)
    return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape), images


def embed_images(params, x, tokens, images: dict, model, rt):
    """(x with the image placeholders' rows replaced, in order, by the images' soft tokens, None): image i's first
    real_patches_i / k^2 soft tokens, image after image, as transformers' masked_scatter (over the batch, or within
    each row's slot for images by row: models/image_batch.py)."""
    config = model.config
    images, rows = image_batch.by_row(images, IMAGE_KEYS, tokens.shape[0])
    missing = [k for k in IMAGE_KEYS if k not in images]
    if missing:
        raise ValueError(f"images lack {missing}; make them with gemma4.image_inputs(pixel_values, "
                         "image_position_ids, config)")
    try:  # concrete arrays are checked here; traced ones were by model_inputs, on the host
        check_placeholders(np.asarray(tokens), {"image_position_ids": np.asarray(images["image_position_ids"])},
                           config)
        check_image_runs(np.asarray(tokens), config)
    except jax.errors.TracerArrayConversionError:
        pass
    vc = vision_config(config)
    positions = jnp.asarray(images["image_position_ids"])
    pixels = jnp.asarray(images["pixel_values"])
    embedded, _ = gemma4_vision.forward(params["vision"], pixels, positions, vc, rt.dtype,
                                        remat=rt.remat_policy != "none")
    real = jnp.sum(jnp.all(positions != -1, axis=-1), axis=-1) // vc.pooling_kernel_size ** 2    # [N]
    valid = jnp.arange(embedded.shape[1])[None, :] < real[:, None]                               # [N, L]
    features = embedded.reshape(-1, embedded.shape[-1])
    slots = valid.reshape(rows or 1, -1)                         # the whole batch flat, or each row's slot
    source = jnp.argsort(~slots, axis=1, stable=True)            # each slot's valid features first, in order
    source = (source + jnp.arange(slots.shape[0])[:, None] * slots.shape[1]).reshape(-1)
    mask = tokens == config.image_token_id                                                       # [B, T]
    order = image_batch.placeholder_index(mask, rows, features.shape[0])
    return jnp.where(mask[..., None], features[source[order]].astype(x.dtype), x), None


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """The whole Gemma4Config: text_config (gemma4_text's reading), vision_config, the token ids."""
    if not isinstance(config.get("text_config"), dict) or not isinstance(config.get("vision_config"), dict):
        raise hf.ConversionError("config.json of a gemma4 model with images needs text_config and vision_config; "
                                 "import a text-only one with --text-only")
    text = {**config["text_config"], "tie_word_embeddings": config.get(
        "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", True))}
    keys = decoder.from_hf_config(text, notes)  # refuses use_bidirectional_attention "all"
    gemma4_vision.VisionConfig.from_hf({"vision_config": config["vision_config"], "text_config": text})  # refusals now
    if config.get("audio_config") and notes is not None:
        notes.append("left out the audio tower (audio_config): maxtrain's gemma4 reads text and images")
    stored = {"vision_config": {k: v for k, v in config["vision_config"].items()
                                if k in gemma4_vision.VisionConfig.__dataclass_fields__ or k == "rope_parameters"},
              "token_ids": {k: config.get(k, v) for k, v in TOKEN_IDS.items()},
              "pad_token_id": int(text.get("pad_token_id") if text.get("pad_token_id") is not None else 0)}
    return {**keys, "image_token_id": int(config.get("image_token_id", 258_880)),
            "bidirectional_image_attention": text.get("use_bidirectional_attention") == "vision",
            "vision_config": json.dumps(stored, sort_keys=True)}


def to_hf_config(keys: dict) -> dict:
    if not keys.get("vision_config"):
        raise hf.ConversionError("this gemma4 model has no vision tower (its vision_config is empty); Hugging Face "
                                 "conversion needs one: import a Gemma4ForConditionalGeneration checkpoint")
    stored = _stored(keys["vision_config"])
    text = {k: v for k, v in decoder.to_hf_config(keys).items() if k not in ("architectures", "tie_word_embeddings")}
    vision = _tower(keys["vision_config"], keys["base_emb_dim"]).to_hf()
    return {"architectures": [FAMILY.hf_architecture], "model_type": FAMILY.hf_model_types[0],
            "image_token_id": keys["image_token_id"], **stored["token_ids"],
            "tie_word_embeddings": keys["logits_via_embedding"],
            "text_config": {**text, "model_type": "gemma4_text", "pad_token_id": stored["pad_token_id"],
                            "use_bidirectional_attention": "vision" if keys["bidirectional_image_attention"] else None},
            "vision_config": {**vision, "model_type": "gemma4_vision"}, "audio_config": None}


def vision_to_maxtrain(tensors: dict, keys: dict, dtype=np.float32) -> dict:
    """params["vision"] from the tower's and projector's tensors (the audio tower's, if any, are left out)."""
    ours = {n: w for n, w in tensors.items() if not n.startswith(AUDIO)}
    return gemma4_vision.to_maxtrain(ours, _tower(keys["vision_config"], keys["base_emb_dim"]), PREFIX, dtype)


def vision_flops(config, patches: int) -> dict:
    """The tower's forward matmul FLOPs by part for one image of `patches` patches (contract.Vision.flops)."""
    return gemma4_vision.flops(vision_config(config), patches)


def vision_to_hf(params: dict, keys: dict, dtype=np.float32) -> dict:
    return gemma4_vision.to_hf(params, _tower(keys["vision_config"], keys["base_emb_dim"]), PREFIX, dtype)


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=decoder.layer_types, embed=embed, layer=decoder.layer,
    logits=standard_layers.logits, flops_per_token=decoder.flops_per_token, hf_names=decoder.HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config, cache_heads=decoder.cache_heads,
    per_layer_inputs=per_layer_inputs, layer_state=decoder.layer_state,
    vision=contract.Vision(text_family="gemma4_text", embed=embed_images, input_keys=IMAGE_KEYS,
                           prefix=(PREFIX + gemma4_vision.TOWER, PREFIX + gemma4_vision.PROJECTOR) + AUDIO,
                           text_prefixes=TEXT_PREFIXES, to_maxtrain=vision_to_maxtrain, to_hf=vision_to_hf,
                           inputs=model_inputs, flops=vision_flops, projector=("projection",), blocks=blocks))
