"""Hugging Face Llama-family checkpoints <-> maxtrain params (CLI: scripts/convert_hf.py).

    import_hf(hf_dir, out_dir)        config.json + model.safetensors (or a sharded
                                      model.safetensors.index.json) -> a params-only maxtrain
                                      checkpoint <out_dir>/checkpoints/0 and a model preset <out_dir>/model.yml
    export_hf(checkpoint, out_dir)    maxtrain params -> config.json + model.safetensors that
                                      transformers' LlamaForCausalLM.from_pretrained loads

Only safetensors are read: a pickle file (pytorch_model.bin, *.pt) can run code when loaded and is
never opened. The safetensors format (an 8-byte header length, a JSON header, raw little-endian
tensor bytes) is read and written here with numpy, so conversion needs neither torch nor
transformers.

The mapping is driven by `model.param_specs`: every maxtrain parameter is looked up by its path,
its Hugging Face tensor found, and the result checked against the declared shape. torch's Linear
stores weight [out, in]; maxtrain keeps [in, out...] with heads split out, e.g.
q_proj.weight [N*H, D] -> wq [D, N, H]. Both use the "rotate half" RoPE layout, so q and k need no
permutation. Layers are stacked on a leading [L] axis.
"""

from __future__ import annotations

import json
import math
import os
import types

import ml_dtypes
import numpy as np
import yaml

from maxtrain import checkpoint, checksums, model
from maxtrain.errors import UserError

# maxtrain path -> (Hugging Face name, number of leading maxtrain dims that form torch's "in" dim,
# or None for a tensor stored the same way in both). "{i}" is the layer index.
WEIGHTS = {
    "token_embedding": ("model.embed_tokens.weight", None),
    "final_norm": ("model.norm.weight", None),
    "output": ("lm_head.weight", 1),
    "layers/attn_norm": ("model.layers.{i}.input_layernorm.weight", None),
    "layers/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", None),
    "layers/wq": ("model.layers.{i}.self_attn.q_proj.weight", 1),
    "layers/wk": ("model.layers.{i}.self_attn.k_proj.weight", 1),
    "layers/wv": ("model.layers.{i}.self_attn.v_proj.weight", 1),
    "layers/wo": ("model.layers.{i}.self_attn.o_proj.weight", 2),
    "layers/w_gate": ("model.layers.{i}.mlp.gate_proj.weight", 1),
    "layers/w_up": ("model.layers.{i}.mlp.up_proj.weight", 1),
    "layers/w_down": ("model.layers.{i}.mlp.down_proj.weight", 1),
}
# Buffers some older checkpoints carry; recomputed, never needed.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PRESET_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers",
               "head_dim", "vocab_size", "rope_max_timescale", "normalization_layer_epsilon", "logits_via_embedding")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class ConversionError(UserError, ValueError):
    """A checkpoint that cannot be converted; the message names the tensor or config field."""


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------


