"""Loading a config: base.yml, a YAML file's base_config chain, presets, key=value overrides, derived values.

    config = load_config(["configs/base.yml", "steps=100", "model_name=gpt2-small"])
    config = with_devices(config, num_devices=8, num_processes=1)   # batch and mesh derivations

maxtrain's own `configs/base.yml` is the schema (schema.py; settings.py reads it as the settings
table): its keys are the only keys, the type of each default is the type a value must have (an int
is accepted where a float is expected), and the `{...}` at the start of each comment is the values it
allows. The YAML file given first is merged over it (following its `base_config:` chain; a file
without one inherits base.yml, and says so once), then the model preset
(`configs/models/<model_name>.yml`, or `model_name=<path of a preset YAML>`), then the command-line
overrides. The whole result is checked against the table and the named cross-key checks
(checks.py), and frozen into a `Config`; every check that needs no devices happens in load_config,
before JAX starts.

The configs ship inside the package: a config file named without a directory (`base.yml`) that does
not exist where the command runs is found among the packaged ones, and so are presets; an explicit
path always wins.
"""

from __future__ import annotations

import datetime
import difflib
import os
import sys
from typing import Any, Callable, Iterable

import yaml

from maxtrain.config import batch, checks, features, objectives
from maxtrain.config import settings as settings_lib
from maxtrain.config.schema import BASE_CONFIG, packaged_configs_dir, preset_names, table
from maxtrain.errors import ConfigError, UserError

# Keys that are not settings: added by load_config and _derive, ignored when runs are compared.
_DERIVED = ("config_path", "run_name_was_generated", "given_keys", "preset_keys", "run_dir", "checkpoint_dir", "tensorboard_dir", "metadata_dir",
            "cache_dir", "schedule_steps", "warmup_steps", "tokens_per_sequence")


