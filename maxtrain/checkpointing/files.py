"""Finding, checking and reading checkpoints on disk, this run's or another's (the layout: manager.py).

Which step is "the latest usable" is decided by one function, `latest_usable_step`, which the
trainer, `inspect` and the fallback all call: the newest step directory that has its state/, whose
files match their checksums and whose metadata reads. A damaged step (one that fails those checks,
or whose restore fails) is moved aside to <run>/damaged_checkpoints/<step> (never deleted), the run
says so, and resumes from the newest usable step before it (`settle_latest_step`).

`find_step_dir` turns a step, checkpoints or run directory into a usable step directory; `read_metadata`
and `read_tree` read a step's metadata and array shapes without loading any array; `check_fits` and
`check_settings` refuse a checkpoint that does not fit the configured model; `load_params`, `load_state`,
`read_params` and `read_adapters` load it. CheckpointError is the error of every checkpoint failure,
here and in manager.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.models import model_keys
from maxtrain.checkpointing import checksums
from maxtrain.errors import UserError
from maxtrain.models import lora
from maxtrain.parallel import distributed

_TMP_MARK = ".orbax-checkpoint-tmp"
DAMAGED_DIR = "damaged_checkpoints"  # beside checkpoints/, where damaged steps are moved


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written, found or loaded, or does not fit; the message says what to do."""


# --------------------------------------------------------------------------------------------
# Finding and reading checkpoints (this run's or another's)
# --------------------------------------------------------------------------------------------


def complete_steps(checkpoints_dir: str) -> list[int]:
    """Steps with a complete checkpoint in `checkpoints_dir` (temporary, half-written ones excluded).
    On GCS, where Orbax cannot rename, a step is complete once its commit_success.txt is written."""
    remote = storage.is_remote(checkpoints_dir)
    return sorted(int(name) for name in storage.listdir(checkpoints_dir)
                  if name.isdigit() and storage.isdir(os.path.join(checkpoints_dir, name, "state"))
                  and (not remote or storage.isfile(os.path.join(checkpoints_dir, name, "commit_success.txt"))))


def remove_partial_checkpoints(checkpoints_dir: str, log=print) -> None:
    """Deletes the temporary directories of saves that never completed (a killed or failed run)."""
    for name in storage.listdir(checkpoints_dir):
        if _TMP_MARK in name:
            log(f"removing a checkpoint that was never completed: {os.path.join(checkpoints_dir, name)}")
            storage.rmtree(os.path.join(checkpoints_dir, name))


def step_dirs(checkpoints_dir: str) -> list[int]:
    """Every step directory's step (complete or not), oldest first."""
    if not storage.isdir(checkpoints_dir):
        return []
    return sorted(int(name) for name in storage.listdir(checkpoints_dir)
                  if name.isdigit() and storage.isdir(os.path.join(checkpoints_dir, name)))


@dataclasses.dataclass(frozen=True)
class StepHealth:
    step: int
    step_dir: str
    status: str                # "verified" | "unverified" (saved without checksums) | "damaged"
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.status != "damaged"


_CHECKED: dict = {}


def check_step(step_dir: str, share: tuple[int, int] = (0, 1), contents: bool = True,
               remember: bool = True) -> StepHealth:
    """Is this step usable? Its state/ must exist, its files match their checksums, its metadata read.
    (With `remember`, the answer is kept while no file of the step changes its size or modification time.)
    On gs://, where checksums are not written (GCS checks every object's CRC32C itself), a step is
    usable when its state/, its commit_success.txt and its metadata are there and readable."""
    if storage.is_remote(step_dir) or not remember:
        return _check_step(step_dir, share, contents)
    try:
        stamp = tuple((root, name, os.stat(os.path.join(root, name)).st_size, os.stat(os.path.join(root, name)).st_mtime_ns)
                      for root, _, names in os.walk(step_dir) for name in sorted(names))
    except OSError:
        stamp = None
    key = (os.path.realpath(step_dir), share, stamp, contents)
    if stamp is None or key not in _CHECKED:
        _CHECKED[key] = _check_step(step_dir, share, contents)
    return _CHECKED[key]


