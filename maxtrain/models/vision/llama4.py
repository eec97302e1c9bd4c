"""Llama 4's vision encoder, pixel-shuffle adapter and multimodal projector (Meta 2025): tiles to the embeddings
that replace an image's `<|patch|>` tokens.

data/images_llama4.py cuts an image into square tiles of image_size pixels: pixel_values [tiles, C, S, S]. Each
tile is seen alone (no attention between tiles), as a sequence of its s x s patches (s = S / p, row-major)
followed by one class token:

    x      = unfold(tile) . W_patch              patches of C x p x p pixels, channel-major, no bias
             ++ class_embedding                  the class token comes last
           + positional_embedding                [s^2 + 1, D], learned for exactly this sequence
    LN_pre x
    block  x = x + o(attention(rope2d(q(LN(x))), rope2d(k(LN(x))), v(LN(x))));  x = x + fc2(GELU(fc1(LN(x))))
           attention is bidirectional over the tile's s^2 + 1 tokens; rope2d rotates (x_2i, x_2i+1) as a complex
           number (the checkpoints' layout, not rotate-half): pair i < H/4 by (column + 1) f_i, pair H/4 + i by
           (row + 1) f_i, f_i = theta ** (-4i / H); the class token is not rotated
    LN_post x, the class token dropped
    adapter pixel shuffle: each k x k block of patches side by side [(s/k)^2, D k^2] (k = 1 / pixel_shuffle_ratio),
           then GELU(fc1), GELU(fc2) (no biases; GELU exact) -> vision_output_dim
    projector linear_1 (no bias) -> the text model's hidden size

forward(params, pixel_values, config) -> [tiles * (s/k)^2, text hidden]: exactly what transformers'
Llama4ForConditionalGeneration scatters over the image tokens (get_image_features' last_hidden_state, flattened,
through multi_modal_projector). Nothing depends on the image beyond the number of tiles: a step compiles once
per tile count (pad the tiles of a batch to a fixed count to compile once).

transformers' modules fix several things their config names: the LayerNorms' eps (1e-5, whatever norm_eps says),
the activations (exact GELU, whatever hidden_act says), no projector bias, the last layer's features with the
class token dropped (vision_feature_layer -1, vision_feature_select_strategy "default"). VisionConfig.from_hf
refuses a config that asks for anything else, and dropout (this forward has none).

Hugging Face names: `hf_names(config)` maps each parameter path to (part, tensor name under the part's prefix,
layout), the part 0 the tower (with its adapter), 1 the projector; `to_maxtrain` and `to_hf` convert both ways.
PREFIXES: the parts' prefixes per transformers class. q and k stay in the checkpoints' paired layout (rotated with
rope.apply_interleaved), so no layout permutes them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import attention, rope
from maxtrain.models.hf import FLAT, SAME, ConversionError, Linear
from maxtrain.models.params import ParamSpec, dense, stacked
from maxtrain.models.vision import hf_tensors
from maxtrain.models.vision.qwen import layer_norm

LAYER_NORM_EPS = 1e-5  # every LayerNorm of the tower: torch's default, which transformers' modules keep

# (tower prefix, projector prefix) per transformers class: the released checkpoints are
# Llama4ForConditionalGeneration's (the text model under language_model.).
PREFIXES = {"Llama4ForConditionalGeneration": ("vision_model.", "multi_modal_projector.")}
RELEASED = PREFIXES["Llama4ForConditionalGeneration"]

# config.json fields whose only value transformers computes (its modules ignore them): the value it computes.
FIXED = {"hidden_act": "gelu", "norm_eps": 1e-5, "multi_modal_projector_bias": False, "vision_feature_layer": -1,
         "vision_feature_select_strategy": "default", "projector_dropout": 0.0, "attention_dropout": 0.0}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The encoder's, adapter's and projector's sizes under the names of transformers' Llama4VisionConfig
    (config.json's vision_config) and text_hidden_size (text_config.hidden_size). The defaults are the released
    Llama 4 Scout and Maverick's (transformers' own defaults do not fit together: 768 * 4 != 5632)."""

    hidden_size: int = 1408
    num_hidden_layers: int = 34
    num_attention_heads: int = 16
    intermediate_size: int = 5632
    num_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    vision_output_dim: int = 4096
    rope_theta: float = 10000.0
    text_hidden_size: int = 5120

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ValueError(f"hidden_size {self.hidden_size} / num_attention_heads {self.num_attention_heads} must "
                             "be a head dim that is a multiple of 4 (2-D rotary: a quarter of it per axis, in pairs)")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        k = round(1 / self.pixel_shuffle_ratio) if self.pixel_shuffle_ratio > 0 else 0
        if k < 1 or abs(k * self.pixel_shuffle_ratio - 1) > 1e-6 or self.side % k:
            raise ValueError(f"pixel_shuffle_ratio {self.pixel_shuffle_ratio} must be 1/k for an integer k that "
                             f"divides the {self.side} patches of a tile's side")
        if self.intermediate_size != self.hidden_size * k * k:
            raise ValueError(f"intermediate_size {self.intermediate_size} must be hidden_size * (1 / "
                             f"pixel_shuffle_ratio)^2 = {self.hidden_size * k * k}: transformers' adapter reads the "
                             "shuffled patches with a layer of that width")
        if not self.projector_input_dim == self.projector_output_dim == self.vision_output_dim:
            raise ValueError(f"projector_input_dim {self.projector_input_dim}, projector_output_dim "
                             f"{self.projector_output_dim} and vision_output_dim {self.vision_output_dim} must be "
                             "equal (transformers' adapter and projector chain them)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.image_size // self.patch_size

    @property
    def shuffle(self) -> int:
        """k: the adapter joins k x k patches into one token."""
        return round(1 / self.pixel_shuffle_ratio)

    @property
    def tokens_per_tile(self) -> int:
        return (self.side // self.shuffle) ** 2

    @classmethod
    def from_hf(cls, vision_config: dict, text_hidden_size: int) -> VisionConfig:
        """From config.json's vision_config and text_config.hidden_size; an omitted size takes the default."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "text_hidden_size"}
        keys = {k: vision_config[k] for k in fields if vision_config.get(k) is not None}
        for name, value in keys.items():
            if isinstance(value, (list, tuple)):
                raise ConversionError(f"vision_config.{name}={value!r}: maxtrain's Llama 4 vision encoder takes one "
                                      "size (square tiles and patches)")
        for name, value in FIXED.items():
            if vision_config.get(name) is not None and vision_config[name] != value:
                raise ConversionError(f"vision_config.{name}={vision_config[name]!r}: maxtrain's Llama 4 vision "
                                      f"encoder computes only {value!r} (as transformers' modules do, which ignore "
                                      "this field)")
        rope_parameters = vision_config.get("rope_parameters") or {}
        if rope_parameters.get("rope_type", "default") != "default":
            raise ConversionError(f"vision_config.rope_parameters={rope_parameters}: the encoder's 2-D RoPE has no "
                                  "scaling")
        theta = rope_parameters.get("rope_theta", vision_config.get("rope_theta", 10000.0))
        try:
            return cls(**keys, rope_theta=float(theta), text_hidden_size=int(text_hidden_size))
        except ValueError as e:
            raise ConversionError(f"vision_config: {e}") from None

    def to_hf(self) -> dict:
        """config.json's vision_config (text_hidden_size is text_config.hidden_size, not written here)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rope_theta", "text_hidden_size")}
        return {**out, **FIXED, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}}


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def param_specs(config: VisionConfig) -> dict:
    """D the encoder's width, N heads of H, F = D k^2 its MLP (and the shuffled width), P the adapter's width,
    E the text model's. patch_embed [C*p*p, D], class_embedding [D], pos_embed [s^2 + 1, D], the LayerNorms
    before and after the blocks; blocks, stacked over `layers`: LayerNorms, wq/wk/wv [D, N, H], wo [N, H, D],
    w_in [D, F], w_out [F, D], each with its bias; adapter w_in [F, P], w_out [P, P]; projector [P, E]."""
    d, n, h, f = config.hidden_size, config.num_attention_heads, config.head_dim, config.intermediate_size
    p, e, patch = config.vision_output_dim, config.text_hidden_size, config.num_channels * config.patch_size**2
    ones, zeros = ParamSpec((d,), ("embed",), "ones"), ParamSpec((d,), ("embed",), "zeros")
    heads = ParamSpec((n, h), ("heads", "head_dim"), "zeros")
    block = {"attn_norm": ones, "attn_norm_bias": zeros,
             **{f"w{c}": dense((d, n, h), ("embed", "heads", "head_dim"), d) for c in "qkv"},
             **{f"b{c}": heads for c in "qkv"},
             "wo": dense((n, h, d), ("heads", "head_dim", "embed"), d), "bo": zeros,
             "mlp_norm": ones, "mlp_norm_bias": zeros,
             "w_in": dense((d, f), ("embed", "mlp"), d), "b_in": ParamSpec((f,), ("mlp",), "zeros"),
             "w_out": dense((f, d), ("mlp", "embed"), f), "b_out": zeros}
    return {"patch_embed": dense((patch, d), (None, "embed"), patch),
            "class_embedding": ParamSpec((d,), ("embed",), "normal", d**-0.5),
            "pos_embed": ParamSpec((config.side**2 + 1, d), (None, "embed"), "normal", d**-0.5),
            "pre_norm": ones, "pre_norm_bias": zeros, "post_norm": ones, "post_norm_bias": zeros,
            "blocks": stacked(block, config.num_hidden_layers),
            "adapter": {"w_in": dense((f, p), (None, "mlp"), f), "w_out": dense((p, p), ("mlp", None), p)},
            "projector": dense((p, e), (None, "embed"), p)}


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def rotary(config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [1, s^2 + 1, H/2] float32: pair i < H/4 turns by (column + 1) f_i, pair H/4 + i by (row + 1) f_i,
    f_i = theta ** (-2i / (H/2)); the class token (last) by 0."""
    half, side = config.head_dim // 2, config.side
    freq = np.float32(1) / np.float32(config.rope_theta) ** (np.arange(0, half, 2, dtype=np.float32)
                                                             / np.float32(half))
    index = np.arange(side * side)
    angles = np.concatenate([((index % side) + 1)[:, None] * freq, ((index // side) + 1)[:, None] * freq], axis=-1)
    angles = np.concatenate([angles, np.zeros((1, half))]).astype(np.float32)
    return np.cos(angles)[None], np.sin(angles)[None]


def _linear(x, w, b=None, n: int = 1):
    """x [..., K1..Kn] . w [K1..Kn, ...] (+ b), accumulated in float32, in x's dtype."""
    out = jnp.tensordot(x, w.astype(x.dtype), axes=n, preferred_element_type=jnp.float32)
    return (out if b is None else out + b.astype(jnp.float32)).astype(x.dtype)


def _gelu(x):
    return jax.nn.gelu(x, approximate=False)


def block(x, p, cos, sin):
    """One encoder layer on x [tiles, s^2 + 1, D]: pre-LayerNorm attention over each tile's tokens (the paired
    2-D rotary on q and k) and MLP, each with its residual."""
    h = layer_norm(x, p["attn_norm"], p["attn_norm_bias"], LAYER_NORM_EPS)
    q, k, v = (_linear(h, p[f"w{c}"], p[f"b{c}"]) for c in "qkv")                    # [tiles, S, N, H]
    q, k = rope.apply_interleaved(q, cos, sin), rope.apply_interleaved(k, cos, sin)
    out = attention.dot_product_attention(q, k, v, jnp.ones((1, 1, 1), bool))
    x = x + _linear(out, p["wo"], p["bo"], 2)
    h = _linear(layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], LAYER_NORM_EPS), p["w_in"], p["b_in"])
    return x + _linear(_gelu(h), p["w_out"], p["b_out"])


