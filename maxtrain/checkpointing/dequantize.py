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

Nothing quantised is ever imported as its raw values: Dequantized refuses, before any tensor is read, a tensor
stored in a quantised dtype (float8, or an integer dtype where config.json declares a quantization_config)
without the scale it pairs with, a scale without its weight or beside a weight that is not quantised, and a
scale whose shape does not tile its weight; each message names the tensor, its file, the scale expected and
the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from maxtrain.checkpointing.safetensors_files import FormatError

FP8_SCALE_SUFFIX = "_scale_inv"              # X.weight_scale_inv scales X.weight
MXFP4_SUFFIXES = ("_blocks", "_scales")      # X_blocks and X_scales are X
# E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0_BIAS = 127
MXFP4_GROUP = 32                             # values sharing one scale (16 bytes)
# The dtypes a weight may be imported from as it is: everything else is a quantised format or not a weight.
FULL_PRECISION = tuple(np.dtype(d) for d in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))
FIX = "copy the checkpoint's files again (one may be missing or incomplete), or import a dequantized copy " \
      "(bfloat16 or float32 weights)"


def is_float8(dtype) -> bool:
    """float8 (e4m3, e5m2, ...), float6 and float4: dtypes that only quantised weights are stored in."""
    return np.dtype(dtype).name.startswith(("float8", "float6", "float4"))


