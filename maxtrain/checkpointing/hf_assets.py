"""The files of a Hugging Face model directory other than its weights: what an import keeps (configs, tokenizer,
chat template, license) and what an export writes beside the safetensors (the tokenizer files transformers reads,
the generation config, the original's license and readme). convert.py calls both."""

from __future__ import annotations

import json
import os
import shutil

from maxtrain.checkpointing import safetensors_files
from maxtrain.data import tokenizer_hf


def copy(hf_dir: str, assets: str) -> list[str]:
    """Everything of the model directory but its weights: configs, tokenizer, chat template, license."""
    os.makedirs(assets, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(hf_dir)):
        src = os.path.join(hf_dir, name)
        if not os.path.isfile(src) or name.endswith(safetensors_files.WEIGHT_SUFFIXES) \
                or name.endswith(".safetensors.index.json") or name.startswith("."):
            continue
        shutil.copyfile(src, os.path.join(assets, name))
        copied.append(name)
    return copied


def write(out_dir: str, tok, assets: str | None, log):
    """The tokenizer files transformers reads to maxtrain's ids (data/tokenizer_hf.py), the original model's
    generation config, license and readme files, or a generation config with the tokenizer's ids."""
    if tok is not None:
        files, notes = tokenizer_hf.hf_files(tok)
        for name, data in files.items():
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(data)
        for note in notes:
            log(f"note: {note}")
    if assets and os.path.isdir(assets):
        for name in sorted(os.listdir(assets)):  # the original generation config, license and readme files
            if name == "generation_config.json" or name == "README.md" \
                    or name.upper().startswith(("LICENSE", "NOTICE", "USE_POLICY")):
                shutil.copyfile(os.path.join(assets, name), os.path.join(out_dir, name))
    if not os.path.isfile(os.path.join(out_dir, "generation_config.json")):
        generation = {} if tok is None else {"bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id, "eos_token_id":
                                             list(tok.eos_ids) if len(tok.eos_ids) > 1 else tok.eos_id}
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    if tok is None:
        log("note: no tokenizer files were found for this checkpoint; pass --tokenizer PATH to include them "
            "(transformers needs them to run the model on text)")
