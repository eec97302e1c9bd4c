"""Checkpoints with Orbax: the training state, the data iterator and run metadata, per step.

Layout (see docs/checkpoints.md):  <run>/checkpoints/<step>/{state, data, metadata}
    state     params, optimizer state, step, loss-scale state and PRNG key (Orbax PyTree, sharded)
    data      the Grain iterator state of every process (exact resume of the input)
    metadata  JSON: resolved config, git commit, installed packages, process and device counts

Saving is asynchronous by default: the arrays are copied off the device and written in the
background while training continues. Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames
it to `<step>` when complete, so a crash mid-save never leaves a checkpoint that looks complete;
leftover temporary directories are removed when the next run starts. Once Orbax has finished, each
process writes the checksums of the files it wrote into `<step>/checksums/` (checksums.py).

Which step is "the latest usable" is decided by one function, `latest_usable_step`, which the
trainer, `inspect` and the fallback all call: the newest step directory that has its state/, whose
files match their checksums and whose metadata reads. A damaged step (one that fails those checks,
or whose restore fails) is moved aside to <run>/damaged_checkpoints/<step> (never deleted), the run
says so, and resumes from the newest usable step before it.

Where a run starts (`plan_start`): its own latest checkpoint (resume), else `load_full_state_path`,
else `load_parameters_path` (params only, fresh optimizer), else a fresh init. Whatever it loads is
compared with the configured model (tree paths and shapes) before any data or compile work.

    python -m maxtrain.checkpoint inspect PATH     # step, parameter tree (shapes, dtypes), metadata
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import math
import os
import re
import subprocess
import sys

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxtrain import checksums, models, storage
from maxtrain.errors import UserError

# Config keys that describe the model; the shape keys are named in errors when a checkpoint does not fit,
# the setting keys (family, RoPE, epsilon, soft-caps, window) must equal the checkpoint's.
MODEL_KEYS = models.MODEL_KEYS
_TMP_MARK = ".orbax-checkpoint-tmp"
DAMAGED_DIR = "damaged_checkpoints"  # beside checkpoints/, where damaged steps are moved


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written, found or loaded, or does not fit; the message says what to do."""


# --------------------------------------------------------------------------------------------
# Saving and resuming this run's checkpoints
# --------------------------------------------------------------------------------------------


def check_writable(directory: str) -> None:
    """Fails early, before any training, when checkpoints could not be written to `directory`."""
    probe = os.path.join(directory, f".write-probe-{jax.process_index()}")
    if storage.is_remote(directory):  # GCS: one small object written and deleted
        try:
            storage.write_bytes(probe, b"maxtrain")
            storage.rmtree(probe)
        except Exception as e:  # pylint: disable=broad-except  (gcsfs raises OSError and HttpError variants)
            raise CheckpointError(f"cannot write checkpoints to {directory} ({type(e).__name__}: {e}). Check the "
                                  "bucket name and your credentials (gcloud auth application-default login), or "
                                  "set base_output_directory to a local path.") from None
        return
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"maxtrain")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"the checkpoint directory {directory} is not writable ({e.strerror or e}: {e.filename or directory}). "
            "Checkpoints go to <base_output_directory>/<run_name>/checkpoints: set base_output_directory to a "
            "writable place, fix the permissions or free some space, or set enable_checkpointing=false "
            "to train without saving.") from None