class Config:
    """Frozen, attribute-access view of the resolved configuration (see configs/base.yml)."""

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            if name in DEVICE_KEYS:
                raise AttributeError(f"config.{name} is known only once the devices are: a DeviceConfig "
                                     "(config_lib.with_devices, which training/builder.build calls)") from None
            raise AttributeError(_unknown_key_message(name, self._values)) from None

    def __setattr__(self, name, value):
        raise AttributeError(f"Config is frozen; use config.replace({name}=...) for a changed copy")

    def __reduce__(self):  # pickled by its values (a GRPO rollout worker's process receives its run's config)
        return type(self), (self._values,)

    def replace(self, **changes) -> "Config":
        """A copy with `changes` applied (keys must exist), of the same phase (Config or DeviceConfig). Derived
        values are not recomputed."""
        for key in changes:
            if key not in self._values:
                raise ConfigError(_unknown_key_message(key, self._values))
        return type(self)({**self._values, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __contains__(self, key):
        return key in self._values

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"


# The values a config has only once the devices are known (with_devices).
DEVICE_KEYS = ("num_devices", "num_processes", "micro_batch_size", "global_batch_size", "tokens_per_step")


class DeviceConfig(Config):
    """The second phase of a config: the settings plus what follows from the devices a run has (DEVICE_KEYS:
    device and process counts, the micro and global batch, tokens per step). `with_devices` makes one; code
    that needs the global batch takes a DeviceConfig, and a plain Config says where the values come from."""


# --------------------------------------------------------------------------------------------
# Loading and merging
# --------------------------------------------------------------------------------------------

def _find_config(path: str) -> str:
    """`path` itself when it exists, else a packaged config of that name (base.yml, models/x.yml)."""
    if "\x00" in path:
        raise ConfigError(f"config file {path!r} is not a usable path (it contains a NUL character). "
                          "Pass a YAML file such as configs/base.yml.")
    if os.path.isfile(path) or os.path.isabs(path):
        return path
    packaged = os.path.join(packaged_configs_dir(), path)
    return packaged if os.path.isfile(packaged) else path


def _load_chain(path: str, schema: dict, seen: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """A user YAML file merged over its `base_config:` chain. Returns (values, notes to print)."""
    path = os.path.abspath(_find_config(path))
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(seen + (path,))}")
    if os.path.realpath(path) == os.path.realpath(BASE_CONFIG):
        return {}, []
    data, _ = settings_lib.read_mapping(path)
    base = data.pop("base_config", None)
    for key in data:
        if key not in schema and key not in objectives.OLD_KEYS:
            raise ConfigError(f"{path}: " + _unknown_key_message(key, schema))
    if base is None:
        note = (f"note: {path} has no base_config, so it is applied over {BASE_CONFIG} (add "
                "`base_config: base.yml` to say so)")
        return data, [note]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base_config={base!r} must name a YAML file, e.g. base_config: base.yml")
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path) and os.path.isfile(os.path.join(packaged_configs_dir(), base)):
        base_path = os.path.join(packaged_configs_dir(), base)  # a name in maxtrain's configs/
    if not os.path.isfile(base_path):
        raise ConfigError(f"{path}: base_config {base!r} does not exist (looked for {os.path.abspath(base_path)}); "
                          "use base_config: base.yml, or a path relative to this file")
    values, notes = _load_chain(base_path, schema, seen + (path,))
    return {**values, **data}, notes


def _unknown_key_message(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "see configs/base.yml for the keys that exist"
    return f"unknown config key {key!r}: {hint}"


def parse_overrides(args: list[str]) -> dict[str, str]:
    """key=value arguments -> {key: value text}; a key given twice is an error (settings.unique)."""
    assignments = []
    for i, arg in enumerate(args):
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"cannot read argument {arg!r}: overrides are key=value, e.g. steps=100")
        assignments.append((key.strip(), value, f"argument {i + 2}: {arg!r}"))
    return settings_lib.unique(assignments, "the command line")


def with_overrides(argv: list[str], *overrides: str) -> list[str]:
    """argv with key=value `overrides` replacing the same keys' earlier values (or appended).

    For programs and tests that compose a command line; a person typing one key twice is refused.
    """
    keys = {o.partition("=")[0].strip() for o in overrides}
    return [a for a in argv if "=" not in a or a.partition("=")[0].strip() not in keys] + list(overrides)


def _type_name(value) -> str:
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string",
            list: "a list"}.get(type(value), type(value).__name__)


def _example(default) -> str:
    return yaml.safe_dump(default, default_flow_style=True, width=1_000_000).strip().removesuffix("...").strip()


def _coerce(key: str, raw: Any, default: Any, source: str) -> Any:
    """Converts `raw` (a YAML value, or the text of a command-line override) to default's type."""
    if isinstance(raw, str) and not isinstance(default, str):
        try:
            raw = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            pass
    if isinstance(default, str):
        if raw is None:
            return ""
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
    elif isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
    elif isinstance(default, int):
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if key in batch.FRACTIONAL and isinstance(raw, float):  # a fraction of a sequence per device (batch.py)
            return raw
    elif isinstance(default, float):
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):  # YAML 1.1 reads "1e-2" (no dot) as a string; also "nan", "inf"
            try:
                return float(raw)
            except ValueError:
                pass
    elif isinstance(default, list):
        if isinstance(raw, list):
            return raw
    elif default is None:
        return raw
    shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:77] + "..."
    raise ConfigError(f"{source}: {key}={shown} has the wrong type; {key} must be {_type_name(default)}, "
                      f"e.g. {key}={_example(default)}")


def _process_id_hint(values: dict, overrides: dict) -> int:
    """This process' id as far as the config tells (for printing notes once, before JAX starts)."""
    for raw in (overrides.get("process_id"), os.environ.get("MAXTRAIN_PROCESS_ID"), os.environ.get("SLURM_PROCID")):
        try:
            if raw is not None and str(raw).strip():
                return int(str(raw).strip())
        except ValueError:
            pass
    return values.get("process_id", -1)


