"""What the families that read images through Qwen's tower (models/vision/qwen.py) share: Qwen3-VL's and Qwen3.5's
multimodal RoPE, their image inputs, and the placeholder fill.

    M-RoPE    three position streams (t, h, w) [3, B, T] (`rope_index`: text counts on; an image's tokens sit at
                (t0, t0 + row, t0 + column) and the text after it resumes at t0 + max(h, w) / m); frequency pair i
                turns by stream h when i % 3 == 1 and i < 3 mrope_section[1], by w when i % 3 == 2 and
                i < 3 mrope_section[2], else by t (transformers' interleaved layout). Positions [B, T] (text alone)
                are the three streams equal: plain RoPE. The pairs are those of the rotated features (a partial
                RoPE's leading head_dim x partial_rotary_factor)
    x         = embed(tokens), the rows of the <|image_pad|> placeholders replaced, in order, by the tower's merged
                embeddings (one per m x m window of patches), as transformers' masked_scatter; the deepstack
                features (Qwen3-VL) at the placeholders as per-layer inputs [L, B, T, D], zero elsewhere

The model keys vision_config (config.json's vision_config as JSON), image_token_id and mrope_section carry what
the text keys do not. Images enter Model.forward as `images` (`image_inputs`: pixel_values and the tower's
PatchLayout arrays, padded to a fixed size so a training step compiles once).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import hf, image_batch
from maxtrain.models import rope as rope_lib
from maxtrain.models.vision import frame_attention, qwen

IMAGE_KEYS = ("pixel_values",) + tuple(f"patch_{name}" for name in qwen.PatchLayout._fields)
TEXT_PREFIXES = {"model.language_model.": "model.", "lm_head.": "lm_head."}  # checkpoint -> the text model's names


@functools.lru_cache(maxsize=16)
def _vision(text: str) -> qwen.VisionConfig:
    return qwen.VisionConfig.from_hf(json.loads(text))


def vision_config(config) -> qwen.VisionConfig:
    """The tower's config from the model key vision_config (config.json's vision_config as JSON)."""
    if not config.vision_config:
        raise ValueError(f"this {config.decoder_block} model has no vision tower (vision_config is empty): it reads "
                         "no images; import an image-text checkpoint with scripts/convert_hf.py import")
    return _vision(config.vision_config)


def flops(config, patches: int) -> dict:
    """The tower's forward matmul FLOPs by part for one image of `patches` patches (contract.Vision.flops)."""
    return qwen.flops(vision_config(config), patches)


# --------------------------------------------------------------------------------------------
# Multimodal RoPE
# --------------------------------------------------------------------------------------------


def mrope_streams(section, pairs: int) -> np.ndarray:
    """[pairs] int: the position stream (0 t, 1 h, 2 w) each frequency pair turns by (interleaved layout)."""
    i = np.arange(pairs)
    streams = np.zeros(pairs, np.int32)
    if section:
        streams[(i % 3 == 1) & (i < 3 * section[1])] = 1
        streams[(i % 3 == 2) & (i < 3 * section[2])] = 2
    return streams