class Checkpointer:
    """This run's checkpoints: periodic async saves, the latest complete step, restore."""

    def __init__(self, config, log=print):
        self.config = config
        self.directory = storage.abspath(config.checkpoint_dir)
        check_writable(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if config.max_num_checkpoints_to_keep == -1 else config.max_num_checkpoints_to_keep,
            enable_async_checkpointing=config.async_checkpointing,
            create=True,
        )
        if jax.process_index() == 0:
            remove_partial_checkpoints(self.directory, log)
        self.log = log
        self.resume_step = settle_latest_step(self.directory, log)  # moves damaged steps aside
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "metadata": ocp.JsonCheckpointHandler(),
            },
        )
        self._saving = None  # step of a save whose outcome is not known yet
        self._hashing = None  # (step, thread) writing the checksums of a finished save
        self._hash_error = None

    def latest_step(self) -> int | None:
        """The latest usable step (damaged ones were moved aside when this Checkpointer started)."""
        return self.resume_step

    def save(self, step: int, state: dict, data_iterator, metadata: dict) -> None:
        metadata = {**metadata, "step": step, "saved_at": _now()}
        self.wait()  # Orbax would wait for the previous save anyway; this reports its failure as its own
        with self._reporting(step):
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(data_iterator),
                metadata=ocp.args.JsonSave(metadata),
            ), force=True)
        self._saving = step

    def poll(self) -> None:
        """Raises a CheckpointError as soon as a background save has failed (cheap; call every step).
        Once a save has finished, starts writing its checksums in a background thread."""
        if self._saving is not None and not self.manager.is_saving_in_progress():
            self.wait(join=False)  # returns at once; raises if that save failed

    def restore(self, step: int, abstract_state: dict, data_iterator) -> dict:
        """Restores the state (with the shardings of `abstract_state`) and, in place, the data iterator.

        A step that does not restore is damaged: it is moved aside and the newest usable step before
        it is restored instead (the same fallback as a checksum mismatch). Returns the state; the
        step restored is `self.resume_step`.
        """
        import threading  # pylint: disable=import-outside-toplevel

        while True:
            error, step_dir, found = None, os.path.join(self.directory, str(step)), {}
            # The files are hashed while Orbax reads them (the page cache serves both): the check costs
            # little more than the restore alone. A mismatch discards what was restored.
            verifier = threading.Thread(target=lambda d=step_dir: found.update(
                health=check_step(d, (jax.process_index(), jax.process_count()))), daemon=True)
            verifier.start()
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=grain.checkpoint.CheckpointRestore(data_iterator),
                ))
            except Exception as e:  # pylint: disable=broad-except
                error = (f"{step_dir}: it does not restore ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300] if str(e) else ''})")
            verifier.join()
            health = found.get("health")
            if health is not None and not health.usable:
                error = health.problem  # names the file that does not match its checksum
            if not any(_all_values(1 if error else 0)):
                return restored.state
            damaged = {step: error or f"{step_dir}: another process found it damaged"}
            self.resume_step = settle_latest_step(self.directory, self.log, known_damaged=damaged)
            self.manager.reload()
            step = self.resume_step
            self.log(f"Resuming from {self.directory}/{step}")

    def intact(self, step: int) -> bool:
        """Whether every file of the step matches its checksum, on every process' share of them (a damaged
        step is left to restore(), which falls back from it)."""
        health = check_step(os.path.join(self.directory, str(step)), (jax.process_index(), jax.process_count()))
        return all(_all_values(1 if health.usable else 0))

    def wait(self, join: bool = True) -> None:
        """Waits for the save in flight; then writes its checksums (in the background unless `join`)."""
        with self._reporting(self._saving):
            self.manager.wait_until_finished()
        if self._saving is not None:
            step, self._saving = self._saving, None
            self._start_checksums(step)
        if join:
            self._join_checksums()

    def _start_checksums(self, step: int) -> None:
        import threading  # pylint: disable=import-outside-toplevel

        self._join_checksums()
        if storage.is_remote(self.directory):  # GCS checks each object's CRC32C on upload itself
            return
        step_dir = os.path.join(self.directory, str(step))

        def write():
            try:
                checksums.write(step_dir, jax.process_index(), jax.process_count())
            except OSError as e:  # the step itself is complete: it stays usable, unverified
                self._hash_error = f"could not write the checksums of {step_dir}: {e}"
        self._hashing = threading.Thread(target=write, name=f"checksums-{step}", daemon=True)
        self._hashing.start()

    def _join_checksums(self) -> None:
        if self._hashing is not None:
            self._hashing.join()
            self._hashing = None
        if self._hash_error:
            self.log(f"warning: {self._hash_error}; that step is kept, unverified")
            self._hash_error = None

    def close(self) -> None:
        self.wait()
        self.manager.close()

    def _reporting(self, step):
        return _SaveErrors(self, step)


