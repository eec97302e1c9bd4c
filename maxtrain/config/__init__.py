"""Settings: the table (configs/base.yml), loading and derivation, the checks, the registries.

    from maxtrain import config as config_lib
    config = config_lib.load_config(["configs/base.yml", "steps=100"])   # validated, frozen, no JAX

    settings.py   the settings table's format: one line of base.yml declares a key, its type, allowed values
    registry.py   the model families and downstream tasks, declared once
    objectives.py the objective key's rows: data kind, frozen model, extra state, owned keys, checks
    schema.py     base.yml as the table, the mesh and logical axes, the presets
    checks.py     the named rules that relate several keys (context_checks.py: context parallelism's)
    features.py   each feature's switch and the settings it owns; what each family is
    limits.py     samplers with one choice, settings the sequence cannot hold, empty paths
    loading.py    YAML chain, presets, overrides, coercion, derived values -> Config
    batch.py      a fractional per_device_batch_size: whole rows per micro-batch, process and batch axis
    chips.py      one record per accelerator chip (memory, peaks, bandwidths, shared memory, float8)
    attention_speeds.py  the attention kernels' measured speeds (autoselected's choice, the step-time prediction)

Owns every fact about what a setting may be. May import only `maxtrain.errors` (and PyYAML):
everything else in maxtrain reads its settings from here, before JAX starts.
"""

from maxtrain.config.loading import (Config, DeviceConfig, load_config, parse_overrides, revalidate, with_devices,  # noqa: F401
                                     with_overrides)
from maxtrain.config import objectives  # noqa: F401
from maxtrain.config.registry import EVAL_TASKS, MOE_FAMILIES  # noqa: F401
from maxtrain.config.schema import (BASE_CONFIG, LOGICAL_AXES, MESH_AXES, command_help, defaults,  # noqa: F401
                                    packaged_configs_dir, parallelism_key, preset_names, table)
from maxtrain.errors import ConfigError  # noqa: F401