def fp8_scale_shape(weight_shape: tuple, block: tuple[int, int]) -> tuple | None:
    """The shape of the block scales of a weight [..., rows, cols] in block[0] x block[1] tiles (None below 2-d)."""
    if len(weight_shape) < 2:
        return None
    rows, cols = weight_shape[-2:]
    return (*weight_shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def dequantize_fp8_blocks(weight, weight_scale_inv, block: tuple[int, int] = (128, 128), name: str = "weight"):
    """float32 [..., rows, cols]: each block[0] x block[1] tile of `weight` times its scale."""
    w, s = np.asarray(weight), np.asarray(weight_scale_inv, np.float32)
    grid = fp8_scale_shape(w.shape, block)
    if grid is None or s.shape != grid:
        raise FormatError(f"{name}{FP8_SCALE_SUFFIX} has shape {list(s.shape)}, but {name} {list(w.shape)} in "
                          f"{block[0]}x{block[1]} blocks needs {list(grid) if grid else 'a 2-d weight'}")
    cols = w.shape[-1]
    out = w.astype(np.float32)
    for i in range(grid[-2]):  # one block row at a time: no weight-sized array of scales
        tile_rows = slice(i * block[0], (i + 1) * block[0])
        scale = np.repeat(s[..., i, :], block[1], axis=-1)[..., :cols]
        out[..., tile_rows, :] *= scale[..., None, :]
    return out


def _is_mxfp4(blocks, scales) -> bool:
    """Whether blocks uint8 [..., G, 16] and scales uint8 [..., G] (their dtypes and shapes only)."""
    return (blocks.dtype == np.uint8 and scales.dtype == np.uint8 and blocks.ndim >= 2
            and blocks.shape[-1] == MXFP4_GROUP // 2 and blocks.shape[:-1] == scales.shape)


def _mxfp4_mismatch(name: str, blocks, scales) -> str:
    return (f"{name}_blocks {blocks.dtype}{list(blocks.shape)} and {name}_scales {scales.dtype}{list(scales.shape)} "
            f"are not MXFP4: blocks uint8 [..., G, {MXFP4_GROUP // 2}] and scales uint8 [..., G]")


def dequantize_mxfp4(blocks, scales, name: str = ""):
    """float32 [..., G * 32] from blocks uint8 [..., G, 16] and scales uint8 [..., G]."""
    b, s = np.asarray(blocks), np.asarray(scales)
    if not _is_mxfp4(b, s):
        raise FormatError(_mxfp4_mismatch(name, b, s))
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


def declared_method(hf_config: Mapping) -> str | None:
    """config.json's quantization_config.quant_method ("fp8", "mxfp4", "gptq", ...): "unnamed" for a
    quantization_config without one, None where the config declares no quantisation."""
    declared = hf_config.get("quantization_config")
    if not declared:
        return None
    return str(declared.get("quant_method") or "unnamed") if isinstance(declared, Mapping) else "unnamed"


def _layer_pattern(name: str) -> str:
    """The name with its layer and expert indices as "*": the same tensor in every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


class Dequantized(Mapping):
    """`tensors` with each quantised pair as one tensor (see the module docstring), dequantised when read;
    fp8 weights in `fp8_block` tiles (fp8_block(config.json)). Every quantised tensor is checked against its
    scale up front (dtypes and shapes only: nothing is read); `quantization` is config.json's
    declared_method, `origins` {tensor: its file} for the messages."""

    def __init__(self, tensors: Mapping, fp8_block: tuple[int, int] = (128, 128), quantization: str | None = None,
                 origins: Mapping | None = None):
        self.tensors, self.pairs, self.fp8_block = tensors, {}, fp8_block
        self.quantization, self.origins = quantization, origins or {}
        for name in tensors:
            if name.endswith(FP8_SCALE_SUFFIX):
                weight = name[:-len(FP8_SCALE_SUFFIX)]
                self._check_fp8_pair(weight, name)
                self.pairs[weight] = ("fp8", weight, name)
            elif name.endswith(MXFP4_SUFFIXES[0]) and (tensors[name].dtype == np.uint8 or
                                                       name[:-len(MXFP4_SUFFIXES[0])] + MXFP4_SUFFIXES[1] in tensors):
                base = name[:-len(MXFP4_SUFFIXES[0])]
                self._check_mxfp4_pair(base)
                self.pairs[base] = ("mxfp4", name, base + MXFP4_SUFFIXES[1])
            elif name.endswith(MXFP4_SUFFIXES[1]) and tensors[name].dtype == np.uint8 \
                    and name[:-len(MXFP4_SUFFIXES[1])] + MXFP4_SUFFIXES[0] not in tensors:
                base = name[:-len(MXFP4_SUFFIXES[1])]
                raise FormatError(f"{self._where(name)}: {name} (uint8) is the MXFP4 scale of {base}_blocks, which no "
                                  f"file of the checkpoint holds; {FIX}")
        used = {n for _, first, second in self.pairs.values() for n in (first, second)}
        quantised_elsewhere = {_layer_pattern(n): n for n in self.pairs}
        for name in tensors:
            if name not in used:
                self._check_unpaired(name, quantised_elsewhere.get(_layer_pattern(name)))
        if quantization and not self.pairs and not any(is_float8(t.dtype) for t in tensors.values()):
            raise FormatError(
                f"config.json declares quantization_config (quant_method={quantization}), but no tensor of the "
                "checkpoint is quantised (no float8 weights, no scales): if its weights were dequantized, remove "
                "quantization_config from config.json; if they were cast without their scales, they are off by "
                f"them: {FIX}")
        self.names = [n for n in tensors if n not in used] + list(self.pairs)
        self.name_set = set(self.names)

    def _where(self, name: str) -> str:
        return str(self.origins.get(name, "the checkpoint"))

    def file_of(self, name: str) -> str | None:
        """The file a tensor (or the first of its quantised pair) was read from, where `origins` says."""
        return self.origins.get(self.pairs[name][1] if name in self.pairs else name)

    def _check_fp8_pair(self, weight: str, scale: str) -> None:
        """X.weight_scale_inv needs X.weight in float8, which its shape tiles in fp8_block tiles."""
        if weight not in self.tensors:
            raise FormatError(f"{self._where(scale)}: {scale} is a block scale of {weight}, which no file of the "
                              f"checkpoint holds; {FIX}")
        w, s = self.tensors[weight], self.tensors[scale]
        if not is_float8(w.dtype):
            raise FormatError(f"{self._where(weight)}: {weight} is {w.dtype}, not float8, yet {scale} scales it: "
                              "scaling it again would be wrong (a dequantized copy that kept its scales?). Remove the "
                              f"{FP8_SCALE_SUFFIX} tensors of weights already dequantized, or {FIX}")
        grid = fp8_scale_shape(w.shape, self.fp8_block)
        if tuple(s.shape) != grid:
            block = "x".join(map(str, self.fp8_block))
            raise FormatError(f"{self._where(scale)}: {scale} has shape {list(s.shape)}, but {weight} "
                              f"{list(w.shape)} in {block} blocks needs "
                              f"{list(grid) if grid else 'a weight of 2 or more axes'}; set config.json's "
                              "quantization_config.weight_block_size to the checkpoint's tile (rows, columns), "
                              f"or {FIX}")

    def _check_mxfp4_pair(self, base: str) -> None:
        blocks, scales = base + MXFP4_SUFFIXES[0], base + MXFP4_SUFFIXES[1]
        if scales not in self.tensors:
            raise FormatError(f"{self._where(blocks)}: {blocks} (MXFP4) has no scales: no file of the checkpoint "
                              f"holds {scales}; {FIX}")
        if not _is_mxfp4(self.tensors[blocks], self.tensors[scales]):
            mismatch = _mxfp4_mismatch(base, self.tensors[blocks], self.tensors[scales])
            raise FormatError(f"{self._where(blocks)}: {mismatch}; {FIX}")

    def _check_unpaired(self, name: str, quantised_sibling: str | None = None) -> None:
        """A tensor with no scale must not be stored quantised: float8 always, integers where config.json
        declares quantisation (packed int4, int8, bitsandbytes' uint8); nor be one whose counterpart in the
        other layers (`quantised_sibling`) is quantised."""
        dtype = np.dtype(self.tensors[name].dtype)
        if quantised_sibling is not None:
            raise FormatError(f"{self._where(name)}: {name} is stored as {dtype} without scales, but "
                              f"{quantised_sibling} of another layer is quantised: the checkpoint says this one is "
                              f"quantised too, and read as it is its values may be off by its scale; {FIX}")
        if not is_float8(dtype) and not (dtype.kind in "iu" and self.quantization):
            return
        module = name.rsplit(".", 1)[0] + "." if "." in name else name
        others = [n for n in self.tensors if n != name and n.startswith(module)
                  and any(word in n[len(module):].lower() for word in ("scale", "zero", "absmax", "scb", "quant"))]
        declared = f" (config.json: quantization_config.quant_method={self.quantization})" if self.quantization else ""
        if others:
            raise FormatError(
                f"{self._where(name)}: {name} is stored as {dtype}{declared} with {', '.join(others[:3])}: a "
                "quantisation scheme maxtrain does not dequantise (it reads fp8 weights with 2-d block scales, "
                f"X.weight{FP8_SCALE_SUFFIX}, and MXFP4 X_blocks with X_scales); import a dequantized copy "
                "(bfloat16 or float32 weights)")
        expected = f"{name}{FP8_SCALE_SUFFIX}" if is_float8(dtype) else "a scale"
        raise FormatError(f"{self._where(name)}: {name} is stored as {dtype}{declared} but has no scale (expected "
                          f"{expected} beside it): read as it is, its values would be off by that scale; {FIX}")

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

    def quantized(self) -> dict[str, str]:
        """{name: "fp8" | "mxfp4"} of the tensors read from a quantised pair."""
        return {name: kind for name, (kind, _, _) in self.pairs.items()}