def _check_step(step_dir: str, share: tuple[int, int], contents: bool = True) -> StepHealth:
    step = int(os.path.basename(step_dir)) if os.path.basename(step_dir).isdigit() else -1
    if not storage.isdir(os.path.join(step_dir, "state")):
        return StepHealth(step, step_dir, "damaged", f"{os.path.join(step_dir, 'state')} is missing")
    if storage.is_remote(step_dir) and not storage.isfile(os.path.join(step_dir, "commit_success.txt")):
        return StepHealth(step, step_dir, "damaged", f"{step_dir} has no commit_success.txt: its save never finished")
    status, problem, _ = checksums.verify(step_dir, share, contents)
    if problem is None:
        try:
            read_tree(step_dir)
            read_metadata(step_dir)
        except CheckpointError as e:
            status, problem = "damaged", str(e)
    return StepHealth(step, step_dir, status, problem)


def latest_usable_step(checkpoints_dir: str, share: tuple[int, int] = (0, 1),
                       known_damaged: dict[int, str] | None = None,
                       contents: bool = True) -> tuple[StepHealth | None, list[StepHealth]]:
    """(the newest usable step or None, the damaged steps newer than it, newest first).

    The one rule for "the latest step": the trainer's resume, its fallback and `inspect` all use it.
    known_damaged: {step: what is wrong} for steps already found damaged (e.g. a failed restore).
    contents=False checks every file's presence and size but reads none (the trainer then hashes the
    step's files while Orbax restores it, see Checkpointer.restore).
    """
    damaged = []
    for step in reversed(step_dirs(checkpoints_dir)):
        step_dir = os.path.join(checkpoints_dir, str(step))
        if known_damaged and step in known_damaged:
            health = StepHealth(step, step_dir, "damaged", known_damaged[step])
        else:
            health = check_step(step_dir, share, contents)
        if health.usable:
            return health, damaged
        damaged.append(health)
    return None, damaged


def damaged_root(checkpoints_dir: str) -> str:
    """<run>/damaged_checkpoints, beside `checkpoints_dir`: where damaged steps are moved."""
    return os.path.join(os.path.dirname(storage.abspath(checkpoints_dir).rstrip("/")), DAMAGED_DIR)


def move_aside(health: StepHealth) -> str:
    """Moves a damaged step to <run>/damaged_checkpoints/<step>[.N] (never deletes it); returns where."""
    root = damaged_root(os.path.dirname(health.step_dir))
    storage.makedirs(root)
    target, n = os.path.join(root, str(health.step)), 1
    while storage.exists(target):
        n += 1
        target = os.path.join(root, f"{health.step}.{n}")
    storage.move(health.step_dir, target)
    return target


def all_values(value: int) -> list[int]:
    """`value` from every process, in process order (distributed.all_values)."""
    return distributed.all_values(value)


def settle_latest_step(checkpoints_dir: str, log=print, known_damaged: dict[int, str] | None = None) -> int | None:
    """This run's latest usable step, after moving every newer, damaged step aside (process 0 moves).

    Every process checks its share of each step's files, and they agree before anything moves. When
    steps were moved and none is left, CheckpointError: the run does not silently start over.
    """
    index, count = jax.process_index(), jax.process_count()
    known = dict(known_damaged or {})
    moved = []
    while True:
        usable, damaged = latest_usable_step(checkpoints_dir, (index, count), known, contents=False)
        # Agree on the newest damaged step (if any): the processes checked different files.
        newest_damaged = damaged[0].step if damaged else -1
        newest = max(all_values(newest_damaged))
        if newest < 0:
            if usable is None and moved:
                raise CheckpointError(
                    f"no usable checkpoint is left in {checkpoints_dir}: every step was damaged (step {moved[-1].step}: "
                    f"{moved[-1].problem}) and was moved to {damaged_root(checkpoints_dir)}. Re-run the same command "
                    "to start from step 0, or move a step back from there.")
            return usable.step if usable else None
        mine = next((h for h in damaged if h.step == newest), None)
        if mine is None:  # another process found it
            mine = StepHealth(newest, os.path.join(checkpoints_dir, str(newest)), "damaged",
                              known.get(newest, "another process found a file that does not match its checksum"))
        if mine.problem and index != 0:
            print(f"process {index}: checkpoint step {newest} is damaged: {mine.problem}", file=sys.stderr, flush=True)
        all_values(0)  # everyone is done reading before process 0 moves it
        moved.append(mine)
        if index == 0:
            target = move_aside(mine)
            log(f"checkpoint step {newest} is damaged: {mine.problem}. Moved it to {target} (nothing is deleted); "
                "resuming from the newest usable step before it")
        all_values(0)
        known.pop(newest, None)


