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

from maxtrain.errors import UserError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,  # fp8 checkpoints (dequantize.py)
          "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # microscaling exponents: read so that a lone one is named
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class FormatError(UserError, ValueError):
    """A file that is not what it claims to be; the message names it and what to do."""


REDOWNLOAD = "download the model's files again (a partial download, or a file from another model?)"


def read(path: str) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file (memory-mapped, read-only)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise FormatError(f"{path} is not a safetensors file (header length {n}, file size {size}); {REDOWNLOAD}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path} is not a safetensors file (its header is not JSON: {e}); {REDOWNLOAD}") from None
        if not isinstance(header, dict):
            raise FormatError(f"{path} is not a safetensors file (its header is not a JSON object); {REDOWNLOAD}")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = _entry(path, name, info, len(data))
        out[name] = data[begin:end].view(dtype).reshape(shape)
    return out


def _entry(path: str, name: str, info, data_bytes: int) -> tuple[np.dtype, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one header entry, or a FormatError naming the file and the tensor."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise FormatError(f"{path}: the header entry of tensor {name} is {info!r}, not {{dtype, shape, data_offsets}}; "
                          f"{REDOWNLOAD}")
    if info["dtype"] not in DTYPES:
        raise FormatError(f"{path}: tensor {name} has dtype {info['dtype']!r}, which maxtrain does not read (a "
                          "quantised format?); import a copy with bfloat16 or float32 weights")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(_count(s) for s in shape)):
        raise FormatError(f"{path}: tensor {name} has shape {shape!r}, not a list of sizes >= 0; {REDOWNLOAD}")
    dtype = np.dtype(DTYPES[info["dtype"]])
    size = math.prod(shape) * dtype.itemsize
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
            and offsets[0] <= offsets[1] <= data_bytes and offsets[1] - offsets[0] == size):
        raise FormatError(f"{path}: tensor {name} has data_offsets {offsets!r}, which do not hold its shape {shape} of "
                          f"{info['dtype']} within the file's {data_bytes} data bytes (a truncated file?); "
                          f"{REDOWNLOAD}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


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
    weight_map = None
    if os.path.isfile(index):
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
        if missing:
            more = f" and {len(missing) - 1} more shards" if len(missing) > 1 else ""
            raise FormatError(f"{index} names {missing[0]}{more}, which {hf_dir} does not hold; download every shard "
                              "the index lists")
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        pickles = [n for n in sorted(os.listdir(hf_dir)) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        raise FormatError(
            f"{hf_dir} has no model.safetensors or model.safetensors.index.json"
            + (f"; it has {pickles}, which are pickle files and are never loaded (loading a pickle can run "
               "arbitrary code). Convert them to safetensors first in an environment you trust, e.g. "
               "transformers' save_pretrained(..., safe_serialization=True)." if pickles else "."))
    tensors, origins = {}, ({} if origins is None else origins)
    for name in files:
        path = os.path.join(hf_dir, name)
        for tensor, array in read(path).items():
            if tensor in tensors:
                raise FormatError(f"tensor {tensor} is in both {origins[tensor]} and {path}; {REDOWNLOAD}")
            tensors[tensor], origins[tensor] = array, path
    for tensor, name in (weight_map or {}).items():
        if origins.get(tensor) != os.path.join(hf_dir, name):
            where = origins.get(tensor)
            raise FormatError(f"{index} maps {tensor} to {name}, but " + (f"it is in {where}" if where else
                                                                          "no shard holds it")
                              + "; download the index and its shards again (from the same revision)")
    return tensors


def _weight_map(index: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file name)."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{index} is not valid JSON ({e}); re-download it") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index} has no \"weight_map\" of tensor names to files; re-download it")
    bad = next((f for f in weight_map.values() if not isinstance(f, str) or not f.endswith(".safetensors")), None)
    if bad is not None:
        raise FormatError(f"{index} maps tensors to {bad!r}, not to a .safetensors file; re-download it (only "
                          "safetensors are read)")
    return weight_map


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