def read_json(path: str, what: str) -> dict:
    """A JSON object from `path`; ConversionError naming the file when it is unreadable or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConversionError(f"cannot read {path} ({e.strerror or e}); {what} must be a readable file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}); {what} must be a JSON object: re-download or "
                              "fix the file") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object; {what} must be a JSON "
                              "object of settings")
    return data


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file (memory-mapped, read-only)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise ConversionError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConversionError(f"{path} is not a safetensors file (its header is not JSON); re-download it") from None
        if not isinstance(header, dict):
            raise ConversionError(f"{path} is not a safetensors file (its header is not a JSON object)")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name} has dtype {info['dtype']}, which maxtrain does not read")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(info["shape"]) * dtype.itemsize or end > len(data):
            raise ConversionError(f"{path}: tensor {name} has inconsistent offsets {info['data_offsets']}")
        out[name] = data[begin:end].view(dtype).reshape(info["shape"])
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
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


def read_hf_weights(hf_dir: str) -> dict[str, np.ndarray]:
    """The tensors of a Hugging Face model directory: model.safetensors or a sharded index."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json(index, "the safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index} has no \"weight_map\" of tensor names to files; re-download it")
        files = sorted(set(map(str, weight_map.values())))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        pickles = [n for n in sorted(os.listdir(hf_dir)) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        raise ConversionError(
            f"{hf_dir} has no model.safetensors or model.safetensors.index.json"
            + (f"; it has {pickles}, which are pickle files and are never loaded (loading a pickle can run "
               "arbitrary code). Convert them to safetensors first in an environment you trust, e.g. "
               "transformers' save_pretrained(..., safe_serialization=True)." if pickles else "."))
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(hf_dir, name)))
    return tensors


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def model_overrides(hf: dict) -> dict:
    """maxtrain model keys for a Hugging Face config.json; refuses features maxtrain lacks."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"model_type={model_type!r} is not supported; maxtrain converts {SUPPORTED_MODEL_TYPES}")
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (maxtrain's MLP is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (maxtrain's projections have no bias)")
    if hf.get("sliding_window") is not None and model_type == "mistral":
        problems.append(f"sliding_window={hf['sliding_window']} (maxtrain attends to the whole context)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (maxtrain implements the default RoPE, no frequency scaling)")
    if problems:
        raise ConversionError("cannot convert this checkpoint without changing its outputs: " + "; ".join(problems))
    theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    return {
        "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "base_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "vocab_size": hf["vocab_size"],
        "rope_max_timescale": float(theta),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    }


def hf_config(overrides: dict, dtype: str, base: dict | None = None) -> dict:
    """A LlamaForCausalLM config.json for maxtrain model keys (over `base`, the imported original, if any)."""
    theta = overrides["rope_max_timescale"]
    out = dict(base or {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
                        "max_position_embeddings": 4096})
    out.pop("rope_scaling", None)
    out.update({
        "model_type": "llama", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "hidden_size": overrides["base_emb_dim"], "intermediate_size": overrides["base_mlp_dim"],
        "num_hidden_layers": overrides["base_num_decoder_layers"],
        "num_attention_heads": overrides["base_num_query_heads"],
        "num_key_value_heads": overrides["base_num_kv_heads"], "head_dim": overrides["head_dim"],
        "vocab_size": overrides["vocab_size"], "rms_norm_eps": overrides["normalization_layer_epsilon"],
        "tie_word_embeddings": overrides["logits_via_embedding"],
        # Both forms: older transformers read rope_theta, newer rope_parameters.
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "torch_dtype": dtype, "dtype": dtype,
    })
    return out


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _specs(overrides: dict) -> dict[str, model.ParamSpec]:
    specs = model.param_specs(types.SimpleNamespace(**overrides))
    flat = {}
    for key, value in specs.items():
        for sub, spec in (value.items() if isinstance(value, dict) else [(None, value)]):
            flat[f"{key}/{sub}" if sub else key] = spec
    return flat


def to_maxtrain(tensors: dict[str, np.ndarray], overrides: dict, dtype=np.float32) -> dict:
    """maxtrain params (nested dict of numpy arrays) from Hugging Face tensors."""
    used, params = set(), {"layers": {}}
    for path, spec in _specs(overrides).items():
        name, n_in = WEIGHTS[path]
        layered = "{i}" in name
        names = [name.format(i=i) for i in range(spec.shape[0])] if layered else [name]
        shape = spec.shape[1:] if layered else spec.shape
        arrays = []
        for hf_name in names:
            if hf_name not in tensors:
                raise ConversionError(f"the checkpoint has no tensor {hf_name} (for maxtrain's {path})")
            w = np.asarray(tensors[hf_name])
            expected = shape if n_in is None else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
            if tuple(w.shape) != tuple(expected):
                raise ConversionError(f"{hf_name} has shape {list(w.shape)}, but the config implies {list(expected)} "
                                      f"(for maxtrain's {path} {list(shape)})")
            arrays.append((w if n_in is None else w.T.reshape(shape)).astype(dtype))
            used.add(hf_name)
        value = np.stack(arrays) if layered else arrays[0]
        if path.startswith("layers/"):
            params["layers"][path.split("/", 1)[1]] = value
        else:
            params[path] = value
    unused = [n for n in tensors if n not in used and not n.endswith(IGNORED_SUFFIXES)
              and not (n == "lm_head.weight" and overrides["logits_via_embedding"])]
    if unused:
        raise ConversionError(f"tensors that maxtrain's Llama has no place for: {unused[:8]}"
                              + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
                              + ". Is this a Llama-family model without biases?")
    return params


def to_hf(params: dict, overrides: dict, dtype) -> dict[str, np.ndarray]:
    """Hugging Face tensors (torch Linear layout) from maxtrain params."""
    out = {}
    for path, spec in _specs(overrides).items():
        name, n_in = WEIGHTS[path]
        value = np.asarray(params["layers"][path.split("/", 1)[1]] if path.startswith("layers/") else params[path])
        if tuple(value.shape) != tuple(spec.shape):
            raise ConversionError(f"param {path} has shape {list(value.shape)}, the model declares {list(spec.shape)}")
        layered = "{i}" in name
        for i, w in enumerate(value if layered else [value]):
            if n_in is not None:
                w = w.reshape(math.prod(w.shape[:n_in]), -1).T
            out[name.format(i=i)] = np.ascontiguousarray(w).astype(dtype)
    return out


# --------------------------------------------------------------------------------------------
# Import and export
# --------------------------------------------------------------------------------------------


def import_hf(hf_dir: str, out_dir: str, weight_dtype: str = "float32", model_name: str | None = None) -> dict:
    """Writes <out_dir>/checkpoints/0 (params only) and <out_dir>/model.yml; returns the model keys."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConversionError(f"{hf_dir} has no config.json; pass a Hugging Face model directory")
    hf = read_json(config_path, "a Hugging Face config.json")
    overrides = model_overrides(hf)
    tensors = read_hf_weights(hf_dir)
    source_dtypes = sorted({str(t.dtype) for t in tensors.values()})
    params = to_maxtrain(tensors, overrides, np.dtype(weight_dtype))

    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    metadata = {"step": 0, "config": overrides, "saved_at": checkpoint._now(),  # pylint: disable=protected-access
                "source": {"hugging_face_dir": os.path.abspath(hf_dir), "dtypes": source_dtypes, "hf_config": hf},
                "git": checkpoint.git_state()}
    ckpt_dir = os.path.join(os.path.abspath(out_dir), "checkpoints")
    if checkpoint.complete_steps(ckpt_dir):
        raise ConversionError(f"{ckpt_dir} already holds a checkpoint; choose an empty output directory")
    with ocp.CheckpointManager(ckpt_dir, item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                        "metadata": ocp.JsonCheckpointHandler()}) as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params}),
                                                metadata=ocp.args.JsonSave(metadata)))
        manager.wait_until_finished()
    checksums.write(os.path.join(ckpt_dir, "0"))  # a self-checking step, like the trainer's
    preset = ["# Model preset converted from " + os.path.abspath(hf_dir),
              "# Use: copy to configs/models/<name>.yml and pass model_name=<name>, with",
              f"#      load_parameters_path={ckpt_dir}/0"] + [f"{k}: {yaml_value(v)}" for k, v in overrides.items()]
    text = "\n".join(preset) + "\n"
    with open(os.path.join(out_dir, "model.yml"), "w") as f:
        f.write(text)
    if model_name:
        repo_models = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")
        with open(os.path.join(repo_models, f"{model_name}.yml"), "w") as f:
            f.write(text)
    return overrides