class _SaveErrors:
    """Turns any failure of a save into a CheckpointError that says what is still safe on disk."""

    def __init__(self, checkpointer: Checkpointer, step):
        self.checkpointer, self.step = checkpointer, step

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or isinstance(error, CheckpointError) or not isinstance(error, Exception):
            return False
        # Orbax's background threads go on logging this failure, with tracebacks, while the process
        # exits; the error below says it all, so it is the last thing printed.
        for name in ("absl", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        directory = self.checkpointer.directory
        intact = complete_steps(directory)
        # TensorStore reports OS errors inside its own message: "... [os_error_code='28']".
        found = re.search(r"os_error_code='?(\d+)", str(error))
        code = getattr(error, "errno", None) or (int(found.group(1)) if found else None)
        raise CheckpointError(
            f"saving checkpoint {self.step} to {directory} failed: {os.strerror(code) if code else 'write error'}. "
            f"Training stopped. Complete checkpoints on disk: {intact or 'none'}. Free disk space or fix the "
            "directory's permissions, then re-run the same command to resume"
            + (f" from step {intact[-1]}" if intact else "") + f". ({type(error).__name__}: {error})") from error


def abstract_like(state: dict, shardings: dict) -> dict:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


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


def check_step(step_dir: str, share: tuple[int, int] = (0, 1), contents: bool = True) -> StepHealth:
    """Is this step usable? Its state/ must exist, its files match their checksums, its metadata read.
    (The answer is remembered while no file of the step changes its size or modification time.)
    On gs://, where checksums are not written (GCS checks every object's CRC32C itself), a step is
    usable when its state/, its commit_success.txt and its metadata are there and readable."""
    if storage.is_remote(step_dir):
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


def _damaged_root(checkpoints_dir: str) -> str:
    return os.path.join(os.path.dirname(storage.abspath(checkpoints_dir).rstrip("/")), DAMAGED_DIR)


def move_aside(health: StepHealth) -> str:
    """Moves a damaged step to <run>/damaged_checkpoints/<step>[.N] (never deletes it); returns where."""
    root = _damaged_root(os.path.dirname(health.step_dir))
    storage.makedirs(root)
    target, n = os.path.join(root, str(health.step)), 1
    while storage.exists(target):
        n += 1
        target = os.path.join(root, f"{health.step}.{n}")
    storage.move(health.step_dir, target)
    return target


def _all_values(value: int) -> list[int]:
    from maxtrain import distributed  # pylint: disable=import-outside-toplevel

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
        newest = max(_all_values(newest_damaged))
        if newest < 0:
            if usable is None and moved:
                raise CheckpointError(
                    f"no usable checkpoint is left in {checkpoints_dir}: every step was damaged (step {moved[-1].step}: "
                    f"{moved[-1].problem}) and was moved to {_damaged_root(checkpoints_dir)}. Re-run the same command "
                    "to start from step 0, or move a step back from there.")
            return usable.step if usable else None
        mine = next((h for h in damaged if h.step == newest), None)
        if mine is None:  # another process found it
            mine = StepHealth(newest, os.path.join(checkpoints_dir, str(newest)), "damaged",
                              known.get(newest, "another process found a file that does not match its checksum"))
        if mine.problem and index != 0:
            print(f"process {index}: checkpoint step {newest} is damaged: {mine.problem}", file=sys.stderr, flush=True)
        _all_values(0)  # everyone is done reading before process 0 moves it
        moved.append(mine)
        if index == 0:
            target = move_aside(mine)
            log(f"checkpoint step {newest} is damaged: {mine.problem}. Moved it to {target} (nothing is deleted); "
                "resuming from the newest usable step before it")
        _all_values(0)
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
                                  f"maxtrain.checkpoint inspect {os.path.dirname(path)}).")
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
    lines = [f"the checkpoint {step_dir} ({key}) does not fit the configured model:"]
    lines += [f"  shape differs  {s}" for s in shapes]
    missing_lines, extra_lines = _grouped(missing, expected), _grouped(extra, saved)
    lines += [f"  missing from the checkpoint  {p}" for p in missing_lines[:12]]
    lines += [f"  ... and {len(missing_lines) - 12} more missing"] if len(missing_lines) > 12 else []
    lines += [f"  not in the model  {p}" for p in extra_lines[:12]]
    lines += [f"  ... and {len(extra_lines) - 12} more not in the model"] if len(extra_lines) > 12 else []
    saved_config = read_metadata(step_dir).get("config", {}) if config is not None else {}
    differing = [f"{k}={saved_config[k]} (this run: {getattr(config, k)})" for k in models.SHAPE_KEYS
                 if k in saved_config and saved_config[k] != getattr(config, k)]
    if differing:
        lines.append("  the checkpoint was written with " + ", ".join(differing))
    if missing and all(p.split("/")[0] != "params" for p in missing) and any(p.startswith("params/") for p in saved):
        lines.append("It holds parameters only (e.g. converted from Hugging Face): use load_parameters_path.")
        raise CheckpointError("\n".join(lines))
    lines.append("Use the model settings the checkpoint was written with (see `python -m maxtrain.checkpoint "
                 f"inspect {step_dir}`)" + (", or a new run_name for a different model." if key == "resume" else "."))
    raise CheckpointError("\n".join(lines))


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
    differing = [f"{k}: checkpoint {saved[k]!r}, this run {getattr(config, k)!r}" for k in models.SETTING_KEYS
                 if k in saved and saved[k] != getattr(config, k)]
    if differing:
        raise CheckpointError(
            f"the checkpoint {step_dir} ({key}) was written with other model settings than this run's:\n  "
            + "\n  ".join(differing) + "\nIts parameters would compute a different model. Use the checkpoint's "
            f"settings (leave the model keys unset to adopt them, or see `python -m maxtrain.checkpoint inspect "
            f"{step_dir}`)" + (", or a new run_name to train another model." if key == "resume" else "."))


