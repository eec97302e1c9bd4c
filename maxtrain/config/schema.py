"""What a config may contain: the settings table (base.yml), the mesh axes, the logical axes, the presets.

    schema.table()["steps"].allowed.describe()     # ">= 1"
    schema.parallelism_key("ici", "stage")         # "ici_pipeline_parallelism"

maxtrain's own `configs/base.yml` is the schema (settings.py reads it as the settings table); the
configs ship inside the package (maxtrain/configs after `pip install .`, configs/ beside the
package in a source checkout).

Imports only the settings table's reader, the registry, the objectives' table and the error types.
"""

from __future__ import annotations

import os
from typing import Any

from maxtrain.config import objectives, registry
from maxtrain.config import settings as settings_lib

# The device mesh's axes, declared once, outermost first (the last axis gets the closest devices): each
# mesh axis and the stem of its two config keys, ici_<stem>_parallelism (inside a slice) and
# dcn_<stem>_parallelism (across slices). parallel/sharding.py builds the mesh from this table; validation,
# errors and docs/parallelism.md read it. What each axis does:
#   data     replicas of the model, each on its own rows of the batch
#   stage    pipeline stages: contiguous runs of layers, micro-batches passed stage to stage (parallel/stages.py)
#   fsdp     rows of the batch, with parameters and optimizer state sharded and gathered per layer
#   context  the sequence: each device holds pieces of every row; attention gathers keys and values
#            (parallel/context.py)
#   expert   mixture-of-experts experts; batch rows on models without experts
#   tensor   heads, MLP width and vocabulary: every matmul split, activations reduced per layer
MESH_AXES = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "context": "context", "expert": "expert",
             "tensor": "tensor"}

# quantization's values and where each puts float8 matmuls (models/fp8.py; models/runtime.resolve_fp8 adds the
# output head for quantize_output_head). The MoE experts' matmuls are float8 with capacity dispatch only:
# dropless dispatch's grouped matmuls (ragged_dot) have no float8 form in XLA and stay 16-bit.
QUANTIZATION_PLACES = {"": (), "fp8": ("attention", "mlp", "experts"), "fp8_mlp": ("mlp", "experts")}

# The logical axes model code names (logical_axis_rules map them onto MESH_AXES).
LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "exp")


def parallelism_key(prefix: str, axis: str) -> str:
    """The config key of mesh axis `axis` inside a slice (prefix "ici") or across slices ("dcn")."""
    return f"{prefix}_{MESH_AXES[axis]}_parallelism"


def ways(values: dict[str, Any], axis: str) -> int | None:
    """How many ways `axis` splits (ici x dcn) in resolved config values, or None while one of them is -1
    (known with the devices)."""
    ici, dcn = values[parallelism_key("ici", axis)], values[parallelism_key("dcn", axis)]
    return None if -1 in (ici, dcn) else ici * dcn


def packaged_configs_dir() -> str:
    """configs/ of the installed package (a wheel puts it at maxtrain/configs; a source checkout has it
    beside the maxtrain/ package)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = os.path.join(package, "configs")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(package), "configs")


# maxtrain's own base.yml: the settings table.
BASE_CONFIG = os.path.join(packaged_configs_dir(), "base.yml")

_TABLES: dict[str, dict[str, settings_lib.Setting]] = {}


def table(path: str = BASE_CONFIG) -> dict[str, settings_lib.Setting]:
    """The settings table of base.yml (read once per process); `{$families}` names the registry's families,
    `{$objectives}` the objectives' rows."""
    path = os.path.realpath(path)
    if path not in _TABLES:
        _TABLES[path] = settings_lib.read_table(path, {**registry.NAMED_CHOICES, "objectives": objectives.NAMES})
    return _TABLES[path]


def defaults() -> dict[str, Any]:
    """The packaged base.yml's values (every key's default)."""
    return {k: s.default for k, s in table().items()}


def preset_names() -> list[str]:
    """The packaged presets (configs/models/<name>.yml)."""
    models_dir = os.path.join(packaged_configs_dir(), "models")
    return sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml")) if os.path.isdir(models_dir) else []


def command_help(doc: str, keys: tuple[str, ...] = ()) -> str:
    """A command's --help: its docstring (usage first), the settings it reads most with their defaults,
    allowed values and meaning, and where the rest are described."""
    settings = table()
    lines = [doc.strip("\n"), ""]
    if keys:
        lines.append("Settings it reads most (key=value after the config file; default, allowed values, meaning):")
        width = max(len(k) for k in keys)
        for key in keys:
            s = settings[key]
            allowed = f" {{{s.allowed.text}}}" if s.allowed else ""
            lines.append(f"  {key:<{width}}  {s.default!r}{allowed}  {s.description}")
        lines.append("")
    lines.append(f"Every setting ({len(settings)} keys) is declared, with its default and allowed values, in "
                 f"{BASE_CONFIG}; docs/ describes them by topic (docs/architecture.md lists the pages).")
    return "\n".join(lines)
