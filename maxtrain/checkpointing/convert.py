"""Hugging Face checkpoints <-> maxtrain, for every model family (CLI: scripts/convert_hf.py).

    import_hf(hf_dir, out)       config.json + safetensors -> out/checkpoints/0 (params only), out/model.yml
                                 (the model preset) and out/hf/ (the original config.json,
                                 generation_config.json, tokenizer and license files: the assets export needs)
    export_hf(checkpoint, out)   maxtrain params -> a directory transformers loads: config.json (the original
                                 one when the model came from an import), generation_config.json, the tokenizer
                                 files and model.safetensors

The family comes from config.json's model_type (config/registry.py lists each family's); the
family's HF_NAMES and parameter declarations drive the tensor mapping, and its from_hf_config /
to_hf_config the config fields. Every tensor is checked against the declared shape; a tensor the
model has no place for is an error, never silently dropped.
"""

from __future__ import annotations

import json
import os
import types

import jax
import numpy as np
import yaml

from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.models.model import Model
from maxtrain.models.model_keys import LATER_KEYS, MODEL_KEYS
from maxtrain.models.families import FAMILIES
from maxtrain.checkpointing import checksums, dequantize, hf_assets, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.checkpointing import manager as checkpoint_manager
from maxtrain.config import checks as config_checks
from maxtrain.config import registry
from maxtrain.data import default_corpus
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.models.hf import ConversionError
from maxtrain.models.params import is_spec

# Buffers some older checkpoints carry; recomputed, never needed.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints whose text decoder maxtrain imports: prefix in the checkpoint -> prefix of the text model.
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
ASSETS = "hf"  # out/hf/: the original config, generation config, tokenizer and license files

__all__ = ["ConversionError", "import_hf", "export_hf", "model_keys", "to_maxtrain", "to_hf", "read_hf_config"]


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir} is not a directory; pass a Hugging Face model directory (config.json and "
                              "model.safetensors)")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir} has no config.json; pass a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}. It must be the model's JSON config.json") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path} holds a JSON {type(hf).__name__}, not an object of config fields")
    return hf


def family_for(hf: dict, text_only: bool = False):
    """(family module, the config its from_hf_config reads) for a config.json: of a multimodal checkpoint, the text
    model's config, or the whole one for a family with a vision tower (text_only: its text family's)."""
    model_type = hf.get("model_type")
    entry = registry.family_of_hf_model_type(model_type) if isinstance(model_type, str) else None
    if entry is None:
        known = sorted(t for f in registry.FAMILIES.values() for t in f.hf_model_types)
        raise ConversionError(f"model_type={model_type!r} is not supported; maxtrain converts {', '.join(known)}")
    family = FAMILIES[entry.name]
    if family.vision is not None and not text_only:
        return family, hf
    if family.vision is not None:
        family = FAMILIES[family.vision.text_family]
    if isinstance(hf.get("text_config"), dict):  # a multimodal checkpoint: its text decoder
        hf = {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings",
                                                                  hf["text_config"].get("tie_word_embeddings", True))}
    return family, hf


def model_keys(hf: dict, notes: list | None = None, where: str = "config.json", text_only: bool = False) -> dict:
    """Every maxtrain model key (MODEL_KEYS) for a config.json (`where`, for messages): the family's reading
    over base.yml's defaults, checked as a config is (a model maxtrain cannot build is a ConversionError).
    text_only: a multimodal model's text decoder alone."""
    family, text = family_for(hf, text_only)
    name = family.row.name
    try:
        keys = family.from_hf_config(text, notes)
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        if isinstance(e, ConversionError):  # the family's own message, said of this file
            text = str(e)
            raise ConversionError(where + text[len("config.json"):] if text.startswith("config.json")
                                  else f"{where}: {text}") from None
        raise ConversionError(f"{where} is missing or has a malformed field for a {name} model "
                              f"({type(e).__name__}: {e}); use the config.json that came with the weights") from None
    defaults = config_lib.defaults()
    out = {k: defaults[k] for k in MODEL_KEYS}
    out.update(keys, decoder_block=name)
    try:
        # the model alone: no run's data (packing) or decoding (max_new_tokens), which some families refuse
        config_checks.validate({**defaults, "packing": False, "max_new_tokens": 0, **out})
    except config_lib.ConfigError as e:
        raise ConversionError(f"{where} describes a {name} model that maxtrain's {name} family cannot build: its "
                              f"fields read as {e}. Check that it is the model's own config.json; otherwise this "
                              "checkpoint cannot be converted") from None
    return out