def export_hf(checkpoint_path: str, out_dir: str, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> str:
    """Writes config.json and model.safetensors (sharded with an index above max_shard_bytes)."""
    step_dir = checkpoint.find_step_dir(checkpoint_path)
    meta = checkpoint.read_metadata(step_dir)
    saved = meta.get("config", {})
    missing = [k for k in PRESET_KEYS if k not in saved]
    if missing:
        raise ConversionError(f"the checkpoint {step_dir} has no model settings {missing} in its metadata")
    overrides = {k: saved[k] for k in PRESET_KEYS}
    tensors = to_hf(checkpoint.read_params(step_dir), overrides, np.dtype(_DTYPES[_safetensors_name(dtype)]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(overrides, dtype, meta.get("source", {}).get("hf_config")), f, indent=2)
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    info = {"format": "pt", "maxtrain_checkpoint": step_dir}
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0], info)
        return out_dir
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, name), shard, info)
        weight_map.update({t: name for t in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map},
                  f, indent=2)
    return out_dir


def yaml_value(value) -> str:
    """`value` as YAML reads it back with the same type (1e-05 would be a string; 1.0e-05 is a float)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _safetensors_name(dtype: str) -> str:
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    if dtype not in names:
        raise ConversionError(f"export dtype {dtype!r} is not one of {', '.join(names)}")
    return names[dtype]
