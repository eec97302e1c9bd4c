"""What a checkpoint holds, as `python -m maxtrain.inspect_checkpoint PATH` prints it: its step, health,
array tree (shapes and dtypes), data iterators and metadata, without loading any array."""

from __future__ import annotations

import math
import os

import numpy as np

from maxtrain import config as config_lib
from maxtrain.models import model_keys
from maxtrain.checkpointing import checksums
from maxtrain.checkpointing.files import (check_step, complete_steps, damaged_root, find_step_dir,
                                          latest_usable_step, read_metadata, read_tree)

def describe(path: str) -> str:
    """The report of the checkpoint at `path` (a step, checkpoints or run directory)."""
    step_dir = find_step_dir(path)
    parent = os.path.dirname(step_dir)
    tree = read_tree(step_dir)
    meta = read_metadata(step_dir)
    health = check_step(step_dir)
    files = checksums.read(step_dir) or {}
    lines = [f"checkpoint: {step_dir}", f"step: {os.path.basename(step_dir)}   "
             f"(complete steps in {parent}: {complete_steps(parent)})",
             "checksums: " + (f"verified ({len(files)} files match)" if health.status == "verified" else
                              "none (saved without checksums: not verified)")]
    usable, damaged = latest_usable_step(parent)
    if usable is not None and os.path.basename(parent) == "checkpoints":
        lines.append(f"latest usable step: {usable.step}" + (" (what a resume of this run restores)"))
    for h in damaged:
        lines.append(f"  damaged step {h.step}: {h.problem} (a resume moves it to {damaged_root(parent)})")
    lines += ["", "state:"]
    width = max(len(p) for p in tree)
    for p, (shape, dtype) in tree.items():
        lines.append(f"  {p:<{width}}  {dtype:<8} {list(shape)}")
    params = {p: s for p, s in tree.items() if p.startswith("params/")}
    n = sum(math.prod(shape) for shape, _ in params.values())
    size = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in tree.values())
    lines.append(f"  params: {n:,} ({n / 1e6:.2f}M); state size {size / 2**20:.2f} MiB")
    data_dir = os.path.join(step_dir, "data")
    if os.path.isdir(data_dir):
        for name in sorted(f for f in os.listdir(data_dir) if f.endswith(".json")):
            with open(os.path.join(data_dir, name)) as f:
                lines.append(f"data iterator {name}: {f.read().strip()}")
    if meta:
        lines.append("metadata:")
        config = meta.get("config", {})
        for key in ("step", "saved_at", "git", "num_processes", "num_devices", "device_kind", "jax_version"):
            if key in meta:
                lines.append(f"  {key}: {meta[key]}")
        if "source" in meta:
            lines.append(f"  converted from: {meta['source'].get('hugging_face_dir')} "
                         f"(dtypes {meta['source'].get('dtypes')})")
        if config:
            lines.append("  model: " + " ".join(f"{k}={config[k]}" for k in model_keys.MODEL_KEYS if k in config))
        if "run_name" in config:
            lines.append(f"  run: run_name={config['run_name']} steps={config.get('steps')} "
                         f"seed={config.get('seed')} dataset_type={config.get('dataset_type')} "
                         f"objective={config_lib.objectives.saved_objective(config).get('objective', 'lm')}")
        if "packages" in meta:
            lines.append(f"  packages: {len(meta['packages'])} (" + ", ".join(
                p for p in meta["packages"] if p.split("==")[0].lower() in ("jax", "orbax-checkpoint", "grain", "optax"))
                + ")")
    return "\n".join(lines)