def spec_config(keys: dict):
    """Model keys (a dict, e.g. a checkpoint's saved config) as the attribute view the families read."""
    return types.SimpleNamespace(**keys)


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _entries(keys: dict):
    """(path tuple, spec, HF name pattern, layout, HF layer index of each stacked entry or None, experts or None).

    "{i}" in a name is the layer's index in the whole stack (through the layer kinds); "{j}" the
    expert's index along the parameter's "exp" axis (one Hugging Face tensor per expert). The layout
    (models/hf.py) is resolved against the shapes of the parameters of the same layer it is fused with."""
    model = Model.bind(spec_config(keys))
    family, layer_types = model.family, model.layer_types
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): spec for path, spec in
            jax.tree_util.tree_flatten_with_path(model.param_specs, is_leaf=is_spec)[0]}
    for path, spec in flat.items():
        if family.vision is not None and path.startswith("vision/"):  # the tower's own names (contract.Vision)
            continue
        if path not in family.hf_names:
            raise ConversionError(f"the {family.row.name} family declares {path} but has no Hugging Face name for it")
        name, layout = family.hf_names[path]
        layers = experts = None
        if "{i}" in name and path.startswith("mtp/"):  # the MTP modules follow the layers (models/mtp.py)
            layers = [len(layer_types) + k for k in range(spec.shape[0])]
        elif "{i}" in name:
            kind = path.split("/")[1]
            layers = [i for i, t in enumerate(layer_types) if t.kind == kind]
        if "{j}" in name:
            experts = spec.shape[spec.axes.index("exp")]
        prefix = path.rsplit("/", 1)[0]
        layout = layout.resolve(lambda part, prefix=prefix, layers=layers, experts=experts:
                                _one_shape(flat[f"{prefix}/{part}"], layers, experts))
        yield tuple(path.split("/")), spec, name, layout, layers, experts


def _one_shape(spec, layers, experts) -> tuple:
    """The shape of the maxtrain slice one Hugging Face tensor fills (no layer or expert axis)."""
    return tuple(s for s, a in zip(spec.shape, spec.axes)
                 if not (layers is not None and a == "layers") and not (experts is not None and a == "exp"))


def to_maxtrain(tensors: dict[str, np.ndarray], keys: dict, dtype=np.float32) -> dict:
    """maxtrain params (nested dict of numpy arrays) from Hugging Face tensors; a family with a vision tower
    (contract.Vision) reads the tower's tensors (under its prefix) into params["vision"] and the text decoder's
    under their text-model names."""
    vision = FAMILIES[keys["decoder_block"]].vision
    if vision is None:
        return _decoder_to_maxtrain(tensors, keys, dtype)
    tower = {n: tensors[n] for n in tensors if n.startswith(vision.prefix)}
    text = {_renamed(n, vision.text_prefixes): tensors[n] for n in tensors if n not in tower}
    params = _decoder_to_maxtrain(text, keys, dtype)
    params["vision"] = vision.to_maxtrain(tower, keys, dtype)
    return params


def _renamed(name: str, prefixes: dict) -> str:
    """name with its first matching prefix (prefixes: old -> new) replaced; unchanged when none matches."""
    old = next((p for p in prefixes if name.startswith(p)), None)
    return name if old is None else prefixes[old] + name[len(old):]


