"""A checkpoint's model settings, adopted by a run that starts from it (load_parameters_path / load_full_state_path).

    changes, step_dir = settings_to_adopt(values)    before the config checks (config.load_config's adopt)
    config = adopt_model_settings(config)            on a loaded config (the same changes, revalidated)

Every model setting the user did not choose is the checkpoint's, and its tokenizer when tokenizer_path is
unset; a model_name or decoder_block on the command line keeps the model the user's. The step is found
from the directory listing and its metadata only: configs load before distributed.initialize, and Orbax
would start the JAX backend. Its files are checked when its params are read (files.find_step_dir).
"""

from __future__ import annotations

import os

from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.checkpointing import files
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.errors import UserError


def settings_to_adopt(values, missing_ok: bool = False) -> tuple[dict, str | None]:
    """(changes, step_dir): what a config of `values` (a dict, before its checks) takes from the checkpoint it
    starts from (load_parameters_path / load_full_state_path): every model setting the user did not choose
    (in their YAML or overrides), and its tokenizer when tokenizer_path is unset. Nothing when the user chose
    the model (a model_name, or a family: decoder_block), when no checkpoint is named, or (missing_ok) when it
    cannot be read now. The model keys the user did set stay theirs: the fit and settings checks compare them
    later, naming each that differs from the checkpoint's."""
    key = "load_parameters_path" if values["load_parameters_path"] else "load_full_state_path"
    path = values[key]
    given = set(values["given_keys"])
    if not path or given & {"model_name", "decoder_block"}:
        return {}, None
    try:
        step_dir, meta = _settings_step(path, key)
    except UserError:
        if missing_ok:
            return {}, None
        raise
    saved = meta.get("config", {})
    keys = {k: saved[k] for k in model_keys.MODEL_KEYS if k in saved and k not in given}
    if not keys:
        return {}, step_dir
    run_name = os.path.basename(os.path.dirname(os.path.dirname(step_dir)))
    changes = dict(keys, model_name=saved.get("model_name") or run_name)
    tokenizer = saved.get("tokenizer_path") or (meta.get("source") or {}).get("assets_dir")
    if "tokenizer_path" not in given and tokenizer and _holds_a_tokenizer(tokenizer):
        changes["tokenizer_path"] = tokenizer
    return changes, step_dir


def _holds_a_tokenizer(path: str) -> bool:
    """A tokenizer file, or a directory with one (an import's assets hold none when the model came without)."""
    if os.path.isdir(path):
        return bool({tokenizer_lib.TOKENIZER_JSON, tokenizer_lib.SP_MODEL} & set(os.listdir(path)))
    return os.path.isfile(path)


def _settings_step(path: str, key: str) -> tuple[str, dict]:
    """(step directory, its metadata) whose model settings a config adopts, found without touching JAX (configs
    load before distributed.initialize): the step `path` names, or the newest complete step of a run or
    checkpoints directory whose metadata reads. Its files are checked when its params are read (find_step_dir);
    a path that names no such step is refused by find_step_dir now, saying why."""
    full = storage.abspath(os.path.expanduser(path)).rstrip("/")
    if storage.isdir(os.path.join(full, "state")):
        candidates = [full]
    else:
        candidates = [os.path.join(d, str(s)) for d in (full, os.path.join(full, "checkpoints")) if storage.isdir(d)
                      for s in reversed(files.complete_steps(d))]
    for step_dir in candidates:
        try:
            return step_dir, files.read_metadata(step_dir)
        except files.CheckpointError:
            continue
    step_dir = files.find_step_dir(path, key)
    return step_dir, files.read_metadata(step_dir)


def adoption_line(config, step_dir: str, changes: dict) -> str:
    """What was adopted, for the log: `using the model settings of STEP (llama, 12.3M params) ...`."""
    kept = sorted(k for k in config.given_keys if k in model_keys.MODEL_KEYS)
    return (f"using the model settings of {step_dir} ({config.decoder_block}, {Model.bind(config).num_params / 1e6:,.1f}M "
            "params)" + (f" but this command's {', '.join(kept)}" if kept else "")
            + (f" and its tokenizer {changes['tokenizer_path']}" if "tokenizer_path" in changes else ""))


def adopt_model_settings(config, log=print):
    """config with settings_to_adopt's changes (revalidated), saying what was adopted; unchanged without them."""
    changes, step_dir = settings_to_adopt(config.to_dict())
    if not changes:
        return config
    config = config_lib.revalidate(config.replace(**changes))
    log(adoption_line(config, step_dir, changes))
    return config
