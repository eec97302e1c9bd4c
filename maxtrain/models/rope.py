"""Rotary position embeddings and their frequency-scaling variants.

RoPE rotates each pair (x_i, x_{i + H/2}) of a query or key by the angle position * inv_freq[i]
("rotate half" layout, as Hugging Face stores Llama-family weights):

    default  inv_freq[i] = theta ** (-2i / H)
    linear   inv_freq / factor                                  (position interpolation)
    llama3   long wavelengths (> original_max_position_embeddings / low_freq_factor) divided by
             factor, short ones (< .../ high_freq_factor) kept, a smooth blend between (Llama 3.1)
    yarn     per-frequency blend of interpolation (inv_freq / factor) and extrapolation (inv_freq)
             over the band set by beta_fast and beta_slow, and cos/sin multiplied by an attention
             factor (0.1 ln(factor) + 1 unless given)
    proportional  the first floor(proportion x H / 2) pairs rotate at the default frequencies of the
             whole head (theta ** (-2i / H), not of the rotated part), the rest have frequency 0 (they
             pass unrotated); all divided by factor (Gemma 4's global layers: proportion 0.25)

The frequencies are computed once on the host (float64, then float32), the angles per step in float32.

On CPU the training and evaluation forward reads cos and sin from a table of the positions [0, T) built
on the host when the step is traced (`table_positions`). Computed in the step instead, XLA:CPU fuses them
into every RoPE application it feeds (q and k of each layer, forward and backward) and evaluates a scalar
sincos per element of each: 16 fusions and 3.5% of the reference configuration's step in
docs/performance.md. Accelerators keep computing them (cheap there; a gather is not).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclasses.dataclass(frozen=True)
class Rope:
    """The static settings of one RoPE (a model may use two: Gemma 3's global and local layers)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn: the context the model was pre-trained at
    beta_fast: float = 32.0               # yarn
    beta_slow: float = 1.0                # yarn
    attention_factor: float = -1.0        # yarn: multiplies cos and sin; -1 = 0.1 ln(factor) + 1
    truncate: bool = True                 # yarn: round the correction band to whole dimensions
    proportion: float = 1.0               # proportional: the fraction of the head's frequency pairs that rotate

    @classmethod
    def from_config(cls, config, local: bool = False) -> "Rope":
        """The global RoPE of `config`, or (local=True) the one of its sliding-window layers: the default
        type at `local_rope_max_timescale` when that is set (Gemma 3), else the global one."""
        if local and config.local_rope_max_timescale > 0:
            return cls(theta=config.local_rope_max_timescale)
        return cls(theta=config.rope_max_timescale, type=config.rope_type, factor=config.rope_factor,
                   low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                   original_max_position_embeddings=config.original_max_position_embeddings,
                   beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                   attention_factor=config.rope_attention_factor, truncate=config.rope_truncate,
                   proportion=config.rope_proportion)


def inv_freq(rope: Rope, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [H/2] float32, the factor cos and sin are multiplied by)."""
    base = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope.type == "default":
        return base.astype(np.float32), 1.0
    if rope.type == "linear":
        return (base / rope.factor).astype(np.float32), 1.0
    if rope.type == "llama3":
        return _llama3(base, rope).astype(np.float32), 1.0
    if rope.type == "yarn":
        return _yarn(base, rope, head_dim)
    if rope.type == "proportional":
        rotated = int(rope.proportion * head_dim // 2)
        return (np.where(np.arange(head_dim // 2) < rotated, base, 0.0) / rope.factor).astype(np.float32), 1.0
    raise ValueError(f"rope_type={rope.type!r} is not one of {', '.join(ROPE_TYPES)}")


def _llama3(base: np.ndarray, rope: Rope) -> np.ndarray:
    wavelength = 2 * math.pi / base
    context = rope.original_max_position_embeddings
    long = wavelength > context / rope.low_freq_factor
    short = wavelength < context / rope.high_freq_factor
    # equal factors (Llama 4 Scout: 1 and 1) leave no band between long and short: nothing is blended
    band = max(rope.high_freq_factor - rope.low_freq_factor, 1e-12)
    smooth = (context / wavelength - rope.low_freq_factor) / band
    blended = (1 - smooth) * base / rope.factor + smooth * base
    return np.where(long, base / rope.factor, np.where(short, base, blended))


def _yarn(base: np.ndarray, rope: Rope, head_dim: int) -> tuple[np.ndarray, float]:
    def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in the original context
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # 1: keep the original frequency, 0: interpolate it
    freq = base / rope.factor * (1 - extrapolated) + base * extrapolated
    factor = rope.attention_factor
    if factor < 0:
        factor = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return freq.astype(np.float32), float(factor)


# The largest host table (bytes of cos and sin) `table_positions` allows: 4 MiB is T = 8192 at head_dim 128.
TABLE_BYTES_MAX = 4 * 2**20


def table_positions(length: int, head_dim: int, backend: str) -> int | None:
    """How many positions `tables` should read from a host table for sequences of `length` tokens (each
    position of a row lies in [0, length), as every maxtrain data source makes them), or None to compute."""
    return length if backend == "cpu" and length * head_dim * 4 <= TABLE_BYTES_MAX else None


def tables(positions, rope: Rope, head_dim: int, num_positions: int | None = None):
    """(cos, sin), each [B, T, H/2] float32, for integer positions [B, T].

    With num_positions, cos and sin are read from a table of the positions [0, num_positions), computed
    with numpy in float32 as the step would (agreeing with it to 1 ulp); a position outside the table
    reads NaN, so a bound that does not hold cannot pass silently. Without it they are computed here."""
    freq, factor = inv_freq(rope, head_dim)
    if num_positions is not None:
        angles = np.arange(num_positions, dtype=np.float32)[:, None] * freq  # float32, as below
        table = jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], axis=-1))  # [P, H]
        cos, sin = jnp.split(jnp.take(table, positions, axis=0, mode="fill", fill_value=np.nan), 2, axis=-1)
    else:
        angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(freq)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply(x, cos, sin):
    """Rotates x [B, T, heads, H] by the angles of (cos, sin) [B, T, R/2]; computed in float32. With R < H
    (partial RoPE: GLM-4.5, Qwen3-Next) the leading R features rotate and the rest pass unchanged."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([apply(x[..., :rotated], cos, sin), x[..., rotated:]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_interleaved(x, cos, sin):
    """RoPE on the interleaved pairs (x_0, x_1), (x_2, x_3), ... of the leading R = 2 x cos.shape[-1] features of x
    [B, T, heads, H] (DeepSeek's MLA checkpoints, GLM-5's indexer): they are taken apart, evens then odds, and rotated
    by halves, so the rotated features come out in that order, the same on queries and keys, and q . k is the
    interleaved rotation's. The features after R pass unchanged."""
    r = 2 * cos.shape[-1]
    return apply(jnp.concatenate([x[..., 0:r:2], x[..., 1:r:2], x[..., r:]], axis=-1), cos, sin)


def named_tables(positions, config, widths: dict[str, int], num_positions: int | None = None) -> dict:
    """cos/sin tables {name: (cos, sin)} of each RoPE the layers use (`widths`: models/decoder.rope_widths),
    computed once per pass (num_positions: read from a host table, `tables`). "local" is Gemma 3's local-frequency
    RoPE; a table equal to another is computed once."""
    made, named = {}, {}
    for name, width in widths.items():
        rope = Rope.from_config(config, local=name == "local")
        if (rope, width) not in made:
            made[(rope, width)] = tables(positions, rope, width, num_positions)
        named[name] = made[(rope, width)]
    return named
