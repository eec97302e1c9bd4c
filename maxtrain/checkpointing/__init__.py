"""Checkpoints: what is saved, where a run starts, and the Hugging Face formats (docs/checkpoints.md).

    manager.py      Orbax: saving and resuming this run's checkpoints; where a run starts; run metadata
    files.py        finding, checking and reading checkpoints (this run's or another's); CheckpointError
    adoption.py     a checkpoint's model settings (and tokenizer), taken by a run that starts from it
    checksums.py    per-file checksums written after each save, verified before a resume
    inspect.py      what `python -m maxtrain.inspect_checkpoint` prints
    convert.py      Hugging Face safetensors <-> maxtrain params, for every family (scripts/convert_hf.py)
    safetensors_files.py  reading and writing .safetensors without torch
    peft.py         a LoRA run's adapters as a PEFT adapter directory

The only package that imports Orbax. May import models, data, parallel, config and the base modules.
"""