def _decoder_to_maxtrain(tensors: dict[str, np.ndarray], keys: dict, dtype=np.float32) -> dict:
    """maxtrain params (nested dict of numpy arrays) from Hugging Face tensors (a mapping with `file_of(name)`,
    as dequantize.Dequantized, names each tensor's file in messages)."""
    used, params = set(), {}
    file_of = getattr(tensors, "file_of", lambda _: None)

    def where(hf_name: str) -> str:
        return f"{file_of(hf_name)}: " if file_of(hf_name) else ""
    for path, spec, name, layout, layers, experts in _entries(keys):
        shape = _one_shape(spec, layers, experts)

        def read(hf_name, shape=shape, path=path, layout=layout):
            if hf_name not in tensors:
                if hf_name + "_blocks" in tensors:  # a pair is read as one tensor (dequantize.Dequantized)
                    raise ConversionError(f"the checkpoint holds {hf_name}_blocks (MXFP4) but no {hf_name}_scales; "
                                          "copy the checkpoint's files again, or import a dequantized copy")
                raise ConversionError(f"the checkpoint has no tensor {hf_name} (for maxtrain's {'/'.join(path)})")
            try:
                w = np.asarray(tensors[hf_name])  # a quantised pair is dequantised here
            except safetensors_files.FormatError as e:
                raise ConversionError(f"{where(hf_name)}{e}") from None
            if w.dtype not in dequantize.FULL_PRECISION and not (layout.integers and w.dtype.kind in "iu"):
                raise ConversionError(f"{where(hf_name)}{hf_name} is stored as {w.dtype}, not as float weights (a "
                                      "quantised tensor without its scales?); import a copy with bfloat16 or float32 "
                                      "weights")
            expected = layout.hf_shape(shape)
            if tuple(w.shape) != expected:
                raise ConversionError(f"{where(hf_name)}{hf_name} has shape {list(w.shape)}, but config.json implies "
                                      f"{list(expected)} (for maxtrain's {'/'.join(path)} {list(shape)}); use the "
                                      "config.json that came with these weights")
            used.add(hf_name)
            return layout.to_maxtrain(w, shape).astype(dtype)

        def per_layer(i, name=name, experts=experts):
            if experts is None:
                return read(name.format(i=i))
            return np.stack([read(name.format(i=i, j=j)) for j in range(experts)])

        node = params
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = np.stack([per_layer(i) for i in layers]) if layers is not None else per_layer(None)
    unused = [n for n in tensors if n not in used and not n.endswith(IGNORED_SUFFIXES)
              and not (n == "lm_head.weight" and keys["logits_via_embedding"])]
    if unused:
        raise ConversionError(f"tensors that maxtrain's {keys['decoder_block']} model has no place for: {unused[:8]}"
                              + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
                              + ". Does config.json describe these weights?")
    return params


def to_hf(params: dict, keys: dict, dtype) -> dict[str, np.ndarray]:
    """Hugging Face tensors (torch Linear layout) from maxtrain params; a family with a vision tower writes the
    text decoder's under the checkpoint's prefixes and the tower's from params["vision"]."""
    vision = FAMILIES[keys["decoder_block"]].vision
    out = _decoder_to_hf(params, keys, dtype)
    if vision is None:
        return out
    if "vision" not in params:
        raise ConversionError("the checkpoint has no vision tower params (params['vision'])")
    back = {new: old for old, new in vision.text_prefixes.items()}
    renamed = {_renamed(name, back): w for name, w in out.items()}
    return {**renamed, **vision.to_hf(params["vision"], keys, dtype)}


def _decoder_to_hf(params: dict, keys: dict, dtype) -> dict[str, np.ndarray]:
    """The text decoder's tensors under the text model's names."""
    out = {}
    for path, spec, name, layout, layers, experts in _entries(keys):
        value = params
        for part in path:
            if not isinstance(value, dict) or part not in value:
                raise ConversionError(f"the checkpoint has no param {'/'.join(path)}")
            value = value[part]
        value = np.asarray(value)
        if tuple(value.shape) != tuple(spec.shape):
            raise ConversionError(f"param {'/'.join(path)} has shape {list(value.shape)}, the model declares "
                                  f"{list(spec.shape)}")
        for i, per_layer in zip(layers if layers is not None else [None], value if layers is not None else [value]):
            for j, w in zip(range(experts) if experts is not None else [None],
                            per_layer if experts is not None else [per_layer]):
                layout.export(w, out, name.format(i=i, j=j), dtype)
    return out