def load_config(argv: list[str], log=None, adopt: Callable[[dict], dict] | None = None, command: str = "") -> Config:
    """argv: [yaml_path, key=value, ...]. Returns the validated, frozen config (no device facts yet).

    `log` receives the notes (e.g. a YAML file without base_config); default: stderr, process 0 only.
    `adopt(values) -> changes`: settings taken from elsewhere before the checks (a checkpoint's model settings,
    checkpointing.adoption.settings_to_adopt), so that every check sees the model the run will have. When the
    values alone fail a check and adopting cannot be done (a checkpoint that cannot be read), that failure
    is the one raised: the config's own problem comes first. `command`: the module that runs
    (maxtrain.train, ...): a key only another command reads is refused (features.COMMAND_KEYS); "" checks none.
    """
    if not argv:
        raise ConfigError("usage: python -m maxtrain.train configs/base.yml [key=value ...]")
    if "=" in argv[0] and not argv[0].endswith((".yml", ".yaml")):
        raise ConfigError(f"the first argument must be a YAML config file (e.g. configs/base.yml), got {argv[0]!r}")
    schema = table()
    overrides = parse_overrides(argv[1:])
    for key in overrides:
        if key not in schema and key not in objectives.OLD_KEYS:
            raise ConfigError(_unknown_key_message(key, schema))
    chain, notes = _load_chain(argv[0], schema)
    objective, note = _old_objective_keys(chain, overrides, argv[0])  # use_dpo=true -> objective=dpo, said once
    notes += [note] if note else []

    values = {k: s.default for k, s in schema.items()}
    values.update({k: _coerce(k, v, schema[k].default, argv[0]) for k, v in chain.items()})
    model_name = _coerce("model_name", overrides.get("model_name", values["model_name"]), "", "override")
    preset, preset_path = _load_preset(model_name, schema, os.path.dirname(os.path.abspath(_find_config(argv[0]))))
    values.update(preset)
    if not _packaged(preset_path):  # a preset the user wrote: each key it sets does something in its model
        features.preset_settings_that_do_nothing(model_name, {**values, **objective}, preset)
    for key, raw in overrides.items():
        values[key] = _coerce(key, raw, schema[key].default, "command line")
    values.update(objective)
    values["config_path"] = os.path.abspath(_find_config(argv[0]))
    values["run_name_was_generated"] = not values["run_name"]
    # Keys the user chose (their YAML or the command line) rather than base.yml's defaults: a checkpoint's
    # model settings are adopted where the user chose none (checkpointing.adoption.settings_to_adopt).
    values["given_keys"] = sorted(set(chain) | set(overrides) | set(objective))
    # Keys whose value is the model preset's (no override replaced it): what the preset says is the model's
    # default, so a setting of a feature that is off is refused only where the user chose it (features.py).
    values["preset_keys"] = sorted(set(preset) - set(overrides))
    features.keys_of_other_commands(values, command)
    _validate(values, adopt)
    if notes:
        if log is None and _process_id_hint(values, overrides) <= 0:
            log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        for note in notes:
            (log or (lambda _: None))(note)
    return Config(_derive(values))


def _old_objective_keys(chain: dict, overrides: dict, path: str) -> tuple[dict[str, Any], str]:
    """The use_* booleans of the YAML chain and the command line taken out of both: (the settings they stand
    for, the one line of notice) by objectives.from_old_keys; ({}, "") without them."""
    old = {}
    for source, where in ((chain, path), (overrides, "command line")):
        for key in [k for k in source if k in objectives.OLD_KEYS]:
            old.pop(key, None)  # the command line's value replaces the YAML file's, in its place
            old[key] = _coerce(key, source.pop(key), False, where)
    if not old:
        return {}, ""
    given = overrides.get("objective", chain.get("objective"))
    given = None if given is None else _coerce("objective", given, "", "command line")
    return objectives.from_old_keys(old, given)


