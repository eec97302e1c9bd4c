"""The family contract: everything the rest of maxtrain uses from a model family, written down as a type.

    MODEL = contract.FamilyModel(row=FAMILY, param_specs=param_specs, layer_types=layer_types, ...)

Each module of `models/families/` ends by building one FamilyModel from its functions;
`models.families.FAMILIES` maps decoder_block to it, and `models/model.Model.bind(config)` binds it to a
config once: `layer_types` is called there and nowhere else, and the functions that need the resolved
stack (param_specs, layer, flops_per_token) receive the bound Model (`model.config`, `model.layer_types`,
`model.num_moe_layers`). The decoder, decoding, the checkpoint checks,
Hugging Face conversion and FLOPs call these fields and nothing else of a family: no attribute is
probed with `hasattr`, and a family that lacks a required one fails when its module is imported, not
in the middle of a run. What every family declares:

    row              its registry row (config/registry.py): decoder_block name, Hugging Face model_type
                     and architecture, attention pattern, its own settings and rules
    param_specs      model -> nested dict of ParamSpec: every parameter, declared once
    layer_types      config -> [LayerType] per layer (models/layers.py), called once, by Model.bind
    embed            (params, tokens [B, T], config, rt) -> x [B, T, D]
    layer            (x, p, inputs, layer_type, model, rt) -> (x, aux): one layer of the stack
    logits           (params, x, config, rt) -> float32 logits [B, T, V]
    flops_per_token  (model, dense_attention) -> training FLOPs per token (model FLOPs)
    hf_names         maxtrain parameter path -> (Hugging Face tensor name, models/hf.py Layout)
    from_hf_config   (config.json dict, notes) -> maxtrain's model keys
    to_hf_config     model keys -> config.json dict

and what it may override (the defaults serve every family with multi-head attention):

    rope_head_dim    config -> the features RoPE's tables cover (head_dim; MLA: qk_rope_head_dim)
    cache_heads      config -> ((heads, width) of the k cache, (heads, width) of the v cache)
    layer_cache      (config, layer_type, batch, max_length, kv_heads) -> {name: (shape, dtype or None)}: one
                     layer's decoding cache (dtype None: the cache's). The default is attention's k and v
                     [B, S, heads, width] of kv_heads = cache_heads(config); a layer kind that keeps something
                     else declares it (the gated delta-net: its rule state and convolution window,
                     models/recurrent/hybrid.py). The decoder stacks each name over the layers that have it, in layer
                     order, and hands a layer its entries in the declared order (models/decoder.py)
    mtp_copies       Hugging Face tensors of the MTP modules that copy the model's own (DeepSeek)
    per_layer_inputs (params, tokens [B, T], x [B, T, D] the embedding, config, rt) -> [L, B, T, ...]: an
                     input of each layer beside x, which its `layer` reads as inputs.per_layer (Gemma 4's
                     per-layer input embeddings); None: none
    layer_state      (x [B, T, D], config, rt, length: T, or the cache slots when decoding) -> the initial value of a pytree the layers hand on, each reading
                     it as inputs.state and replacing it by returning aux["state"] (Gemma 4's shared-KV
                     layers read the keys and values an earlier layer left there); None: none
    rope_tables      (positions [B, T] or [streams, B, T], config, widths {name: features}) -> {name: (cos, sin)
                     [B, T, H/2]}: RoPE's tables from the family's own positions (Qwen3-VL's M-RoPE: three streams
                     t, h, w); the layers then see positions[0]. None: models/rope.named_tables over [B, T]
    vision           a `Vision`: the image tower that fills the image placeholders before the layers (Qwen3-VL),
                     its parameters under params["vision"], its FLOPs per image (Vision.flops); None: a text-only
                     family (images are refused)

Settings a family reads beyond the shared ones, and its rules, live in its registry row (config/ reads
them before JAX starts); which config keys a checkpoint is checked against come from there too
(models/model_keys.py: SHAPE_KEYS, SETTING_KEYS).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from maxtrain.config import registry
from maxtrain.models import hf


def full_head_dim(config) -> int:
    """RoPE's table width for a family that rotates whole heads (the rotated fraction is per layer)."""
    return config.head_dim