def _text_tensors(tensors: dict, notes: list, tower: str | tuple | None = None) -> dict:
    """A multimodal checkpoint's text-decoder tensors, renamed as in the text-only model (tower: the vision tower's
    prefix or prefixes, whose tensors are kept too; Qwen3.5's mtp.* are left out, as transformers does)."""
    if not any(n.startswith(tuple(TEXT_PREFIXES)) for n in tensors):
        return tensors
    kept = {p: p for p in ((tower,) if isinstance(tower, str) else tower or ())}
    out, dropped = {}, 0
    for name, array in tensors.items():
        for prefix, new in {**TEXT_PREFIXES, "lm_head.": "lm_head.", **kept}.items():
            if name.startswith(prefix):
                out[new + name[len(prefix):]] = array
                break
        else:
            dropped += 1
    if tower is None or dropped:
        notes.append(f"imported the text decoder{' and the vision tower' if tower else ''}; {dropped} tensors of the "
                     f"{'other modules' if tower else 'other modalities'} were left out")
    return out


def prediction_layers(hf: dict, where: str = "config.json") -> int:
    """The multi-token-prediction modules a config.json declares (num_nextn_predict_layers, DeepSeek-V3)."""
    value = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ConversionError(f"{where}: num_nextn_predict_layers={value!r} is not a count of modules (an integer "
                              ">= 0); use the config.json that came with the weights")
    return value


def _without_prediction_layers(tensors: dict, hf: dict, keys: dict, notes: list) -> dict:
    """Without the multi-token-prediction modules, which checkpoints store as the layers after num_hidden_layers
    ("model.layers.61.*"; transformers leaves them out too), or with keys' mtp_num_layers > 0 (keep_mtp)
    without only their copies of the embedding and the output head, which maxtrain's modules share."""
    mtp = prediction_layers(hf)
    if not mtp:
        return tensors
    layers = keys["base_num_decoder_layers"]
    extra = tuple(f"model.layers.{i}." for i in range(layers, layers + mtp))
    if keys.get("mtp_num_layers", 0) > 0:
        copies = tuple(p + c for p in extra for c in Model.bind(spec_config(keys)).family.mtp_copies)
        return {n: t for n, t in tensors.items() if not n.endswith(copies)}
    out = {n: t for n, t in tensors.items() if not n.startswith(extra)}
    if len(out) < len(tensors):
        notes.append(f"left out the {len(tensors) - len(out)} tensors of the multi-token-prediction layers "
                     f"(model.layers.{layers}.* on); scripts/convert_hf.py import --keep_mtp keeps them")
    return out


# --------------------------------------------------------------------------------------------
# Import and export
# --------------------------------------------------------------------------------------------