def _validate(values: dict, adopt: Callable[[dict], dict] | None) -> None:
    """checks.validate of the values with what `adopt` returns for them (see load_config)."""
    try:
        checks.validate(values)
        problem = None
    except ConfigError as e:
        problem = e
    if adopt is not None:
        try:
            changes = adopt(values)
        except UserError:
            if problem is not None:
                raise problem from None
            raise
        if changes:
            values.update(changes)
            checks.validate(values)
            return
    if problem is not None:
        raise problem


def _load_preset(model_name: str, schema: dict, config_dir: str) -> tuple[dict[str, Any], str]:
    """(the values, the path) of the preset `model_name` names: a path to a YAML file, else
    configs/models/<model_name>.yml beside the config file, else the packaged one."""
    if model_name.endswith((".yml", ".yaml")) or os.sep in model_name:
        path = model_name
        if not os.path.isfile(path):
            raise ConfigError(f"model_name={model_name!r} looks like a preset file but does not exist")
    else:
        path = os.path.join(config_dir, "models", f"{model_name}.yml")
        if not os.path.isfile(path):
            path = os.path.join(packaged_configs_dir(), "models", f"{model_name}.yml")
    if not model_name or not os.path.isfile(path):
        close = difflib.get_close_matches(model_name, preset_names(), n=1, cutoff=0.6)
        raise ConfigError(f"model_name={model_name!r} is not a preset" + (f" (did you mean {close[0]}?)" if close else "")
                          + f". Presets: {', '.join(preset_names())}; or pass the path of a preset YAML.")
    preset, _ = settings_lib.read_mapping(path)
    out = {}
    for key, raw in preset.items():
        if key not in schema:
            raise ConfigError(f"{path}: " + _unknown_key_message(key, schema))
        out[key] = _coerce(key, raw, schema[key].default, path)
    return out, path


def _packaged(path: str) -> bool:
    """Whether a preset file is one of maxtrain's own (configs/models/), whose values are the model's defaults."""
    models_dir = os.path.realpath(os.path.join(packaged_configs_dir(), "models"))
    return os.path.dirname(os.path.realpath(path)) == models_dir


# --------------------------------------------------------------------------------------------
# Derived values
# --------------------------------------------------------------------------------------------


def _derive(v: dict[str, Any]) -> dict[str, Any]:
    """Values computed from the config alone, in one place."""
    if not v["run_name"]:
        v["run_name"] = "run_" + datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    v["run_dir"] = os.path.join(v["base_output_directory"], v["run_name"])
    v["checkpoint_dir"] = os.path.join(v["run_dir"], "checkpoints")
    v["tensorboard_dir"] = os.path.join(v["run_dir"], "tensorboard")
    v["metadata_dir"] = os.path.join(v["run_dir"], "metadata")
    v["cache_dir"] = v["dataset_cache_dir"] or os.path.join(v["base_output_directory"], "cache")
    schedule = v["learning_rate_schedule_steps"]
    v["schedule_steps"] = v["steps"] if schedule == -1 else schedule
    v["warmup_steps"] = int(v["warmup_steps_fraction"] * v["schedule_steps"])
    v["tokens_per_sequence"] = v["max_target_length"]
    return v


def revalidate(config: Config) -> Config:
    """Checks a config again after values were replaced (e.g. a checkpoint's model settings adopted)."""
    values = config.to_dict()
    checks.validate(values)
    return type(config)(values)


def with_devices(config: Config, num_devices: int, num_processes: int = 1) -> DeviceConfig:
    """The config's second phase: the values that depend on the devices added (global batch, tokens per step)."""
    if num_processes > 1 and config.run_name_was_generated:
        raise ConfigError("multi-process runs need an explicit run_name=... so that every process writes "
                          "to, and resumes from, the same run directory")
    micro_batch = batch.micro_batch(config.per_device_batch_size, num_devices, num_processes)
    global_batch = micro_batch * config.gradient_accumulation_steps
    return DeviceConfig({**config.to_dict(), "num_devices": num_devices, "num_processes": num_processes,
                   "micro_batch_size": micro_batch, "global_batch_size": global_batch,
                   "tokens_per_step": global_batch * config.max_target_length})
