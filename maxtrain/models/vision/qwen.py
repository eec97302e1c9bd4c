"""The vision tower of Qwen3-VL and Qwen3.5 (Qwen Team 2025, 2026): a ViT over patches of space and time.

The processor cuts each image (a video: each pair of frames) into patches of temporal_patch x patch x patch
pixels, C channels, flattened in the order (C, t, y, x): pixel_values [P, C*t*p*p]. grid_thw [images, 3] says
each image's (t, h, w) in patches; its P = t*h*w patches arrive frame by frame, and within a frame by merge
window: the m x m patches that the merger joins into one token are consecutive (m = spatial_merge_size).

    x      = pixels . W_patch + b                                       (the Conv3d as a matmul)
           + sum_k w_k pos_embed[j_k]           the learned grid (sqrt(num_position_embeddings) a side),
                                                 bilinear over the 4 nearest cells, corners aligned
    block  x = x + proj(attention(rope2d(qkv(LN(x)))));  x = x + fc2(act(fc1(LN(x))))
           attention is bidirectional within each frame (a segment per frame; frame_attention.py: the run's
           kernel or query blocks, never a [P, P] mask over the batch); rope2d rotates, in the
           rotate-half layout, the first half of each half-head by the patch's row and the second by its
           column, at inv_freq[i] = theta ** (-4i / H)
    merger LN over D, the m*m patches of a window concatenated (D m^2), fc1, exact GELU, fc2 -> out_hidden_size
    deep   Qwen3-VL: after each block of deepstack_visual_indexes, a merger of its own whose LN comes after
           the concatenation (over D m^2); the features go into the first decoder layers (models/families/qwen3_vl/)

forward_layout(params, pixel_values, layout, config) -> (embeddings [P/m^2, O], deepstack features, one per index),
where layout = patch_layout(grid_thw, config, pad_to) holds the per-patch arrays the grid decides (frame segments,
rotary rows and columns, position-embedding taps and weights, each merged token's image), made in numpy on the host:
the jitted forward sees arrays only, padded to a fixed number of patches, and does not recompile per batch. Given
rows (pixel_values [B, P, ...] and the layout's arrays [B, P, ...]: a micro batch's images, each row's in its own
slot), the tower runs them as a batch of B sequences of P patches, each attending within itself: its attention costs
B P^2, not (B P)^2, and the outputs are [B, P/m^2, O].
forward(params, pixel_values, grid_thw, config) is the same with grid_thw static and no padding.

Qwen3.5's tower is Qwen3-VL's without deepstack (no deepstack_visual_indexes). Window attention (Qwen2.5-VL's
fullatt_block_indexes) belongs to neither and is not implemented.

Hugging Face names: `hf_names(config)` maps each parameter path to (tensor name under the tower's prefix,
layout); `to_maxtrain` and `to_hf` convert a state dict both ways. PREFIXES: the tower's prefix per transformers
class (model.visual. in the released checkpoints of Qwen3-VL, Qwen3.5 and their MoE models, whose tower is the same).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import rope
from maxtrain.models.hf import FLAT, SAME, ConversionError, Layout, Linear
from maxtrain.models.params import ParamSpec, dense, stacked
from maxtrain.models.vision import frame_attention, hf_tensors

LAYER_NORM_EPS = 1e-6  # every LayerNorm of the tower (fixed in transformers' modules)

# The tower's tensor-name prefix per transformers class: the ...ForConditionalGeneration checkpoints (the released
# ones, the MoE models' too: their tower is the same) keep it under model.visual.; a ...VisionModel's has none.
_MODELS = ("Qwen3VL", "Qwen3VLMoe", "Qwen3_5", "Qwen3_5Moe")
PREFIXES = {**{f"{m}ForConditionalGeneration": "model.visual." for m in _MODELS},
            **{f"{m}Model": "visual." for m in _MODELS}, **{f"{m}VisionModel": "" for m in _MODELS}}

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The tower's sizes, under the names of transformers' Qwen3VLVisionConfig (vision_config in config.json)."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 3584
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a head dim that "
                             "is a multiple of 4 (2-D rotary: a quarter of it per axis and half)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings={self.num_position_embeddings} is not a square grid")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes) \
                or list(self.deepstack_visual_indexes) != sorted(set(self.deepstack_visual_indexes)):
            raise ValueError(f"deepstack_visual_indexes={list(self.deepstack_visual_indexes)} must be increasing "
                             f"block indexes below depth {self.depth}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """C * t * p * p: the width of one row of pixel_values."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        """D * m^2: the width of a merge window's patches side by side."""
        return self.hidden_size * self.spatial_merge_size**2

    @classmethod
    def from_hf(cls, vision_config: dict) -> VisionConfig:
        """From config.json's vision_config (Qwen3-VL or Qwen3.5); an omitted field takes transformers' default."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "deepstack_visual_indexes"}
        keys = {k: vision_config[k] for k in fields if vision_config.get(k) is not None}
        for name, value in keys.items():
            if isinstance(value, (list, tuple)):  # transformers allows (t, h, w)-style sizes; Qwen's are square
                raise ConversionError(f"vision_config.{name}={value!r}: maxtrain's Qwen vision tower takes one size")
        rope_parameters = vision_config.get("rope_parameters") or {}
        if rope_parameters.get("rope_type", "axial") != "axial":
            raise ConversionError(f"vision_config.rope_parameters={rope_parameters}: the tower's RoPE is axial")
        deepstack = vision_config.get("deepstack_visual_indexes")
        if deepstack is None and str(vision_config.get("model_type", "")).startswith("qwen3_vl"):
            deepstack = (8, 16, 24)  # Qwen3VLVisionConfig's default where the file omits them
        try:
            return cls(**keys, deepstack_visual_indexes=tuple(deepstack or ()),
                       rope_theta=float(rope_parameters.get("rope_theta", 10000.0)))
        except ValueError as e:
            raise ConversionError(f"vision_config: {e}") from None

    def to_hf(self) -> dict:
        """config.json's vision_config; deepstack_visual_indexes only where there are some (Qwen3.5's has none)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rope_theta", "deepstack_visual_indexes")}
        if self.deepstack_visual_indexes:
            out["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        return {**out, "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def _merger_specs(config: VisionConfig, postshuffle: bool) -> dict:
    m, o = config.merged_dim, config.out_hidden_size
    norm = (m,) if postshuffle else (config.hidden_size,)
    return {"norm": ParamSpec(norm, (None,) if postshuffle else ("embed",), "ones"),
            "norm_bias": ParamSpec(norm, (None,) if postshuffle else ("embed",), "zeros"),
            "w_in": dense((m, m), (None, "mlp"), m), "b_in": ParamSpec((m,), ("mlp",), "zeros"),
            "w_out": dense((m, o), ("mlp", "embed"), m), "b_out": ParamSpec((o,), ("embed",), "zeros")}


def param_specs(config: VisionConfig) -> dict:
    """The tower's parameters: D the tower's width, N heads of H, F its MLP, O the text model's width.

    patch_embed [C*t*p*p, D], pos_embed [num_position_embeddings, D]; blocks, stacked over `layers`: the
    LayerNorms, wqkv [D, 3, N, H] (q, k, v fused as transformers keeps them), wo [N, H, D], the MLP w_in [D, F],
    w_out [F, D], each with its bias; merger and (Qwen3-VL) deepstack, stacked: LayerNorm, w_in [Dm^2, Dm^2],
    w_out [Dm^2, O]."""
    d, n, h, f = config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size
    norm = {"ones": ParamSpec((d,), ("embed",), "ones"), "zeros": ParamSpec((d,), ("embed",), "zeros")}
    block = {"attn_norm": norm["ones"], "attn_norm_bias": norm["zeros"],
             "wqkv": dense((d, 3, n, h), ("embed", None, "heads", "head_dim"), d),
             "bqkv": ParamSpec((3, n, h), (None, "heads", "head_dim"), "zeros"),
             "wo": dense((n, h, d), ("heads", "head_dim", "embed"), d), "bo": norm["zeros"],
             "mlp_norm": norm["ones"], "mlp_norm_bias": norm["zeros"],
             "w_in": dense((d, f), ("embed", "mlp"), d), "b_in": ParamSpec((f,), ("mlp",), "zeros"),
             "w_out": dense((f, d), ("mlp", "embed"), f), "b_out": norm["zeros"]}
    specs = {"patch_embed": dense((config.patch_dim, d), (None, "embed"), config.patch_dim),
             "patch_bias": norm["zeros"],
             "pos_embed": ParamSpec((config.num_position_embeddings, d), (None, "embed"), "normal", 0.02),
             "blocks": stacked(block, config.depth), "merger": _merger_specs(config, postshuffle=False)}
    if config.deepstack_visual_indexes:
        specs["deepstack"] = stacked(_merger_specs(config, postshuffle=True), len(config.deepstack_visual_indexes))
    return specs


# --------------------------------------------------------------------------------------------
# What the grid decides (host, numpy)
# --------------------------------------------------------------------------------------------


def grid(grid_thw, config: VisionConfig) -> list[tuple[int, int, int]]:
    """grid_thw as Python (t, h, w) triples; h and w must be multiples of spatial_merge_size."""
    try:
        rows = np.asarray(grid_thw).reshape(-1, 3)
    except jax.errors.TracerArrayConversionError:
        raise ValueError("grid_thw must be static (numpy or Python ints), not a traced array") from None
    m = config.spatial_merge_size
    out = [(int(t), int(h), int(w)) for t, h, w in rows]
    if any(t < 1 or h < 1 or w < 1 or h % m or w % m for t, h, w in out):
        raise ValueError(f"grid_thw {out}: each (t, h, w) must be positive with h and w multiples of {m}")
    return out


def patch_positions(grid_thw, config: VisionConfig) -> np.ndarray:
    """(row, column) [P, 2] of each patch in the order pixel_values holds them: frame by frame, and within a
    frame window by window (m x m patches, row-major inside), the windows row-major."""
    m, out = config.spatial_merge_size, []
    for t, h, w in grid(grid_thw, config):
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        order = [a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)]
        out.append(np.tile(np.stack(order, axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int32)


def segment_ids(grid_thw, config: VisionConfig) -> np.ndarray:
    """[P] int32: 1 + the frame's index over all images; a patch attends to the patches of its own frame."""
    sizes = [h * w for t, h, w in grid(grid_thw, config) for _ in range(t)]
    return np.repeat(np.arange(1, len(sizes) + 1), sizes).astype(np.int32)


def _taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps [n, 2] into a table axis of `side` cells for position `index` on an axis of `size`, corners
    aligned (index 0 on cell 0, size - 1 on cell side - 1), and their weights; float32 as transformers computes."""
    source = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(source)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2), 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(source[:, None] - floor[:, None] - offsets), np.float32(0))
    return taps, weights.astype(np.float32)


def position_taps(grid_thw, config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(rows of pos_embed [P, 4] int32, their weights [P, 4] float32): the learned square grid resampled
    bilinearly (corners aligned) to each image's h x w, patch by patch."""
    side = math.isqrt(config.num_position_embeddings)
    positions = patch_positions(grid_thw, config)
    sizes = np.concatenate([np.tile([[h, w]], (t * h * w, 1)) for t, h, w in grid(grid_thw, config)])
    (rt, rw), (ct, cw) = _taps(positions[:, 0], sizes[:, 0], side), _taps(positions[:, 1], sizes[:, 1], side)
    rows = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
    return rows.astype(np.int32), (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)


def rotary(grid_thw, config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [P, H/2] float32 of the 2-D rotary: the first H/4 angles are the row times inv_freq, the next
    H/4 the column times inv_freq, inv_freq[i] = theta ** (-2i / (H/2)) (models/rope.py's rotate-half layout)."""
    half = config.head_dim // 2
    inv_freq = (1.0 / config.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    angles = patch_positions(grid_thw, config).astype(np.float32)[:, :, None] * inv_freq.astype(np.float32)
    angles = angles.reshape(angles.shape[0], -1)  # [P, 2 * H/4]: rows' angles, then columns'
    return np.cos(angles), np.sin(angles)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def layer_norm(x, scale, bias, eps: float = LAYER_NORM_EPS):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    out = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return out.astype(x.dtype)


def _linear(x, w, b, n: int = 1):
    """x [..., K1..Kn] . w [K1..Kn, ...] + b, accumulated in float32, in x's dtype."""
    out = jnp.tensordot(x, w.astype(x.dtype), axes=n, preferred_element_type=jnp.float32)
    return (out + b.astype(jnp.float32)).astype(x.dtype)


def block(x, p, cos, sin, segments, config: VisionConfig, attend=frame_attention.attend):
    """One ViT block on x [B, P, D]: pre-LayerNorm attention (2-D rotary by (cos, sin) [B, P, H/2], within the
    frames of `segments` [B, P], by `attend`: frame_attention.attend with the run's implementation) and MLP,
    residual."""
    qkv = _linear(layer_norm(x, p["attn_norm"], p["attn_norm_bias"]), p["wqkv"], p["bqkv"])  # "BPD,DCNH->BPCNH"
    q, k, v = (qkv[:, :, i] for i in range(3))                                             # [B, P, N, H] each
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    out = attend(q, k, v, segments)                                                        # [B, P, N, H]
    x = x + _linear(out, p["wo"], p["bo"], 2)                                              # "BPNH,NHD->BPD"
    h = _linear(layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"]), p["w_in"], p["b_in"])
    return x + _linear(ACTIVATIONS[config.hidden_act](h), p["w_out"], p["b_out"])


def merge(x, p, config: VisionConfig, postshuffle: bool):
    """The patch merger on x [..., P, D]: each window's m*m patches side by side [..., P/m^2, D m^2] (normed
    before, or with postshuffle after, the concatenation), then fc1, exact GELU, fc2 -> [..., P/m^2, O]."""
    shape = x.shape[:-2] + (-1, config.merged_dim)
    if postshuffle:
        x = layer_norm(x.reshape(shape), p["norm"], p["norm_bias"])
    else:
        x = layer_norm(x, p["norm"], p["norm_bias"]).reshape(shape)
    return _linear(jax.nn.gelu(_linear(x, p["w_in"], p["b_in"]), approximate=False), p["w_out"], p["b_out"])


def _run_blocks(x, blocks, cos, sin, segments, config: VisionConfig, remat: bool = False,
                attend=frame_attention.attend):
    """The blocks stacked in `blocks` (a leading layers axis), one after another under lax.scan; remat: each block's
    activations recomputed in the backward pass (only its input kept), so a training step does not hold every
    block's attention weights at once."""
    def body(h, p):
        return block(h, p, cos, sin, segments, config, attend), None
    return jax.lax.scan(jax.checkpoint(body) if remat else body, x, blocks)[0]


class PatchLayout(NamedTuple):
    """What the grid decides, as arrays of P patches (P padded past the images' patches: pad_to): made on the host
    by `patch_layout`, so a jitted forward sees only their shapes and compiles once per padded size.

    segments   [P] int32     1 + the frame's index over all images; 0 = a padding patch (attends only to padding)
    positions  [P, 2] int32  each patch's (row, column) in its frame: the 2-D rotary's angles
    taps       [P, 4] int32  the rows of pos_embed the patch's position embedding interpolates
    weights    [P, 4] float32  their bilinear weights (0 for padding)
    images     [P/m^2] int32 1 + the image each merged token belongs to; 0 = a padding token (comes last)
    """

    segments: Any
    positions: Any
    taps: Any
    weights: Any
    images: Any


def patch_layout(grid_thw, config: VisionConfig, pad_to: int | None = None) -> PatchLayout:
    """The layout of the images of grid_thw (static) in numpy, padded to pad_to patches (a multiple of m^2, at
    least the images' P) so that batches of other images share one compiled forward; None: no padding."""
    cells = grid(grid_thw, config)
    total, window = sum(t * h * w for t, h, w in cells), config.spatial_merge_size**2
    pad_to = total if pad_to is None else int(pad_to)
    if pad_to < total or pad_to % window:
        raise ValueError(f"pad_to={pad_to} must be a multiple of {window} (spatial_merge_size^2) and at least the "
                         f"images' {total} patches")
    extra = pad_to - total
    if not cells:  # a batch without images keeps the padded shapes: every patch padding
        return PatchLayout(np.zeros(pad_to, np.int32), np.zeros((pad_to, 2), np.int32), np.zeros((pad_to, 4), np.int32),
                           np.zeros((pad_to, 4), np.float32), np.zeros(pad_to // window, np.int32))
    taps, weights = position_taps(grid_thw, config)
    images = np.repeat(np.arange(1, len(cells) + 1), [t * h * w // window for t, h, w in cells])

    def pad(a, width=None):
        return np.concatenate([a, np.zeros((extra,) + a.shape[1:], a.dtype)]) if width is None else \
            np.concatenate([a, np.zeros((extra // window,), a.dtype)])
    return PatchLayout(pad(segment_ids(grid_thw, config)), pad(patch_positions(grid_thw, config)), pad(taps),
                       pad(weights), pad(images.astype(np.int32), window))


def _rotary(positions, config: VisionConfig):
    """(cos, sin) [..., P, H/2] float32 of positions [..., P, 2] (traced), the angles of `rotary`."""
    half = config.head_dim // 2
    inv_freq = (1.0 / config.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq.astype(np.float32))
    angles = angles.reshape(angles.shape[:-2] + (-1,))
    return jnp.cos(angles), jnp.sin(angles)


def forward_layout(params, pixel_values, layout: PatchLayout, config: VisionConfig, dtype=jnp.float32,
                   remat: bool = False, attention_impl: str = "dot_product", platform: str | None = None):
    """(embeddings [P/m^2, out_hidden_size], deepstack features, one per deepstack_visual_indexes) from
    pixel_values [P, C*t*p*p] laid out as `layout` says (arrays only: jit-friendly); by rows, pixel_values
    [B, P, C*t*p*p] and the layout's arrays [B, P, ...] give [B, P/m^2, out_hidden_size] each, row r's patches
    attending within row r's frames only (as one sequence would with row r's frames numbered apart). The rows of
    padding patches (layout.images == 0) come last and hold values nothing should use. Matmuls in `dtype`, norms,
    RoPE and softmax in float32. remat: the blocks' activations recomputed in the backward pass (_run_blocks).
    attention_impl, platform: the attention within frames (frame_attention.implementation(rt) for a run; platform
    None: this machine's backend)."""
    if tuple(pixel_values.shape) != tuple(jnp.shape(layout.segments)) + (config.patch_dim,):
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match the layout's "
                         f"{tuple(jnp.shape(layout.segments))} patches of {config.patch_dim} values each")
    one = jnp.ndim(layout.segments) == 1  # one sequence: a batch of one row
    layout = PatchLayout(*(jnp.asarray(a)[None] if one else jnp.asarray(a) for a in layout))
    pixel_values = pixel_values[None] if one else pixel_values
    x = _linear(pixel_values.astype(dtype), params["patch_embed"], params["patch_bias"])     # [B, P, D]
    table = params["pos_embed"].astype(jnp.float32)
    x = x + jnp.sum(table[layout.taps] * layout.weights[..., None], axis=-2).astype(dtype)
    cos, sin = _rotary(layout.positions, config)
    segments = layout.segments
    attend = functools.partial(frame_attention.attend, implementation=attention_impl,
                               platform=platform or jax.default_backend())
    features, start = [], 0
    for i, index in enumerate(config.deepstack_visual_indexes):  # the blocks up to each index, then its merger
        x = _run_blocks(x, jax.tree.map(lambda a, s=start, e=index + 1: a[s:e], params["blocks"]), cos, sin,
                        segments, config, remat, attend)
        features.append(merge(x, jax.tree.map(lambda a, i=i: a[i], params["deepstack"]), config, postshuffle=True))
        start = index + 1
    if start < config.depth:
        x = _run_blocks(x, jax.tree.map(lambda a: a[start:], params["blocks"]), cos, sin, segments, config, remat,
                        attend)
    merged = merge(x, params["merger"], config, postshuffle=False)
    return (merged[0], tuple(f[0] for f in features)) if one else (merged, tuple(features))


def forward(params, pixel_values, grid_thw, config: VisionConfig, dtype=jnp.float32):
    """forward_layout for the images of grid_thw (static), unpadded: (embeddings [P/m^2, out_hidden_size],
    deepstack features: a tuple of [P/m^2, out_hidden_size], one per deepstack_visual_indexes)."""
    if pixel_values.shape != (sum(t * h * w for t, h, w in grid(grid_thw, config)), config.patch_dim):
        raise ValueError(f"pixel_values {pixel_values.shape} do not hold the patches of grid_thw "
                         f"{grid(grid_thw, config)} ({config.patch_dim} values each)")
    layout = PatchLayout(*(jnp.asarray(a) for a in patch_layout(grid_thw, config)))
    return forward_layout(params, pixel_values, layout, config, dtype)


def flops(config: VisionConfig, patches: int) -> dict:
    """The forward pass's matmul FLOPs for one image (one frame) of `patches` patches, by part: {"tower": the patch
    embedding and the blocks (q, k, v, the attention's scores and values over the frame's patches, the output, the
    MLP), "projector": the merger and the deepstack mergers, "projector_entry": 0 (the mergers' LayerNorms train
    with them: their first matmul's input gradient is needed even under a frozen tower)}. Norms, RoPE, softmax and
    the position embeddings' interpolation are elementwise and not counted. A video's frames each attend within
    themselves: sum per frame."""
    d, f, o, merged = config.hidden_size, config.intermediate_size, config.out_hidden_size, config.merged_dim
    block = 2 * patches * (3 * d * d + d * d + 2 * d * f) + 4 * patches * patches * d
    merger = 2 * (patches // config.spatial_merge_size**2) * merged * (merged + o)
    return {"tower": 2 * patches * config.patch_dim * d + config.depth * block,
            "projector": (1 + len(config.deepstack_visual_indexes)) * merger, "projector_entry": 0}


# --------------------------------------------------------------------------------------------
# Hugging Face names
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PatchConv(Layout):
    """The Conv3d weight [D, C, t, p, p] (its stride its kernel) kept as the matmul [C*t*p*p, D]."""

    kernel: tuple[int, int, int, int]

    def hf_shape(self, shape: tuple) -> tuple:
        return (shape[1], *self.kernel)

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        return w.reshape(w.shape[0], -1).T.reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.T.reshape(w.shape[1], *self.kernel)


def hf_names(config: VisionConfig) -> dict:
    """Each parameter path -> (transformers' tensor name under the tower's prefix, Layout); "{i}" is the index
    of a block, or of a deepstack merger, along the stacked parameter's first axis."""
    kernel = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
    names = {"patch_embed": ("patch_embed.proj.weight", PatchConv(kernel)),
             "patch_bias": ("patch_embed.proj.bias", SAME), "pos_embed": ("pos_embed.weight", SAME)}
    block = {"attn_norm": "norm1.weight", "attn_norm_bias": "norm1.bias", "wqkv": "attn.qkv.weight",
             "bqkv": "attn.qkv.bias", "wo": "attn.proj.weight", "bo": "attn.proj.bias", "mlp_norm": "norm2.weight",
             "mlp_norm_bias": "norm2.bias", "w_in": "mlp.linear_fc1.weight", "b_in": "mlp.linear_fc1.bias",
             "w_out": "mlp.linear_fc2.weight", "b_out": "mlp.linear_fc2.bias"}
    layouts = {"wqkv": Linear(1), "bqkv": FLAT, "wo": Linear(2), "w_in": Linear(1), "w_out": Linear(1)}
    names.update({f"blocks/{k}": (f"blocks.{{i}}.{v}", layouts.get(k, SAME)) for k, v in block.items()})
    merger = {"norm": "norm.weight", "norm_bias": "norm.bias", "w_in": "linear_fc1.weight",
              "b_in": "linear_fc1.bias", "w_out": "linear_fc2.weight", "b_out": "linear_fc2.bias"}
    names.update({f"merger/{k}": (f"merger.{v}", layouts.get(k, SAME)) for k, v in merger.items()})
    if config.deepstack_visual_indexes:
        names.update({f"deepstack/{k}": (f"deepstack_merger_list.{{i}}.{v}", layouts.get(k, SAME))
                      for k, v in merger.items()})
    return names


def _names(config: VisionConfig, prefix: str) -> dict:
    """hf_names with each name under the tower's prefix."""
    return {key: (prefix + name, layout) for key, (name, layout) in hf_names(config).items()}


def to_maxtrain(tensors: dict, config: VisionConfig, prefix: str = "model.visual.", dtype=np.float32) -> dict:
    """The tower's params (nested dict of numpy arrays) from the tensors named under `prefix` (PREFIXES);
    tensors outside the prefix are left alone, one inside it that the tower has no place for is refused."""
    return hf_tensors.read(tensors, param_specs(config), _names(config, prefix), (prefix,), "the vision tower",
                           "depth, deepstack_visual_indexes", dtype)


def to_hf(params: dict, config: VisionConfig, prefix: str = "model.visual.", dtype=np.float32) -> dict:
    """transformers' tensors (numpy, under `prefix`) from the tower's params."""
    return hf_tensors.write(params, param_specs(config), _names(config, prefix), "the vision tower", dtype)
