"""The safetensors format, read and written with numpy (no torch, no transformers).

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
(plus "__metadata__"), then the raw little-endian tensor bytes. Only safetensors are ever read for
weights: a pickle file (pytorch_model.bin, *.pt) can run code when loaded and is never opened.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,  # fp8 checkpoints (dequantize.py)
          "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # microscaling exponents: read so that a lone one is named
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class FormatError(ValueError):
    """A file that is not what it claims to be; the message names it."""


def read(path: str) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file (memory-mapped, read-only)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise FormatError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path} is not a safetensors file (its header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise FormatError(f"{path} is not a safetensors file (its header is not a JSON object)")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise FormatError(f"{path}: tensor {name} has dtype {info['dtype']}, which maxtrain does not read (a "
                              "quantised format?); import a copy with bfloat16 or float32 weights")
        dtype = np.dtype(DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(info["shape"]) * dtype.itemsize or end > len(data):
            raise FormatError(f"{path}: tensor {name} has inconsistent offsets {info['data_offsets']}")
        out[name] = data[begin:end].view(dtype).reshape(info["shape"])
    return out


def write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def read_model_dir(hf_dir: str, origins: dict | None = None) -> dict[str, np.ndarray]:
    """The tensors of a Hugging Face model directory: model.safetensors or a sharded index. `origins`, when
    given, is filled with {tensor name: the path of its file}."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise FormatError(f"{index} is not valid JSON ({e}); re-download it") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise FormatError(f"{index} has no \"weight_map\" of tensor names to files; re-download it")
        files = sorted(set(map(str, weight_map.values())))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        pickles = [n for n in sorted(os.listdir(hf_dir)) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        raise FormatError(
            f"{hf_dir} has no model.safetensors or model.safetensors.index.json"
            + (f"; it has {pickles}, which are pickle files and are never loaded (loading a pickle can run "
               "arbitrary code). Convert them to safetensors first in an environment you trust, e.g. "
               "transformers' save_pretrained(..., safe_serialization=True)." if pickles else "."))
    tensors = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        part = read(path)
        tensors.update(part)
        if origins is not None:
            origins.update(dict.fromkeys(part, path))
    return tensors


def write_model_dir(out_dir: str, tensors: dict[str, np.ndarray], metadata: dict[str, str],
                    max_shard_bytes: int) -> None:
    """model.safetensors, or shards with model.safetensors.index.json above max_shard_bytes."""
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    if len(shards) == 1:
        write(os.path.join(out_dir, "model.safetensors"), shards[0], metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write(os.path.join(out_dir, name), shard, metadata)
        weight_map.update({t: name for t in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map},
                  f, indent=2)