def source_of(step_dir: str) -> dict | None:
    """Where a checkpoint's model came from (a Hugging Face import: its config and assets), if recorded."""
    return read_metadata(step_dir).get("source")


def adopt_model_settings(config, log=print):
    """With load_parameters_path / load_full_state_path and no model chosen by the user (no model_name and
    no model key in their YAML or overrides), the checkpoint's model settings, and its tokenizer when
    tokenizer_path is unset. Otherwise config unchanged (the fit and settings checks compare them later)."""
    key = "load_parameters_path" if config.load_parameters_path else "load_full_state_path"
    path = getattr(config, key)
    given = set(config.given_keys)
    if not path or given & (set(models.MODEL_KEYS) | {"model_name"}):
        return config
    step_dir = find_step_dir(path, key)
    meta = read_metadata(step_dir)
    saved = meta.get("config", {})
    keys = {k: saved[k] for k in models.MODEL_KEYS if k in saved}
    if not keys:
        return config
    from maxtrain import config as config_lib  # pylint: disable=import-outside-toplevel

    changes = dict(keys, model_name=saved.get("model_name") or os.path.basename(os.path.dirname(os.path.dirname(step_dir))))
    tokenizer = saved.get("tokenizer_path") or (meta.get("source") or {}).get("assets_dir")
    if "tokenizer_path" not in given and tokenizer and os.path.exists(tokenizer):
        changes["tokenizer_path"] = tokenizer
    config = config_lib.revalidate(config.replace(**changes))
    log(f"using the model settings of {step_dir} ({config.decoder_block}, {models.num_params(config) / 1e6:,.1f}M "
        "params)" + (f" and its tokenizer {changes['tokenizer_path']}" if "tokenizer_path" in changes else ""))
    return config