def find_step_dir(path: str, key: str = "path") -> str:
    """The step directory that `path` names: a step directory itself (<run>/checkpoints/<step>), or the
    latest usable step of a checkpoints directory or of a run directory (latest_usable_step).
    A damaged step is refused, naming the file."""
    path = storage.abspath(os.path.expanduser(path)).rstrip("/")
    if not storage.exists(path):
        raise CheckpointError(f"{key}={path!r} does not exist. Give a checkpoint step directory "
                              "(<run>/checkpoints/<step>), a run's checkpoints directory, or a run directory.")
    if storage.isdir(os.path.join(path, "state")) or (os.path.basename(path).isdigit() and storage.isdir(path)):
        health = check_step(path)
        if not health.usable:
            raise CheckpointError(f"{key}={path!r} is damaged: {health.problem}. Use another step (see python -m "
                                  f"maxtrain.inspect_checkpoint {os.path.dirname(path)}).")
        return path
    for directory in (path, os.path.join(path, "checkpoints")):
        usable, damaged = latest_usable_step(directory)
        if usable:
            return usable.step_dir
        if damaged:
            raise CheckpointError(f"{key}={path!r}: every checkpoint in {directory} is damaged (step "
                                  f"{damaged[0].step}: {damaged[0].problem})")
    found = storage.listdir(path) if storage.isdir(path) else []
    raise CheckpointError(f"{key}={path!r} holds no complete checkpoint (a directory named by its step with a "
                          f"state/ subdirectory, directly or under checkpoints/); it contains: {found[:10] or 'nothing'}")


def read_metadata(step_dir: str) -> dict:
    """The JSON metadata saved with a checkpoint ({} when it has none); CheckpointError naming the file
    when it is unreadable."""
    path = os.path.join(step_dir, "metadata", "metadata")
    if not storage.isfile(path):
        return {}
    try:
        meta = json.loads(storage.read_text(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the checkpoint metadata {path} cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); the step is damaged") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"the checkpoint metadata {path} is not a JSON object; the step is damaged")
    return meta


def path_str(path) -> str:
    """'opt_state/1/0/mu/layers/wq' for a jax key path, whatever the container types."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def leaf_shapes(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """{path: (shape, dtype name)} for every array leaf of a pytree of arrays or array metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(p): (tuple(x.shape), np.dtype(x.dtype).name) for p, x in leaves}


def read_tree(step_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{path: (shape, dtype)} of the saved state, from Orbax's metadata (no array is read)."""
    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir) / "state").tree
        return leaf_shapes(tree)
    except Exception as e:  # pylint: disable=broad-except
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise CheckpointError(f"cannot read the array metadata of the checkpoint at {step_dir}/state "
                              f"({type(e).__name__}: {first}); the step is damaged") from e