def kv_cache_heads(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """The KV cache of grouped-query attention: k and v of base_num_kv_heads heads of head_dim each."""
    return (config.base_num_kv_heads, config.head_dim), (config.base_num_kv_heads, config.head_dim)


def kv_layer_cache(config, layer_type, batch: int, max_length: int, kv_heads) -> dict:
    """An attention layer's decoding cache: k and v [B, S, heads, width] (kv_heads: the family's cache_heads)."""
    (k_heads, k_width), (v_heads, v_width) = kv_heads
    return {"k": ((batch, max_length, k_heads, k_width), None), "v": ((batch, max_length, v_heads, v_width), None)}


@dataclasses.dataclass(frozen=True)
class Vision:
    """A family's image tower (models/vision/), as the decoder and Hugging Face conversion see it."""

    text_family: str                 # decoder_block of its text decoder alone (convert_hf.py import --text-only)
    embed: Callable[..., Any]        # (params, x [B, T, D], tokens, images {input_keys: arrays}, model, rt) ->
                                     # (x with the placeholders' rows replaced, per-layer inputs [L, B, T, D] or None);
                                     # images flat or by row (models/image_batch.py: by_row, placeholder_index)
    input_keys: tuple[str, ...]      # the batch keys of `images` (pixel_values and the tower's layout arrays)
    prefix: str | tuple[str, ...]    # the tower's tensor-name prefix(es) in the checkpoint (model.visual.)
    text_prefixes: dict              # the text decoder's prefixes in the checkpoint -> in the text model's names
    to_maxtrain: Callable[..., dict]  # (the tensors under `prefix`, model keys, dtype) -> params["vision"]
    to_hf: Callable[..., dict]       # (params["vision"], model keys, dtype) -> tensors under `prefix`
    inputs: Callable[..., tuple]     # (config, input_ids [B, T], pixel_values, ..., pad_to=None) -> (positions, images)
                                     # for Model.forward, made on the host as the processor's model does; its
                                     # arguments after input_ids are transformers' forward-argument names
                                     # (qwen3_vl: pixel_values, image_grid_thw; llama4: pixel_values;
                                     # gemma4: pixel_values, image_position_ids)
    flops: Callable[[Any, int], dict]  # (config, patches) -> the forward pass's matmul FLOPs of one image of that many
                                     # patches by the parts vision_freeze names, {"tower", "projector",
                                     # "projector_entry": the projector's matmuls whose input gradient only the tower
                                     # needs}; Model.vision_flops makes training FLOPs of them
    projector: tuple[str, ...] = ()  # the keys of params["vision"] that map the tower's features into the text model's
                                     # width (vision_freeze's "projector"; the rest is the tower: training/freeze.py)
    # (tokens [B, T], segment_ids [B, T], config) -> LayerInputs.blocks: the runs of image tokens that attend to each
    # other both ways (gemma4's bidirectional_image_attention), or None where the config keeps attention causal
    blocks: Callable[..., Any] | None = None

    def inputs_named(self, config, input_ids, arrays: dict) -> tuple:
        """inputs(config, input_ids, **arrays), the arrays under transformers' forward-argument names; a ValueError
        names arrays it does not take, or lacks."""
        try:
            inspect.signature(self.inputs).bind(config, input_ids, **arrays)
        except TypeError as e:
            raise ValueError(f"the arrays {sorted(arrays)} are not the image inputs {config.decoder_block} reads ({e});"
                             " name them as transformers' forward arguments (pixel_values, ...)") from None
        return self.inputs(config, input_ids, **arrays)


@dataclasses.dataclass(frozen=True)
class FamilyModel:
    """One model family, as the decoder, decoding, checkpoints, HF conversion and FLOPs see it."""

    row: registry.Family
    param_specs: Callable[[Any], dict]
    layer_types: Callable[[Any], list]
    embed: Callable[..., Any]
    layer: Callable[..., Any]
    logits: Callable[..., Any]
    flops_per_token: Callable[[Any, bool], float]
    hf_names: dict
    from_hf_config: Callable[..., dict]
    to_hf_config: Callable[[dict], dict]
    rope_head_dim: Callable[[Any], int] = full_head_dim
    cache_heads: Callable[[Any], tuple] = kv_cache_heads
    mtp_copies: tuple[str, ...] = ()
    layer_cache: Callable[..., dict] = kv_layer_cache
    per_layer_inputs: Callable[..., Any] | None = None
    layer_state: Callable[..., Any] | None = None
    rope_tables: Callable[..., dict] | None = None
    vision: Vision | None = None

    def __post_init__(self):
        untyped = [path for path, entry in self.hf_names.items()
                   if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], hf.Layout))]
        if untyped:
            raise TypeError(f"the {self.row.name} family's hf_names {untyped[:4]} are not (name, models.hf.Layout)")

    @property
    def name(self) -> str:
        return self.row.name