def load_params(path: str, abstract_params: dict, config=None, key: str = "load_parameters_path") -> dict:
    """Only the params of a checkpoint (full or params-only), placed with `abstract_params`' shardings.

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
        return ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"), args=args)["params"]
    except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(f"could not load params from {step_dir}: {type(e).__name__}: {e}") from e


def read_params(path: str) -> dict:
    """The params of a checkpoint (any path find_step_dir takes) as host numpy arrays."""
    step_dir = find_step_dir(path)
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir) / "state").tree
    if "params" not in tree:
        raise CheckpointError(f"the checkpoint {step_dir} holds no params (it has {sorted(tree)})")
    item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["params"])}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"), args=args)["params"]


def load_state(step_dir: str, abstract_state: dict) -> dict:
    """The whole train state of a checkpoint (not its data iterator)."""
    try:
        return ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"), abstract_state)
    except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(f"could not load the state in {step_dir}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# Where a run starts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Start:
    kind: str                  # "fresh" | "resume" | "full_state" | "parameters"
    step_dir: str | None = None
    step: int | None = None


def plan_start(config, checkpointer: Checkpointer | None, abstract_state: dict, log=print) -> Start:
    """Decides where the run starts and checks that the checkpoint fits, reading only metadata."""
    latest = checkpointer.latest_step() if checkpointer else None
    if latest is not None:
        start = Start("resume", os.path.join(checkpointer.directory, str(latest)), latest)
        if config.load_parameters_path or config.load_full_state_path:
            log("this run has its own checkpoints, so it resumes from them and ignores load_parameters_path / "
                "load_full_state_path")
        check_fits(start.step_dir, leaf_shapes(abstract_state), config, "resume")
        check_settings(start.step_dir, config, "resume")
        _log_config_changes(start.step_dir, config, log)
        return start
    if config.load_full_state_path:
        step_dir = find_step_dir(config.load_full_state_path, "load_full_state_path")
        check_fits(step_dir, leaf_shapes(abstract_state), config, "load_full_state_path")
        check_settings(step_dir, config, "load_full_state_path")
        return Start("full_state", step_dir)
    if config.load_parameters_path:
        step_dir = find_step_dir(config.load_parameters_path, "load_parameters_path")
        check_fits(step_dir, leaf_shapes({"params": abstract_state["params"]}), config, "load_parameters_path")
        check_settings(step_dir, config, "load_parameters_path")
        return Start("parameters", step_dir)
    return Start("fresh")


def initial_state(start: Start, checkpointer, abstract_state: dict, init, key, data_iterator, log=print) -> dict:
    """The train state to start from; `abstract_state` carries the target shardings."""
    if start.kind == "resume":
        log(f"Resuming from {start.step_dir}")
        return checkpointer.restore(start.step, abstract_state, data_iterator)
    if start.kind == "full_state":
        log(f"Loading the full state (params, optimizer, step) from {start.step_dir}")
        return load_state(start.step_dir, abstract_state)
    state = init(key)
    if start.kind == "parameters":
        log(f"Loading params from {start.step_dir} (fresh optimizer state, step 0)")
        state = {**state, "params": load_params(start.step_dir, abstract_state["params"])}  # checked in plan_start
    return state


def _log_config_changes(step_dir: str, config, log) -> None:
    saved = read_metadata(step_dir).get("config", {})
    ignore = {"run_name_was_generated", "config_path", "given_keys"}
    changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in config.to_dict().items()
               if k in saved and k not in ignore and saved[k] != v]
    if changed:
        log("resuming with changed settings: " + "; ".join(changed))


# --------------------------------------------------------------------------------------------
# Run metadata
# --------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_state() -> dict:
    """The commit of the maxtrain source tree and whether it has uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"sha": "unknown (not a git checkout)", "dirty": None}


def installed_packages() -> list[str]:
    """`pip freeze` of this environment (name==version, sorted), read without running pip."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = f"{name}=={dist.version}"
    return [found[k] for k in sorted(found)]


# --------------------------------------------------------------------------------------------
# python -m maxtrain.checkpoint inspect PATH
# --------------------------------------------------------------------------------------------


def describe(path: str) -> str:
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
        lines.append(f"  damaged step {h.step}: {h.problem} (a resume moves it to {_damaged_root(parent)})")
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
            lines.append("  model: " + " ".join(f"{k}={config[k]}" for k in MODEL_KEYS if k in config))
        if "run_name" in config:
            lines.append(f"  run: run_name={config['run_name']} steps={config.get('steps')} "
                         f"seed={config.get('seed')} dataset_type={config.get('dataset_type')}")
        if "packages" in meta:
            lines.append(f"  packages: {len(meta['packages'])} (" + ", ".join(
                p for p in meta["packages"] if p.split("==")[0].lower() in ("jax", "orbax-checkpoint", "grain", "optax"))
                + ")")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "inspect":
        raise CheckpointError("usage: python -m maxtrain.checkpoint inspect PATH   (a step, checkpoints or run "
                              "directory)")
    print(describe(argv[1]))
    return 0


if __name__ == "__main__":
    from maxtrain.errors import run_cli  # pylint: disable=ungrouped-imports

    sys.exit(run_cli("maxtrain.checkpoint", main))