def check_fits(step_dir: str, expected: dict[str, tuple[tuple[int, ...], str]], config, key: str) -> None:
    """Raises a CheckpointError naming every differing key and shape when the checkpoint does not fit."""
    saved = read_tree(step_dir)
    expected = dict(sorted(expected.items(), key=lambda kv: (not kv[0].startswith("params/"), kv[0])))
    missing = [p for p in expected if p not in saved]
    extra = sorted((p for p in saved if p not in expected and p.split("/")[0] in {q.split("/")[0] for q in expected}),
                   key=lambda p: (not p.startswith("params/"), p))
    shapes = [f"{p}: checkpoint {list(saved[p][0])} vs model {list(expected[p][0])}"
              for p in expected if p in saved and saved[p][0] != expected[p][0]]
    if not (missing or extra or shapes):
        return
    if config is not None:
        _check_experts(step_dir, config, key)
        _check_optimizer(step_dir, config, key, shapes, missing + extra)
    lines = [f"the checkpoint {step_dir} ({key}) does not fit the configured model:"]
    lines += [f"  shape differs  {s}" for s in shapes]
    missing_lines, extra_lines = _grouped(missing, expected), _grouped(extra, saved)
    lines += [f"  missing from the checkpoint  {p}" for p in missing_lines[:12]]
    lines += [f"  ... and {len(missing_lines) - 12} more missing"] if len(missing_lines) > 12 else []
    lines += [f"  not in the model  {p}" for p in extra_lines[:12]]
    lines += [f"  ... and {len(extra_lines) - 12} more not in the model"] if len(extra_lines) > 12 else []
    saved_config = read_metadata(step_dir).get("config", {}) if config is not None else {}
    differing = [f"{k}={saved_config[k]} (this run: {getattr(config, k)})" for k in model_keys.SHAPE_KEYS
                 if k in saved_config and saved_config[k] != getattr(config, k)]
    if differing:
        lines.append("  the checkpoint was written with " + ", ".join(differing))
    if missing and all(p.split("/")[0] != "params" for p in missing) and any(p.startswith("params/") for p in saved):
        lines.append("It holds parameters only (e.g. converted from Hugging Face): use load_parameters_path.")
        raise CheckpointError("\n".join(lines))
    lines.append("Use the model settings the checkpoint was written with (see `python -m maxtrain.inspect_checkpoint "
                 f"inspect {step_dir}`)" + (", or a new run_name for a different model." if key == "resume" else "."))
    raise CheckpointError("\n".join(lines))


def _check_optimizer(step_dir: str, config, key: str, shapes: list, differing: list[str]) -> None:
    """One line when only the optimizer state differs because the checkpoint was trained with another opt_type."""
    saved = read_metadata(step_dir).get("config", {}).get("opt_type", "adamw")
    if saved != config.opt_type and not shapes and all(p.startswith("opt_state/") for p in differing):
        raise CheckpointError(
            f"the checkpoint {step_dir} ({key}) holds the optimizer state of opt_type={saved}, not of "
            f"opt_type={config.opt_type}: continue it with opt_type={saved}, or start {config.opt_type} from its "
            "params with a fresh optimizer (load_parameters_path=<its step directory> and a new run_name)")


def _check_experts(step_dir: str, config, key: str) -> None:
    """A dense checkpoint for a mixture-of-experts model (or the reverse) is named as such: no
    parameter of one has a place in the other's expert or MLP weights."""
    saved = read_metadata(step_dir).get("config", {})
    if "decoder_block" not in saved:
        return
    def describe(block, experts, per_token):
        if block in config_lib.MOE_FAMILIES:
            return f"a mixture of experts ({block}, {experts} experts, {per_token} per token)"
        return f"a dense {block} model (no experts)"
    ours_moe = config.decoder_block in config_lib.MOE_FAMILIES
    theirs_moe = saved["decoder_block"] in config_lib.MOE_FAMILIES
    if ours_moe == theirs_moe:
        return
    theirs = describe(saved["decoder_block"], saved.get("num_experts", 1), saved.get("num_experts_per_tok", 1))
    ours = describe(config.decoder_block, config.num_experts, config.num_experts_per_tok)
    fix = ("train the mixture of experts from scratch (no load_parameters_path) or from a checkpoint of a "
           "mixture-of-experts family (initializing experts from a dense model, upcycling, is not implemented)"
           if ours_moe else "use the checkpoint's model: leave model_name and the model keys unset "
           "to adopt its settings, or load a dense checkpoint")
    raise CheckpointError(f"the checkpoint {step_dir} ({key}) holds {theirs}, but this run's model is {ours}: the "
                          f"weights of one have no place in the other. To go on, {fix}.")


def _grouped(paths: list[str], universe) -> list[str]:
    """Paths, with a top-level subtree that is entirely in `paths` shown once ("opt_state (27 arrays)")."""
    out, done = [], set()
    for p in paths:
        top = p.split("/")[0]
        whole = [q for q in universe if q.split("/")[0] == top]
        if top != p and len(whole) > 1 and all(q in paths for q in whole):
            if top not in done:
                out.append(f"{top} ({len(whole)} arrays)")
                done.add(top)
        else:
            out.append(p)
    return out