def pixel_shuffle(x, config: VisionConfig):
    """[tiles, s^2, D] -> [tiles, (s/k)^2, D k^2]: the token of block (i, j) holds the patches (ki + b, kj + a),
    b the slower and a the faster, side by side (transformers' pixel_shuffle, its two transposes undone)."""
    s, k = config.side, config.shuffle
    x = x.reshape(x.shape[0], s // k, k, s // k, k, x.shape[-1]).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(x.shape[0], (s // k) ** 2, -1)


def patches(pixel_values, config: VisionConfig):
    """[tiles, C, S, S] -> [tiles, s^2, C*p*p]: each patch's pixels channel-major (torch's Unfold), row-major."""
    t, c, s, p = pixel_values.shape[0], config.num_channels, config.side, config.patch_size
    x = pixel_values.reshape(t, c, s, p, s, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(t, s * s, c * p * p)


def encode(params, pixel_values, config: VisionConfig, dtype=jnp.float32, remat: bool = False):
    """The encoder and adapter: [tiles, tokens_per_tile, vision_output_dim] from pixel_values [tiles, C, S, S]
    (transformers' get_image_features(...).last_hidden_state). Matmuls in `dtype`, norms, RoPE and softmax in
    float32. remat: each block recomputed in the backward pass (one block's activations held, not every block's)."""
    expected = (config.num_channels, config.image_size, config.image_size)
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)} are not tiles [tiles, "
                         f"{', '.join(map(str, expected))}] (the vision config's num_channels and image_size; "
                         "data/images_llama4.py makes them)")
    x = _linear(patches(pixel_values.astype(dtype), config), params["patch_embed"])
    cls = jnp.broadcast_to(params["class_embedding"].astype(dtype), (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([x, cls], axis=1) + params["pos_embed"].astype(dtype)
    x = layer_norm(x, params["pre_norm"], params["pre_norm_bias"], LAYER_NORM_EPS)
    cos, sin = (jnp.asarray(a) for a in rotary(config))

    def body(h, p):
        return block(h, p, cos, sin), None
    x = jax.lax.scan(jax.checkpoint(body) if remat else body, x, params["blocks"])[0]
    x = layer_norm(x, params["post_norm"], params["post_norm_bias"], LAYER_NORM_EPS)[:, :-1]
    x = pixel_shuffle(x, config)
    return _gelu(_linear(_gelu(_linear(x, params["adapter"]["w_in"])), params["adapter"]["w_out"]))


def forward(params, pixel_values, config: VisionConfig, dtype=jnp.float32, remat: bool = False):
    """[tiles * tokens_per_tile, text_hidden_size]: the embeddings of an image's patch tokens, tile after tile
    (the order of the tiles' `<|patch|>` runs in the prompt), from pixel_values [tiles, C, S, S]. remat: as encode."""
    x = encode(params, pixel_values, config, dtype, remat)
    return _linear(x.reshape(-1, x.shape[-1]), params["projector"])


def flops(config: VisionConfig, patches: int) -> dict:
    """The forward pass's matmul FLOPs for one image of `patches` patches (its tiles' and thumbnail's: a multiple of
    the side^2 patches of a tile), by part: {"tower": per tile, the patch embedding, the blocks over the tile's
    patches and class token (q, k, v, the attention's scores and values, the output, the MLP) and the adapter,
    "projector": the projector into the text model's width, "projector_entry": the same (one matmul: its input's
    gradient serves the tower alone)}. Norms, RoPE and softmax are not counted."""
    per_tile = config.side**2
    if patches % per_tile:
        raise ValueError(f"{patches} patches are not whole tiles of {per_tile} patches ({config.side}^2)")
    tiles, seq = patches // per_tile, per_tile + 1
    d, f, p = config.hidden_size, config.intermediate_size, config.vision_output_dim
    tokens = tiles * config.tokens_per_tile
    block = 2 * seq * (4 * d * d + 2 * d * f) + 4 * seq * seq * d
    tower = tiles * (2 * per_tile * config.num_channels * config.patch_size**2 * d + config.num_hidden_layers * block)
    projector = 2 * tokens * p * config.text_hidden_size
    return {"tower": tower + 2 * tokens * (f * p + p * p), "projector": projector, "projector_entry": projector}


# --------------------------------------------------------------------------------------------
# Hugging Face names
# --------------------------------------------------------------------------------------------


def hf_names(config: VisionConfig) -> dict:  # pylint: disable=unused-argument
    """Each parameter path -> (part: 0 the tower, 1 the projector; transformers' tensor name under that part's
    prefix; Layout); "{i}" is a layer's index along the stacked parameter's first axis."""
    names = {"patch_embed": (0, "patch_embedding.linear.weight", Linear(1)),
             "class_embedding": (0, "class_embedding", SAME), "pos_embed": (0, "positional_embedding_vlm", SAME),
             "pre_norm": (0, "layernorm_pre.weight", SAME), "pre_norm_bias": (0, "layernorm_pre.bias", SAME),
             "post_norm": (0, "layernorm_post.weight", SAME), "post_norm_bias": (0, "layernorm_post.bias", SAME),
             "adapter/w_in": (0, "vision_adapter.mlp.fc1.weight", Linear(1)),
             "adapter/w_out": (0, "vision_adapter.mlp.fc2.weight", Linear(1)),
             "projector": (1, "linear_1.weight", Linear(1))}
    block = {"attn_norm": ("input_layernorm.weight", SAME), "attn_norm_bias": ("input_layernorm.bias", SAME),
             **{f"w{c}": (f"self_attn.{c}_proj.weight", Linear(1)) for c in "qkv"},
             **{f"b{c}": (f"self_attn.{c}_proj.bias", FLAT) for c in "qkv"},
             "wo": ("self_attn.o_proj.weight", Linear(2)), "bo": ("self_attn.o_proj.bias", SAME),
             "mlp_norm": ("post_attention_layernorm.weight", SAME),
             "mlp_norm_bias": ("post_attention_layernorm.bias", SAME),
             "w_in": ("mlp.fc1.weight", Linear(1)), "b_in": ("mlp.fc1.bias", SAME),
             "w_out": ("mlp.fc2.weight", Linear(1)), "b_out": ("mlp.fc2.bias", SAME)}
    names.update({f"blocks/{k}": (0, f"model.layers.{{i}}.{v}", layout) for k, (v, layout) in block.items()})
    return names


def _names(config: VisionConfig, prefixes: tuple[str, str]) -> dict:
    """hf_names with each name under its part's prefix (tower, projector)."""
    return {key: (prefixes[part] + name, layout) for key, (part, name, layout) in hf_names(config).items()}


def to_maxtrain(tensors: dict, config: VisionConfig, prefixes: tuple[str, str] = RELEASED,
                dtype=np.float32) -> dict:
    """The params (nested dict of numpy arrays) from the tensors named under `prefixes` (tower, projector);
    tensors outside them are left alone, one inside them that has no place here is refused."""
    return hf_tensors.read(tensors, param_specs(config), _names(config, prefixes), tuple(prefixes),
                           "the Llama 4 vision encoder", dtype=dtype)


def to_hf(params: dict, config: VisionConfig, prefixes: tuple[str, str] = RELEASED,
          dtype=np.float32) -> dict:
    """transformers' tensors (numpy, under `prefixes`: tower, projector) from the params."""
    return hf_tensors.write(params, param_specs(config), _names(config, prefixes), "the Llama 4 vision encoder",
                            dtype)
