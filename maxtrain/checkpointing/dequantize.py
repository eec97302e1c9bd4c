"""Quantised weight formats of released checkpoints, dequantised on import (numpy only).

    dequantize_fp8_blocks(weight, weight_scale_inv, block=(128, 128))
        DeepSeek-V3's fp8 weights: `weight` [..., rows, cols] (float8 e4m3) times the scale of its
        block x block tile, weight_scale_inv [..., ceil(rows / block[0]), ceil(cols / block[1])] (the
        tiles of the last block row and column are partial when the shape is not a multiple)
    dequantize_mxfp4(blocks, scales)
        gpt-oss's MXFP4 expert weights (OCP microscaling): blocks uint8 [..., G, 16] pack 32 E2M1 values
        per group, two a byte, low nibble first; scales uint8 [..., G] one E8M0 exponent per group
        (2 ** (scale - 127)); returns [..., G * 32]
    Dequantized(tensors)
        a checkpoint's tensors with every quantised pair read as one tensor under the name of the
        unquantised checkpoint, dequantised when it is read (a Mapping; nothing is computed up front):
          X.weight + X.weight_scale_inv  ->  X.weight                   (fp8 blocks of 128 x 128, or config.json's
                                                                         quantization_config.weight_block_size)
          X_blocks + X_scales            ->  X, its last two axes swapped (MXFP4: gpt-oss stores its experts
                                             [E, out, in] quantised along `in`; transformers' gate_up_proj and
                                             down_proj are [E, in, out])

Every value is exact in float32: an E2M1 value (at most 2 significant bits) times a power of two, and an
e4m3 value (4 bits) times a float32 scale rounded once.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from maxtrain.checkpointing.safetensors_files import REDOWNLOAD, FormatError

FP8_SCALE_SUFFIX = "_scale_inv"              # X.weight_scale_inv scales X.weight
MXFP4_SUFFIXES = ("_blocks", "_scales")      # X_blocks and X_scales are X
# E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0_BIAS = 127
MXFP4_GROUP = 32                             # values sharing one scale (16 bytes)


def dequantize_fp8_blocks(weight, weight_scale_inv, block: tuple[int, int] = (128, 128), name: str = "weight"):
    """float32 [..., rows, cols]: each block[0] x block[1] tile of `weight` times its scale."""
    w, s = np.asarray(weight), np.asarray(weight_scale_inv, np.float32)
    rows, cols = w.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if w.ndim < 2 or s.shape != (*w.shape[:-2], *grid):
        raise FormatError(f"{name}{FP8_SCALE_SUFFIX} has shape {list(s.shape)}, but {name} {list(w.shape)} in "
                          f"{block[0]}x{block[1]} blocks needs {[*w.shape[:-2], *grid]}; {REDOWNLOAD}")
    out = w.astype(np.float32)
    for i in range(grid[0]):  # one block row at a time: no weight-sized array of scales
        tile_rows = slice(i * block[0], (i + 1) * block[0])
        scale = np.repeat(s[..., i, :], block[1], axis=-1)[..., :cols]
        out[..., tile_rows, :] *= scale[..., None, :]
    return out


def dequantize_mxfp4(blocks, scales, name: str = ""):
    """float32 [..., G * 32] from blocks uint8 [..., G, 16] and scales uint8 [..., G]."""
    b, s = np.asarray(blocks), np.asarray(scales)
    if b.dtype != np.uint8 or s.dtype != np.uint8 or b.ndim < 2 or b.shape[-1] != MXFP4_GROUP // 2 \
            or b.shape[:-1] != s.shape:
        raise FormatError(f"{name}_blocks {b.dtype}{list(b.shape)} and {name}_scales {s.dtype}{list(s.shape)} are not "
                          f"MXFP4: blocks uint8 [..., G, {MXFP4_GROUP // 2}] and scales uint8 [..., G]; {REDOWNLOAD}")
    values = np.empty((*b.shape[:-1], MXFP4_GROUP), np.float32)
    values[..., 0::2] = E2M1_VALUES[b & 0x0F]
    values[..., 1::2] = E2M1_VALUES[b >> 4]
    values = np.ldexp(values, s.astype(np.int32)[..., None] - E8M0_BIAS, out=values)
    return values.reshape(*b.shape[:-2], b.shape[-2] * MXFP4_GROUP)


def fp8_block(hf_config: Mapping, where: str = "config.json") -> tuple[int, int]:
    """The fp8 tile of a checkpoint's config.json (`where`, for messages): quantization_config.weight_block_size
    ([128, 128] for DeepSeek-V3), (128, 128) where the config does not say."""
    quantization = hf_config.get("quantization_config") or {}
    if not isinstance(quantization, Mapping):
        raise FormatError(f"{where}: quantization_config is {quantization!r}, not an object of its fields; use the "
                          "config.json that came with the weights")
    block = quantization.get("weight_block_size")
    if block is None:
        return (128, 128)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise FormatError(f"{where}: quantization_config.weight_block_size is {block!r}; fp8 block scales need "
                          "two positive integers (rows, columns), e.g. [128, 128]")
    return (block[0], block[1])


class Dequantized(Mapping):
    """`tensors` with each quantised pair as one tensor (see the module docstring), dequantised when read;
    fp8 weights in `fp8_block` tiles (fp8_block(config.json))."""

    def __init__(self, tensors: Mapping, fp8_block: tuple[int, int] = (128, 128)):
        self.tensors, self.pairs, self.fp8_block = tensors, {}, fp8_block
        for name in tensors:
            if name.endswith(".weight" + FP8_SCALE_SUFFIX):
                weight = name[:-len(FP8_SCALE_SUFFIX)]
                if weight not in tensors:
                    raise FormatError(f"the checkpoint has {name} but no {weight}: fp8 weights come with their scales; "
                                      f"{REDOWNLOAD}")
                self.pairs[weight] = ("fp8", weight, name)
            elif name.endswith(MXFP4_SUFFIXES[1]) and name[:-len(MXFP4_SUFFIXES[1])] + MXFP4_SUFFIXES[0] in tensors:
                base = name[:-len(MXFP4_SUFFIXES[1])]
                self.pairs[base] = ("mxfp4", base + MXFP4_SUFFIXES[0], name)
        used = {n for _, first, second in self.pairs.values() for n in (first, second)}
        self.names = [n for n in tensors if n not in used] + list(self.pairs)
        self.name_set = set(self.names)

    def __getitem__(self, name: str):
        if name not in self.pairs:
            if name not in self.name_set:
                raise KeyError(name)
            return self.tensors[name]
        kind, first, second = self.pairs[name]
        if kind == "fp8":
            return dequantize_fp8_blocks(self.tensors[first], self.tensors[second], self.fp8_block, name=name)
        return np.swapaxes(dequantize_mxfp4(self.tensors[first], self.tensors[second], name=name), -1, -2)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def __contains__(self, name) -> bool:
        return name in self.name_set

    def file_of(self, name: str) -> str | None:
        """The file a tensor (or the first of its quantised pair) was read from, where the tensors say."""
        first = self.pairs[name][1] if name in self.pairs else name
        return getattr(self.tensors, "file_of", lambda _: None)(first)

    def quantized(self) -> dict[str, str]:
        """{name: "fp8" | "mxfp4"} of the tensors read from a quantised pair."""
        return {name: kind for name, (kind, _, _) in self.pairs.items()}