def check_settings(step_dir: str, config, key: str) -> None:
    """Refuses a checkpoint whose model settings (family, RoPE, norm epsilon, soft-caps, window, ...)
    differ from the configured model's: its parameters would load and silently compute something else."""
    saved = read_metadata(step_dir).get("config", {})
    differing = [f"{k}: checkpoint {saved[k]!r}, this run {getattr(config, k)!r}" for k in model_keys.SETTING_KEYS
                 if k in saved and saved[k] != getattr(config, k)]
    if differing:
        raise CheckpointError(
            f"the checkpoint {step_dir} ({key}) was written with other model settings than this run's:\n  "
            + "\n  ".join(differing) + "\nIts parameters would compute a different model. Use the checkpoint's "
            f"settings (leave the model keys unset to adopt them, or see `python -m maxtrain.inspect_checkpoint "
            f"{step_dir}`)" + (", or a new run_name to train another model." if key == "resume" else "."))


def source_of(step_dir: str) -> dict | None:
    """Where a checkpoint's model came from (a Hugging Face import: its config and assets), if recorded."""
    return read_metadata(step_dir).get("source")


def load_params(path: str, abstract_params: dict, config=None, key: str = "load_parameters_path") -> dict:
    """Only the params of a checkpoint (full or params-only), placed with `abstract_params`' shardings;
    a LoRA run's adapters are merged into them (the weights its model computed with).

    `path` is anything find_step_dir accepts; a checkpoint that does not fit is refused (check_fits).
    """
    step_dir = find_step_dir(path, key)
    check_fits(step_dir, leaf_shapes({"params": abstract_params}), config, key)
    if config is not None:
        check_settings(step_dir, config, key)
    item = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    try:
        params = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"), args=args)["params"]
    except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(f"could not load params from {step_dir}: {type(e).__name__}: {e}") from e
    adapters, lora_scale = _read_adapters(step_dir)
    if adapters is None:
        return params
    shardings = jax.tree.map(lambda x: x.sharding, abstract_params)
    return jax.jit(lambda p, a: lora.merge(p, a, lora_scale), out_shardings=shardings)(params, adapters)


def _read_adapters(step_dir: str):
    """(LoRA adapters as host arrays, their scale) of a LoRA run's checkpoint, else (None, None)."""
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir) / "state").tree
    if "lora" not in tree:
        return None, None
    saved = read_metadata(step_dir).get("config", {})
    if not saved.get("lora_rank"):
        raise CheckpointError(f"the checkpoint {step_dir} holds LoRA adapters but its metadata has no lora_rank / "
                              "lora_alpha to merge them with")
    item = {"lora": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["lora"])}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    adapters = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"), args=args)["lora"]
    return adapters, saved["lora_alpha"] / saved["lora_rank"]


def read_params(path: str) -> dict:
    """The params of a checkpoint (any path find_step_dir takes) as host numpy arrays, a LoRA run's
    adapters merged in."""
    step_dir = find_step_dir(path)
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir) / "state").tree
    if "params" not in tree:
        raise CheckpointError(f"the checkpoint {step_dir} holds no params (it has {sorted(tree)})")
    item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["params"])}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    params = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"), args=args)["params"]
    adapters, lora_scale = _read_adapters(step_dir)
    if adapters is None:
        return params
    return lora.merge_numpy(params, adapters, lora_scale)


def read_adapters(path: str) -> tuple[dict, dict]:
    """(LoRA adapters as host arrays, the saved config) of a LoRA run's checkpoint."""
    step_dir = find_step_dir(path)
    adapters, _ = _read_adapters(step_dir)
    if adapters is None:
        raise CheckpointError(f"the checkpoint {step_dir} holds no LoRA adapters (it was not trained with lora_rank > 0)")
    return adapters, read_metadata(step_dir).get("config", {})


def load_state(step_dir: str, abstract_state: dict) -> dict:
    """The whole train state of a checkpoint (not its data iterator)."""
    try:
        return ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"), abstract_state)
    except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(f"could not load the state in {step_dir}: {type(e).__name__}: {e}") from e