def rope_tables(positions, config, widths: dict) -> dict:
    """{name: (cos, sin) [B, T, W/2]} of positions [3, B, T] (or [B, T]: the three streams equal) for each table of
    W rotated features (the family contract's rope_tables)."""
    if positions.ndim == 2:
        positions = jnp.broadcast_to(positions[None], (3,) + positions.shape)
    tables = {}
    for name, width in widths.items():
        freq, factor = rope_lib.inv_freq(rope_lib.Rope.from_config(config), width)
        streams = mrope_streams(config.mrope_section, width // 2)
        chosen = jnp.moveaxis(positions.astype(jnp.float32)[streams], 0, -1)  # [B, T, W/2]: each pair's position
        angles = chosen * jnp.asarray(freq)
        tables[name] = (jnp.cos(angles) * factor, jnp.sin(angles) * factor)
    return tables


def rope_index(input_ids, image_grid_thw, image_token_id: int, spatial_merge_size: int) -> np.ndarray:
    """M-RoPE positions [3, B, T] int32 for input_ids [B, T] (numpy, on the host), as transformers' get_rope_index
    for images: a run of text counts on from the current position p in all three streams; a run of placeholders
    takes the next image of image_grid_thw (over the rows in order), its tokens at (p + t, p + row, p + column)
    of its merged grid, and p moves on by max(h, w) / m."""
    ids = np.asarray(input_ids)
    grids = iter([tuple(int(v) for v in row) for row in np.asarray(image_grid_thw).reshape(-1, 3)]
                 if image_grid_thw is not None else [])
    out = np.zeros((3,) + ids.shape, np.int32)
    m = spatial_merge_size
    for b, row in enumerate(ids):
        image = row == image_token_id
        pos, t, parts = 0, 0, []
        while t < len(row):
            end = t
            while end < len(row) and image[end] == image[t]:
                end += 1
            if not image[t]:
                parts.append(np.broadcast_to(np.arange(end - t) + pos, (3, end - t)))
                pos += end - t
            else:
                try:
                    gt, gh, gw = next(grids)
                except StopIteration:
                    raise ValueError(f"row {b} has more runs of image placeholders (id {image_token_id}) than "
                                     "image_grid_thw has images; give one grid per image") from None
                tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh // m), np.arange(gw // m), indexing="ij")
                grid_pos = np.stack([tt + pos, hh + pos, ww + pos]).reshape(3, -1)
                if grid_pos.shape[1] != end - t:
                    raise ValueError(f"row {b}: {end - t} image placeholders where the image of grid "
                                     f"{(gt, gh, gw)} has {grid_pos.shape[1]} merged tokens; expand each image to "
                                     "t*h*w / merge_size^2 <|image_pad|> tokens")
                parts.append(grid_pos)
                pos += max(gh, gw) // m
            t = end
        out[:, b] = np.concatenate(parts, axis=1)
    return out


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


def image_inputs(pixel_values, image_grid_thw, config, pad_to: int | None = None) -> dict:
    """The `images` Model.forward reads (batch keys IMAGE_KEYS): pixel_values [P, C*t*p*p] and the tower's
    layout (qwen.patch_layout), padded with zero patches to pad_to patches."""
    vc = vision_config(config)
    layout = qwen.patch_layout(image_grid_thw, vc, pad_to)
    pixels = np.asarray(pixel_values, np.float32)
    if pixels.ndim != 2 or pixels.shape[1] != vc.patch_dim:
        raise ValueError(f"pixel_values {pixels.shape} must be [patches, {vc.patch_dim}] (the processor's layout)")
    pixels = np.concatenate([pixels, np.zeros((layout.segments.shape[0] - pixels.shape[0], vc.patch_dim), np.float32)])
    return {"pixel_values": pixels, **{f"patch_{k}": v for k, v in layout._asdict().items()}}


def model_inputs(config, input_ids, pixel_values, image_grid_thw, pad_to: int | None = None) -> tuple:
    """(positions [3, B, T], images) of Model.forward for input_ids [B, T] whose placeholders the images fill (host;
    the contract's Vision.inputs)."""
    images = image_inputs(pixel_values, image_grid_thw, config, pad_to)
    check_placeholders(input_ids, images, config.image_token_id)
    positions = rope_index(input_ids, image_grid_thw, config.image_token_id, vision_config(config).spatial_merge_size)
    return positions, images


def check_placeholders(tokens, images: dict, image_token_id: int) -> None:
    """Refuses a batch whose placeholders are not as many as the images' merged tokens (host arrays)."""
    placeholders = int(np.sum(np.asarray(tokens) == image_token_id))
    merged = int(np.sum(np.asarray(images["patch_images"]) > 0))
    if placeholders != merged:
        raise ValueError(f"the batch has {placeholders} image placeholders (token {image_token_id}) but its images "
                         f"have {merged} merged tokens; expand each image to t*h*w / merge_size^2 <|image_pad|> tokens")


def embed_images(params, x, tokens, images: dict, model, rt):
    """(x with the placeholders' rows replaced by the images' embeddings, in order (flat or by row:
    models/image_batch.py; the tower runs each row's images as a sequence of their own, flat ones as one); the
    deepstack features at the placeholders as per-layer inputs [L, B, T, D], zero elsewhere and after the last
    feature, or None without deepstack) (the contract's Vision.embed)."""
    config = model.config
    images, rows = image_batch.in_rows(images, IMAGE_KEYS, tokens.shape[0])  # [B, X, ...]: flat ones one row
    missing = [k for k in IMAGE_KEYS if k not in images]
    if missing:
        raise ValueError(f"images lack {missing}; make them with "
                         "models/vision/qwen_images.image_inputs(pixel_values, grid_thw, config)")
    try:  # concrete arrays are checked here; traced ones were by model_inputs, on the host
        check_placeholders(np.asarray(tokens), {"patch_images": np.asarray(images["patch_images"])},
                           config.image_token_id)
    except jax.errors.TracerArrayConversionError:
        pass
    layout = qwen.PatchLayout(*(jnp.asarray(images[f"patch_{k}"]) for k in qwen.PatchLayout._fields))
    merged, features = qwen.forward_layout(params["vision"], jnp.asarray(images["pixel_values"]), layout,
                                           vision_config(config), rt.dtype, remat=rt.remat_policy != "none",
                                           attention_impl=frame_attention.implementation(rt), platform=rt.backend)
    merged, features = merged.reshape(-1, merged.shape[-1]), [f.reshape(-1, f.shape[-1]) for f in features]
    mask = tokens == config.image_token_id                                   # [B, T]
    index = image_batch.placeholder_index(mask, rows, merged.shape[0])

    def scatter(rows, into):
        return jnp.where(mask[..., None], rows[index].astype(into.dtype), into)
    x = scatter(merged, x)
    layers = config.base_num_decoder_layers
    if not features:
        return x, None
    zeros = jnp.zeros_like(x)
    per_layer = [scatter(f, zeros) for f in features[:layers]]
    return x, jnp.stack(per_layer + [zeros] * (layers - len(per_layer)))


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


def text_config(config: dict, name: str) -> dict:
    """config.json's text_config (with the whole model's tie_word_embeddings) of an image-text model `name`."""
    if not isinstance(config.get("text_config"), dict) or not isinstance(config.get("vision_config"), dict):
        raise hf.ConversionError(f"config.json of a {name} model needs text_config and vision_config")
    return {**config["text_config"], "tie_word_embeddings": config.get(
        "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}


def image_keys(config: dict, rope: dict, default_section: list, vision_type: str, default_image: int) -> dict:
    """The model keys mrope_section (rope: the text model's RoPE parameters; default_section where they have none,
    as transformers), image_token_id (default_image where config.json has none) and vision_config (read as the
    tower of model_type vision_type)."""
    section = rope.get("mrope_section") or default_section
    if not (isinstance(section, (list, tuple)) and len(section) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
        raise hf.ConversionError(f"mrope_section={section!r} must be three counts of frequency pairs (t, h, w)")
    vision = qwen.VisionConfig.from_hf({"model_type": vision_type, **config["vision_config"]})
    return {"mrope_section": list(section), "image_token_id": int(config.get("image_token_id", default_image)),
            "vision_config": json.dumps(vision_dict(vision), sort_keys=True)}


def hf_config(text: dict, keys: dict, row, text_type: str, vision: dict) -> dict:
    """config.json of an image-text model (row: its registry row) from its text model's fields (`text`, as the text
    family writes them), the model keys (M-RoPE's sections into the text model's rope_parameters) and vision_config."""
    text = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "tie_word_embeddings")}
    rope = {**text["rope_parameters"], "mrope_section": list(keys["mrope_section"]), "mrope_interleaved": True}
    return {"architectures": [row.hf_architecture], "model_type": row.hf_model_types[0],
            "image_token_id": keys["image_token_id"], "tie_word_embeddings": keys["logits_via_embedding"],
            "text_config": {**text, "model_type": text_type, "rope_parameters": rope}, "vision_config": vision}


def vision_dict(vision: qwen.VisionConfig) -> dict:
    return {**vision.to_hf(), "deepstack_visual_indexes": list(vision.deepstack_visual_indexes)}


def keys_vision(keys: dict) -> qwen.VisionConfig:
    if not keys.get("vision_config"):
        raise hf.ConversionError(f"this {keys.get('decoder_block')} model has no vision tower (its vision_config is "
                                 "empty); Hugging Face conversion needs one: import an image-text checkpoint")
    return _vision(keys["vision_config"])


def with_tower(specs: dict, config) -> dict:
    """A family's param_specs with the tower's under "vision" (without a vision_config, a preset's or a test's:
    the text decoder alone, with M-RoPE)."""
    if not config.vision_config:
        return specs
    return {**specs, "vision": qwen.param_specs(vision_config(config))}


def vision_converters(prefix: str) -> tuple:
    """(to_maxtrain, to_hf) of the contract's Vision for the tower under `prefix` in the checkpoint."""
    def to_maxtrain(tensors: dict, keys: dict, dtype=np.float32) -> dict:
        return qwen.to_maxtrain(tensors, keys_vision(keys), prefix, dtype)

    def to_hf(params: dict, keys: dict, dtype=np.float32) -> dict:
        return qwen.to_hf(params, keys_vision(keys), prefix, dtype)
    return to_maxtrain, to_hf