def import_hf(hf_dir: str, out_dir: str, weight_dtype: str = "float32", log=print, keep_mtp: bool = False,
              text_only: bool = False) -> dict:
    """Writes out/checkpoints/0 (params only), out/model.yml and out/hf/; returns the model keys. keep_mtp:
    the multi-token-prediction modules too (mtp_num_layers = the checkpoint's num_nextn_predict_layers);
    text_only: of a model with a vision tower (Qwen3-VL), the text decoder alone, as its text family."""
    storage.check_output(out_dir, False, f"OUT {out_dir}")  # refused before the weights are read
    hf = read_hf_config(hf_dir)
    where = os.path.join(hf_dir, "config.json")
    notes: list[str] = []
    keys = model_keys(hf, notes, where, text_only)
    modules = prediction_layers(hf, where)
    if keep_mtp:
        keys["mtp_num_layers"] = modules
        if not keys["mtp_num_layers"]:
            raise ConversionError(f"--keep_mtp: {hf_dir}/config.json declares no multi-token-prediction modules "
                                  "(num_nextn_predict_layers); import without --keep_mtp")
    ckpt_dir = os.path.join(os.path.abspath(out_dir), "checkpoints")
    if checkpoint_files.complete_steps(ckpt_dir):
        raise ConversionError(f"{ckpt_dir} already holds a checkpoint; choose an empty output directory")
    try:
        origins: dict[str, str] = {}
        stored = safetensors_files.read_model_dir(hf_dir, origins)
        # fp8 / MXFP4 pairs as one tensor, dequantised when read; a quantised tensor without its scale is refused
        readable = dequantize.Dequantized(stored, dequantize.fp8_block(hf, where), dequantize.declared_method(hf),
                                          origins)
        vision = FAMILIES[keys["decoder_block"]].vision
        tensors = _without_prediction_layers(_text_tensors(readable, notes, vision.prefix if vision else None), hf, keys,
                                             notes)
        first = f"model.layers.{keys['base_num_decoder_layers']}."
        if keep_mtp and not any(n.startswith(first) for n in tensors):
            raise ConversionError(f"--keep_mtp: the checkpoint holds no {first}* tensors, the multi-token-prediction "
                                  "modules config.json declares (transformers saves none); import without --keep_mtp")
    except safetensors_files.FormatError as e:
        raise ConversionError(str(e)) from None
    source_dtypes = sorted({str(t.dtype) for t in stored.values()})
    kinds = list(readable.quantized().values())
    if kinds:
        notes.append("dequantised " + ", ".join(f"{kinds.count(k)} {k} tensors" for k in sorted(set(kinds))))
    params = to_maxtrain(tensors, keys, np.dtype(weight_dtype))
    for note in notes:
        log(f"note: {note}")

    os.makedirs(out_dir, exist_ok=True)
    assets = os.path.join(os.path.abspath(out_dir), ASSETS)
    copied = hf_assets.copy(hf_dir, assets)
    source = {"hugging_face_dir": os.path.abspath(hf_dir), "dtypes": source_dtypes, "hf_config": hf,
              "assets_dir": assets, "assets": copied, "notes": notes}
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    metadata = {"step": 0, "config": keys, "saved_at": checkpoint_manager.now(),
                "source": source, "git": checkpoint_manager.git_state()}
    with ocp.CheckpointManager(ckpt_dir, item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                        "metadata": ocp.JsonCheckpointHandler()}) as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params}),
                                                metadata=ocp.args.JsonSave(metadata)))
        manager.wait_until_finished()
    checksums.write(os.path.join(ckpt_dir, "0"))  # a self-checking step, like the trainer's
    preset = [f"# {keys['decoder_block']} model preset converted from {os.path.abspath(hf_dir)}",
              f"# Fine-tune: python -m maxtrain.train base.yml load_parameters_path={os.path.abspath(out_dir)}",
              "#   (the checkpoint's model settings are adopted; or pass model_name=<this file>)"]
    preset += [f"{k}: {yaml_value(v)}" for k, v in keys.items()]
    with open(os.path.join(out_dir, "model.yml"), "w") as f:
        f.write("\n".join(preset) + "\n")
    return keys


def export_hf(checkpoint_path: str, out_dir: str, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
              tokenizer: str | None = None, log=print) -> str:
    """Writes a directory transformers loads; returns it."""
    storage.check_output(out_dir, False, f"HF_OUT {out_dir}")  # refused before the params are read
    step_dir = checkpoint_files.find_step_dir(checkpoint_path)
    meta = checkpoint_files.read_metadata(step_dir)
    saved = meta.get("config", {})
    missing = [k for k in MODEL_KEYS if k not in saved and k not in LATER_KEYS]
    if missing:
        raise ConversionError(f"the checkpoint {step_dir} has no model settings {missing} in its metadata; it was "
                              "written by an older maxtrain")
    defaults = config_lib.defaults()  # a checkpoint from before the MoE keys is a dense model
    keys = {k: saved[k] if k in saved else defaults[k] for k in MODEL_KEYS}
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    if dtype not in names:
        raise ConversionError(f"export dtype {dtype!r} is not one of {', '.join(names)}")
    if keys["mtp_num_layers"] > 0:  # transformers has no multi-token prediction: its modules stay behind
        log(f"note: the {keys['mtp_num_layers']} multi-token-prediction modules are not exported "
            "(transformers does not load them)")
        keys["mtp_num_layers"] = 0
    tensors = to_hf(checkpoint_files.read_params(step_dir), keys, np.dtype(safetensors_files.DTYPES[names[dtype]]))
    source = meta.get("source") or {}
    tok = run_tokenizer(meta, tokenizer, log)
    os.makedirs(out_dir, exist_ok=True)
    hf = hf_config(keys, source.get("hf_config"), dtype)
    if tok is not None and source.get("hf_config") is None:  # an import keeps its original's ids
        for key, token_id in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
            if token_id is not None:
                hf[key] = token_id
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    hf_assets.write(out_dir, tok, source.get("assets_dir"), log)
    safetensors_files.write_model_dir(out_dir, tensors, {"format": "pt", "maxtrain_checkpoint": step_dir},
                                      max_shard_bytes)
    return out_dir


