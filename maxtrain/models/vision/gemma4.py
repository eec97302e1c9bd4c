"""The vision encoder of Gemma 4 (Google 2026) and the projector that maps its soft tokens into the text model.

The processor (data/images.py `gemma4`) resizes an image to h x w patches of p x p pixels, multiples of the
pooling kernel k, and pads each image to the same M = max_soft_tokens * k^2 rows:

    pixel_values  [B, M, p*p*3]  each patch's pixels in [0, 1], row by row, a pixel's 3 channels together;
                                 padding rows are 0
    position_ids  [B, M, 2]      each patch's (column, row); (-1, -1) marks a padding row

    x      = (2 pixels - 1) . W_patch + table[0][column] + table[1][row]    (no bias; padding rows get no
                                                                           position)
    block  x = x + RMS(o(attn(rope2d(RMS_h(q)), rope2d(RMS_h(k)), RMS_h'(v))))   sandwich norms around each
           x = x + RMS(down(act(gate(RMS(x))) * up(RMS(x))))                 branch; attention bidirectional over
           an image's real patches (padding keys hidden), scale 1 (the q and k norms take its place); v is normed
           without a scale; rope2d rotates the first half of each head by the column and the second half by the
           row, each in the rotate-half layout at inv_freq[i] = theta ** (-4i / H)
    pool   the mean of each k x k window of patches (padding rows count as zeros), times sqrt(D), in float32;
           soft token j of an image of w columns is the window (j mod w/k, j div w/k), so its h*w/k^2 real
           tokens come first among the M/k^2
    std    (standardize) (x - std_bias) * std_scale
    embed  RMS without scale over D, then W_proj [D, text hidden size] (no bias): Gemma4Model's embed_vision

forward(params, pixel_values, position_ids, config) -> (embeddings [B, M/k^2, T], valid [B, M/k^2]): the rows
where `valid` holds, image by image, are exactly what transformers' Gemma4Model.get_image_features returns and
scatters, unchanged (neither scaled nor normed again), over the image placeholder tokens' embeddings. Everything
is computed from the arrays in jit (their values, not their shapes, vary with the images), so same-shaped batches
share one compilation. With use_clipped_linears every projection of the blocks clamps its input and output to
bounds read from the checkpoint (buffers in transformers; fixed here: no gradient reaches them, nor the
standardize bias and scale).

One difference, where transformers looks wrong: with pooling_kernel_size 1 its pooler skips the pooling and hands
back the padding flags where the pooled path hands back the valid ones, so its tokens would be the padding rows;
`valid` here marks the real patches for every k (the released models pool 3 x 3).

Hugging Face names: `hf_names(config)` maps each parameter path to (tensor name under the model's prefix,
layout); the tower lives under vision_tower., the projector under embed_vision.; PREFIXES gives the model's prefix
per transformers class. `to_maxtrain` and `to_hf` convert a state dict both ways.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import attention, rope
from maxtrain.models.hf import SAME, ConversionError, Linear, Same
from maxtrain.models.params import ParamSpec, dense, stacked
from maxtrain.models.vision import hf_tensors
from maxtrain.models.vision.qwen import ACTIVATIONS

# Where the tower and the projector sit in each transformers class' state dict: PREFIXES[cls] + TOWER or PROJECTOR.
TOWER, PROJECTOR = "vision_tower.", "embed_vision."
PREFIXES = {"Gemma4ForConditionalGeneration": "model.", "Gemma4Model": ""}

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The encoder's sizes under the names of transformers' Gemma4VisionConfig (config.json's vision_config), and
    text_hidden_size: the text model's width (text_config.hidden_size), the projector's output."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0
    text_hidden_size: int = 1536

    def __post_init__(self):
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 (2-D rotary: half of each head per "
                             "axis, rotated by halves)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation={self.hidden_activation!r} is not one of {', '.join(ACTIVATIONS)}")

    @property
    def patch_dim(self) -> int:
        """p * p * 3: the width of one row of pixel_values."""
        return 3 * self.patch_size ** 2

    @classmethod
    def from_hf(cls, config: dict) -> VisionConfig:
        """From a Gemma 4 config.json (its vision_config and text_config.hidden_size); an omitted field takes
        transformers' default."""
        vision, text = config.get("vision_config"), config.get("text_config") or {}
        if not vision:
            raise ConversionError("the config has no vision_config: the checkpoint has no vision encoder")
        if "text_hidden_size" in vision:
            raise ConversionError("vision_config.text_hidden_size is not a Gemma 4 field (the projector's width is "
                                  "text_config.hidden_size)")
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "text_hidden_size"}
        keys = {k: vision[k] for k in fields if vision.get(k) is not None}
        rope_parameters = vision.get("rope_parameters") or {}
        if rope_parameters.get("rope_type", "axial") not in ("axial", "default"):  # transformers reads default as axial
            raise ConversionError(f"vision_config.rope_parameters={rope_parameters}: Gemma 4's vision RoPE is axial "
                                  "(transformers refuses any other)")
        if vision.get("output_proj_dims") is not None:
            raise ConversionError(f"vision_config.output_proj_dims={vision['output_proj_dims']}: maxtrain's Gemma 4 "
                                  "projector reads the encoder's hidden_size")
        try:
            return cls(**keys, rope_theta=float(rope_parameters.get("rope_theta", 100.0)),
                       text_hidden_size=int(text.get("hidden_size", cls.text_hidden_size)))
        except ValueError as e:
            raise ConversionError(f"vision_config: {e}") from None

    def to_hf(self) -> dict:
        """config.json's vision_config (text_hidden_size belongs to text_config.hidden_size)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rope_theta", "text_hidden_size")}
        return {**out, "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def param_specs(config: VisionConfig) -> dict:
    """D the encoder's width, N query and G key/value heads of H, F its MLP, S position_embedding_size, T the text
    model's width. patch_embed [p*p*3, D], pos_embed [2, S, D] (columns' table, rows' table); blocks, stacked over
    `layers`: four RMSNorm scales [D], wq [D, N, H], wk and wv [D, G, H], q_norm and k_norm [H], wo [N, H, D],
    w_gate and w_up [D, F], w_down [F, D], with use_clipped_linears `clip`: each projection's four bounds
    (scalars, fixed; a fresh init clips nothing: the dtype's extremes, until a checkpoint sets them); with
    standardize std_bias and std_scale [D] (fixed); projection [D, T]. RMSNorm scales multiply as they are (x * scale, not 1 + scale)."""
    d, n, g, h, f = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                     config.intermediate_size)
    norm = ParamSpec((d,), ("embed",), "ones")
    block = {"attn_norm": norm, "post_attn_norm": norm, "mlp_norm": norm, "post_mlp_norm": norm,
             "wq": dense((d, n, h), ("embed", "heads", "head_dim"), d),
             "wk": dense((d, g, h), ("embed", "kv_heads", "head_dim"), d),
             "wv": dense((d, g, h), ("embed", "kv_heads", "head_dim"), d),
             "wo": dense((n, h, d), ("heads", "head_dim", "embed"), n * h),
             "q_norm": ParamSpec((h,), ("head_dim",), "ones"), "k_norm": ParamSpec((h,), ("head_dim",), "ones"),
             "w_gate": dense((d, f), ("embed", "mlp"), d), "w_up": dense((d, f), ("embed", "mlp"), d),
             "w_down": dense((f, d), ("mlp", "embed"), f)}
    if config.use_clipped_linears:
        block["clip"] = {name: {b: ParamSpec((), (), "lowest" if b.endswith("min") else "highest", fixed=True)
                                for b in BOUNDS} for name in LINEARS}
    specs = {"patch_embed": dense((config.patch_dim, d), (None, "embed"), config.patch_dim),
             "pos_embed": ParamSpec((2, config.position_embedding_size, d), (None, None, "embed"), "normal", 0.02),
             "blocks": stacked(block, config.num_hidden_layers),
             "projection": dense((d, config.text_hidden_size), (None, "embed"), d)}
    if config.standardize:
        specs["std_bias"] = ParamSpec((d,), ("embed",), "zeros", fixed=True)
        specs["std_scale"] = ParamSpec((d,), ("embed",), "ones", fixed=True)
    return specs


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def rms_norm(x, scale, eps: float):
    """x / sqrt(mean(x^2) + eps) (* scale) over the last axis, in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (out if scale is None else out * scale.astype(jnp.float32)).astype(x.dtype)


def _linear(x, w, clip=None, n: int = 1):
    """x [..., K1..Kn] . w [K1..Kn, ...] accumulated in float32, in x's dtype; with `clip` (the four bounds) the
    input and the output are clamped as transformers' Gemma4ClippableLinear does."""
    if clip is not None:
        clip = jax.tree.map(jax.lax.stop_gradient, clip)
        x = jnp.clip(x, clip["input_min"].astype(x.dtype), clip["input_max"].astype(x.dtype))
    out = jnp.tensordot(x, w.astype(x.dtype), axes=n, preferred_element_type=jnp.float32).astype(x.dtype)
    if clip is not None:
        out = jnp.clip(out, clip["output_min"].astype(x.dtype), clip["output_max"].astype(x.dtype))
    return out


def rotary(position_ids, config: VisionConfig):
    """(cos, sin) [B, M, 2, H/4] float32 of the 2-D rotary: axis 0 the column's angles, axis 1 the row's, at
    inv_freq[i] = theta ** (-2i / (H/2)); padding rows (-1, -1) rotate by -1 as in transformers (they are hidden
    from every query and dropped by the pooling)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
    angles = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def _rope2d(x, cos, sin):
    """x [B, M, heads, H]: the first half of each head rotated by the columns' angles, the second by the rows'."""
    half = x.shape[-1] // 2
    return jnp.concatenate([rope.apply(x[..., :half], cos[:, :, 0], sin[:, :, 0]),
                            rope.apply(x[..., half:], cos[:, :, 1], sin[:, :, 1])], axis=-1)


def block(x, p, cos, sin, mask, config: VisionConfig):
    """One encoder layer on x [B, M, D]; mask [B, 1, M] hides the padding keys."""
    clip, eps = p.get("clip", {}), config.rms_norm_eps
    h = rms_norm(x, p["attn_norm"], eps)
    q = rms_norm(_linear(h, p["wq"], clip.get("q_proj")), p["q_norm"], eps)                 # [B, M, N, H]
    k = rms_norm(_linear(h, p["wk"], clip.get("k_proj")), p["k_norm"], eps)                 # [B, M, G, H]
    v = rms_norm(_linear(h, p["wv"], clip.get("v_proj")), None, eps)
    q, k = _rope2d(q, cos, sin), _rope2d(k, cos, sin)
    out = attention.dot_product_attention(q, k, v, mask, scale=1.0)
    x = x + rms_norm(_linear(out, p["wo"], clip.get("o_proj"), 2), p["post_attn_norm"], eps)
    h = rms_norm(x, p["mlp_norm"], eps)
    h = ACTIVATIONS[config.hidden_activation](_linear(h, p["w_gate"], clip.get("gate_proj"))) \
        * _linear(h, p["w_up"], clip.get("up_proj"))
    return x + rms_norm(_linear(h, p["w_down"], clip.get("down_proj")), p["post_mlp_norm"], eps)


def pool(x, position_ids, padding, k: int):
    """(soft tokens [B, M/k^2, D] float32, valid [B, M/k^2]): the mean of each k x k window of x [B, M, D]
    (padding rows as zeros), window index (column div k) + (w div k) (row div k) with w an image's columns. As
    transformers, a padding row counts at window 0 (adding zero) and a token is valid where some row falls in it."""
    length = x.shape[1] // k ** 2
    positions = jnp.maximum(position_ids, 0)
    columns = jnp.max(positions[..., 0], axis=-1, keepdims=True) + 1
    window = positions[..., 0] // k + (columns // k) * (positions[..., 1] // k)           # [B, M]
    weights = jax.nn.one_hot(window, length, dtype=jnp.float32)                         # [B, M, L]
    x = jnp.where(padding[..., None], 0.0, x.astype(jnp.float32))
    pooled = jnp.einsum("bml,bmd->bld", weights / k ** 2, x, precision=jax.lax.Precision.HIGHEST)
    return pooled, jnp.any(weights > 0, axis=1)


def _fixed(a):
    return jax.lax.stop_gradient(a).astype(jnp.float32)


def forward(params, pixel_values, position_ids, config: VisionConfig, dtype=jnp.float32, remat: bool = False):
    """(embeddings [B, M/k^2, text_hidden_size], valid [B, M/k^2] bool) from pixel_values [B, M, p*p*3] and
    position_ids [B, M, 2] (column, row; -1 for padding), M a multiple of k^2. The valid rows, image by image, are
    the soft tokens that replace the image's placeholders. Matmuls in `dtype`; norms, RoPE, softmax, the pooling
    and the standardization in float32. remat: each block recomputed in the backward pass, so the tower holds one
    block's activations (its [B, heads, M, M] attention weights) instead of every block's."""
    b, m = pixel_values.shape[:2]
    k = config.pooling_kernel_size
    if pixel_values.shape != (b, m, config.patch_dim) or position_ids.shape != (b, m, 2):
        raise ValueError(f"pixel_values {pixel_values.shape} and position_ids {position_ids.shape} must be "
                         f"[images, patches, {config.patch_dim}] and [images, patches, 2]")
    if m % k ** 2:
        raise ValueError(f"{m} patches per image are not a whole number of {k}x{k} pooling windows; pad each image "
                         f"to max_soft_tokens * {k ** 2} patches as the processor does")
    padding = jnp.all(position_ids == -1, axis=-1)                                      # [B, M]
    x = _linear((2 * (pixel_values.astype(jnp.float32) - 0.5)).astype(dtype), params["patch_embed"])
    positions = jnp.maximum(position_ids, 0)
    table = params["pos_embed"].astype(jnp.float32)
    embedded = table[0][positions[..., 0]] + table[1][positions[..., 1]]
    x = x + jnp.where(padding[..., None], 0.0, embedded).astype(dtype)
    cos, sin = rotary(position_ids, config)
    mask = ~padding[:, None, :]

    def body(h, p):
        return block(h, p, cos, sin, mask, config), None
    x = jax.lax.scan(jax.checkpoint(body) if remat else body, x, params["blocks"])[0]
    tokens, valid = pool(x, position_ids, padding, k)
    tokens = tokens.astype(dtype).astype(jnp.float32) * np.float32(config.hidden_size ** 0.5)  # as transformers
    if config.standardize:
        tokens = (tokens - _fixed(params["std_bias"])) * _fixed(params["std_scale"])
    tokens = rms_norm(tokens.astype(dtype), None, config.rms_norm_eps)
    return _linear(tokens, params["projection"]), valid


def soft_tokens(position_ids, config: VisionConfig) -> np.ndarray:
    """[B] int: each image's soft tokens (its real patches / k^2), on the host from the processor's positions."""
    real = np.all(np.asarray(position_ids) != -1, axis=-1).sum(-1)
    return real // config.pooling_kernel_size ** 2


def flops(config: VisionConfig, patches: int) -> dict:
    """The forward pass's matmul FLOPs for one image of `patches` patches (the processor's padded max_patches: the
    encoder computes the padding rows too), by part: {"tower": the patch embedding, the blocks (q, k, v, the
    attention's scores and values, the output, the gated MLP) and the pooling's k x k averages (a matmul as
    computed), "projector": the projection of the soft tokens, "projector_entry": the same (one matmul after an
    unscaled norm: its input's gradient serves the tower alone)}. Norms, RoPE and softmax are not counted."""
    d, f, h = config.hidden_size, config.intermediate_size, config.head_dim
    n, g = config.num_attention_heads, config.num_key_value_heads
    soft = patches // config.pooling_kernel_size**2
    block = 2 * patches * (d * n * h + 2 * d * g * h + n * h * d + 3 * d * f) + 4 * patches * patches * n * h
    tower = 2 * patches * config.patch_dim * d + config.num_hidden_layers * block + 2 * patches * soft * d
    projector = 2 * soft * d * config.text_hidden_size
    return {"tower": tower, "projector": projector, "projector_entry": projector}


# --------------------------------------------------------------------------------------------
# Hugging Face names
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scalar(Same):
    """A 0-d tensor on both sides (a clipping bound of one layer)."""

    def export(self, w: np.ndarray, out: dict, name: str, dtype) -> None:
        out[name] = np.asarray(w, dtype=dtype).reshape(())


def hf_names(config: VisionConfig) -> dict:
    """Each parameter path -> (transformers' tensor name under the model's prefix, Layout); "{i}" is a layer's
    index along the stacked parameter's first axis."""
    names = {"patch_embed": (TOWER + "patch_embedder.input_proj.weight", Linear(1)),
             "pos_embed": (TOWER + "patch_embedder.position_embedding_table", SAME),
             "projection": (PROJECTOR + "embedding_projection.weight", Linear(1))}
    layer = TOWER + "encoder.layers.{i}."
    block = {"attn_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
             "mlp_norm": "pre_feedforward_layernorm.weight", "post_mlp_norm": "post_feedforward_layernorm.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
    names.update({f"blocks/{k}": (layer + v, SAME) for k, v in block.items()})
    projections = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                   "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                   "w_down": "mlp.down_proj"}
    names.update({f"blocks/{k}": (f"{layer}{v}.linear.weight", Linear(2 if k == "wo" else 1))
                  for k, v in projections.items()})
    if config.use_clipped_linears:
        for v in projections.values():
            names.update({f"blocks/clip/{v.split('.')[1]}/{b}": (f"{layer}{v}.{b}", Scalar()) for b in BOUNDS})
    if config.standardize:
        names.update({"std_bias": (TOWER + "std_bias", SAME), "std_scale": (TOWER + "std_scale", SAME)})
    return names


def _names(config: VisionConfig, prefix: str) -> dict:
    """hf_names with each name under prefix (TOWER's and PROJECTOR's parts already in it)."""
    return {key: (prefix + name, layout) for key, (name, layout) in hf_names(config).items()}


def to_maxtrain(tensors: dict, config: VisionConfig, prefix: str = "model.", dtype=np.float32) -> dict:
    """The encoder's and projector's params (nested dict of numpy arrays) from the tensors under prefix + TOWER
    and prefix + PROJECTOR (PREFIXES); other tensors are left alone, one there with no place here is refused."""
    return hf_tensors.read(tensors, param_specs(config), _names(config, prefix), (prefix + TOWER, prefix + PROJECTOR),
                           "the vision encoder", "use_clipped_linears, standardize, num_hidden_layers", dtype)


def to_hf(params: dict, config: VisionConfig, prefix: str = "model.", dtype=np.float32) -> dict:
    """transformers' tensors (numpy, under prefix + TOWER and prefix + PROJECTOR) from the params."""
    return hf_tensors.write(params, param_specs(config), _names(config, prefix), "the vision encoder", dtype)