def run_tokenizer(meta: dict, given: str | None, log=print):
    """The tokenizer the checkpoint's run trained with (None when nothing says): `given` (--tokenizer), else the
    copy the run kept in its metadata directory, its tokenizer_path, an imported model's, or for
    dataset_type=default the default corpus' own (from the run's cache_dir; trained again when it is gone)."""
    saved, source = meta.get("config", {}), meta.get("source") or {}
    recorded = meta.get("tokenizer") or {}
    if given:
        return tokenizer_lib.load(given, key="--tokenizer")
    assets = source.get("assets_dir")
    for path in (recorded.get("copy"), saved.get("tokenizer_path"), assets):
        if path and os.path.exists(path) and (path != assets or {tokenizer_lib.TOKENIZER_JSON, tokenizer_lib.SP_MODEL}
                                              & set(os.listdir(path))):
            tok = tokenizer_lib.load(path)
            break
    else:
        if saved.get("dataset_type") != "default" or "cache_dir" not in saved:
            return None
        tok = default_corpus.tokenizer(spec_config(saved), log=log)
    if recorded.get("checksum") not in (None, tok.checksum):
        found = f"--tokenizer {given}" if given else f"the tokenizer found for it, {tok.path},"
        raise ConversionError(f"{found} (checksum {tok.checksum}) is not the one the run trained with "
                              f"({recorded.get('path')}, checksum {recorded['checksum']}); pass that tokenizer with "
                              "--tokenizer PATH")
    return tok


def hf_config(keys: dict, original: dict | None, dtype: str) -> dict:
    """config.json: the imported original when the model settings still read the same from it, else the
    family's own config over the original's other fields (bos/eos ids, max_position_embeddings, ...)."""
    family = Model.bind(spec_config(keys)).family
    if original is not None:
        try:
            text_only = family.vision is None  # of an image-text original: its text decoder (import --text-only)
            same = model_keys(original, text_only=text_only) == keys and family_for(original, text_only)[0] is family
        except ConversionError:
            same = False
        if same:
            out = dict(original)
            if isinstance(out.get("text_config"), dict) and family.vision is None:  # exported as the text-only model
                out.update(out.pop("text_config"))
                out.update(architectures=[family.row.hf_architecture], model_type=family.row.hf_model_types[0],
                           tie_word_embeddings=keys["logits_via_embedding"])  # the whole model's, as imported
                out.pop("vision_config", None)
            if family.vision is not None and out.get("audio_config"):  # an audio tower import left out
                out["audio_config"] = None
            out.update(torch_dtype=dtype, dtype=dtype)
            out.pop("quantization_config", None)  # the weights are written dequantized
            return out
    base = {k: v for k, v in (original or {}).items()
            if k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range")}
    base.setdefault("max_position_embeddings", max(keys.get("original_max_position_embeddings", 8192), 8192))
    return {**base, **family.to_hf_config(keys), "torch_dtype": dtype, "dtype": dtype}


def yaml_value(value) -> str:
    """`value` as YAML reads it back with the same type (1e-05 would be a string; 1.0e-05 is a float)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
