"""Checkpoints with Orbax: saving and resuming this run's checkpoints, where a run starts, run metadata.

Layout (see docs/checkpoints.md):  <run>/checkpoints/<step>/{state, data, metadata}
    state     params, optimizer state, step, loss-scale state and PRNG key (Orbax PyTree, sharded)
    data      the Grain iterator state of every process (exact resume of the input)
    metadata  JSON: resolved config, git commit, installed packages, process and device counts

Saving is asynchronous by default: the arrays are copied off the device and written in the
background while training continues. Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames
it to `<step>` when complete, so a crash mid-save never leaves a checkpoint that looks complete;
leftover temporary directories are removed when the next run starts. Once Orbax has finished, each
process writes the checksums of the files it wrote into `<step>/checksums/` (checksums.py).

Finding, checking and reading checkpoints, this run's or another's (the latest usable step, moving a
damaged step aside, loading params or the whole state, CheckpointError) is files.py. A
resume starts from the latest usable step, and a step whose restore fails is moved aside like one
that fails its checksums (`Checkpointer.restore`).

Where a run starts (`plan_start`): its own latest checkpoint (resume), else `load_full_state_path`,
else `load_parameters_path` (params only, fresh optimizer), else a fresh init. Whatever it loads is
compared with the configured model (tree paths and shapes) before any data or compile work.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import time

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml

from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.models import model_keys
from maxtrain.checkpointing import checksums
from maxtrain.checkpointing.files import (CheckpointError, all_values, check_fits, check_settings, check_step,
                                          complete_steps, find_step_dir, leaf_shapes, load_params, load_state, read_metadata,
                                          remove_partial_checkpoints, settle_latest_step, source_of)
from maxtrain.data import elastic

# Config keys that describe the model; the shape keys are named in errors when a checkpoint does not fit,
# the setting keys (family, RoPE, epsilon, soft-caps, window) must equal the checkpoint's.
MODEL_KEYS = model_keys.MODEL_KEYS
TOKENIZER_COPY = "tokenizer"  # <run>/metadata/tokenizer/: the files of the run's tokenizer (run_metadata)


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
        metadata = {**metadata, "step": step, "saved_at": now()}
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
        Saved by another number of processes, the saved iterator states are merged (data/elastic.py).

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
            saved_by = elastic.saved_process_count(step_dir)
            merging = saved_by is not None and saved_by != jax.process_count()
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if not merging:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:  # pylint: disable=broad-except
                error = (f"{step_dir}: it does not restore ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300] if str(e) else ''})")
            verifier.join()
            health = found.get("health")
            if health is not None and not health.usable:
                error = health.problem  # names the file that does not match its checksum
            if not any(all_values(1 if error else 0)):
                if merging:  # the step is intact: its per-process input positions merged for this count
                    elastic.restore(os.path.join(step_dir, "data"), data_iterator, self.config,
                                    jax.process_index(), jax.process_count())
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
        return all(all_values(1 if health.usable else 0))

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
# Where a run starts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Start:
    kind: str                  # "fresh" | "resume" | "full_state" | "parameters"
    step_dir: str | None = None
    step: int | None = None
    elastic: str = ""          # resuming on other processes, devices or mesh: the summary's line (elastic.py)


def plan_start(config, checkpointer: Checkpointer | None, abstract_state: dict, log=print) -> Start:
    """Decides where the run starts and checks that the checkpoint fits, reading only metadata."""
    latest = checkpointer.latest_step() if checkpointer else None
    if latest is not None:
        start = Start("resume", os.path.join(checkpointer.directory, str(latest)), latest)
        if config.load_parameters_path or config.load_full_state_path:
            log("this run has its own checkpoints, so it resumes from them and ignores load_parameters_path / "
                "load_full_state_path")
        same_objective(start.step_dir, config, "resume")
        check_fits(start.step_dir, leaf_shapes(abstract_state), config, "resume")
        check_settings(start.step_dir, config, "resume")
        _log_config_changes(start.step_dir, config, log)
        return dataclasses.replace(start, elastic=_elastic_change(start.step_dir, config))
    if config.load_full_state_path:
        step_dir = find_step_dir(config.load_full_state_path, "load_full_state_path")
        same_objective(step_dir, config, "load_full_state_path")
        check_fits(step_dir, leaf_shapes(abstract_state), config, "load_full_state_path")
        check_settings(step_dir, config, "load_full_state_path")
        return Start("full_state", step_dir)
    if config.load_parameters_path:
        step_dir = find_step_dir(config.load_parameters_path, "load_parameters_path")
        check_fits(step_dir, leaf_shapes({"params": abstract_state["params"]}), config, "load_parameters_path")
        check_settings(step_dir, config, "load_parameters_path")
        return Start("parameters", step_dir)
    return Start("fresh")


def same_objective(step_dir: str, config, source: str) -> None:
    """A run's whole state (its optimizer's moments, its frozen model, its data position) continues only under the
    objective that wrote it: another objective is a new stage, started from the parameters. Refused before any
    restore, so that no healthy step is taken for a damaged one."""
    objectives = config_lib.objectives
    saved = objectives.saved_objective(read_metadata(step_dir).get("config", {}))  # use_* -> objective
    saved = {"objective": "lm", "distill_data": config_lib.defaults()["distill_data"],
             **{k: v for k, v in saved.items() if k in ("objective", "distill_data")}}
    if saved["objective"] not in objectives.OBJECTIVES:
        return  # an objective this version does not know: check_fits says what does not fit
    was, now = objectives.running(saved), objectives.running(config)
    if was == now:
        return
    if source == "resume":
        raise CheckpointError(
            f"this run's checkpoint {step_dir} was trained with {was}, and this run has {now}: the objective changed. "
            f"Start the new stage as a new run from its parameters (run_name=<a new name> load_parameters_path="
            f"{step_dir}), or resume this run with {was}")
    raise CheckpointError(
        f"load_full_state_path={step_dir} holds the state of a run with {was} (its optimizer state, frozen model and "
        f"data position), and this run has {now}: the objective changed. Start the new stage from its parameters: "
        f"load_parameters_path={step_dir} in place of load_full_state_path")


def _elastic_change(step_dir: str, config) -> str:
    """The summary line of a resume on other processes, devices or mesh; refuses, before any work, an
    input whose saved per-process positions cannot be merged for another process count."""
    saved_by = elastic.saved_process_count(step_dir)
    if saved_by is not None and saved_by != jax.process_count():
        reason = elastic.unsupported(config)
        if reason:
            raise CheckpointError(f"{step_dir} was saved by {saved_by} processes and this run has "
                                  f"{jax.process_count()}, but the input cannot continue exactly on another number of "
                                  f"processes: {reason}.")
    return elastic.describe_change(read_metadata(step_dir), config, jax.process_count())


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
        params = load_params(start.step_dir, abstract_state["params"])  # checked in plan_start
        state = {**state, "params": params}
        if "reference" in state:  # DPO: the frozen reference is the starting params (its own buffers)
            state["reference"] = jax.tree.map(jnp.copy, params)
    return state


def _log_config_changes(step_dir: str, config, log) -> None:
    saved = config_lib.objectives.saved_objective(read_metadata(step_dir).get("config", {}))  # use_* -> objective
    ignore = {"run_name_was_generated", "config_path", "given_keys", "preset_keys"}
    changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in config.to_dict().items()
               if k in saved and k not in ignore and saved[k] != v]
    if changed:
        log("resuming with changed settings: " + "; ".join(changed))


# --------------------------------------------------------------------------------------------
# Run metadata
# --------------------------------------------------------------------------------------------


def now() -> str:
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
# python -m maxtrain.inspect_checkpoint PATH
# --------------------------------------------------------------------------------------------


def run_metadata(config, rt, start: Start, tokenizer=None) -> dict:
    """The run's metadata, saved in every checkpoint, and written by process 0 as readable files to
    <run>/metadata (config.yml, run.json, requirements.txt, and tokenizer/: a copy of the files of the
    run's tokenizer, which an export writes for transformers)."""
    source = source_of(start.step_dir) if start.step_dir else None
    meta = {"config": config.to_dict(), "runtime": {"dtype": rt.dtype.name, "attention": rt.attention,
                                                    "remat_policy": rt.remat_policy,
                                                    "scan_layers": rt.scan_layers(config)},
            **({"source": source} if source else {}),  # a model imported from Hugging Face: kept for export
            "jax_version": jax.__version__, "num_processes": jax.process_count(), "num_devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind, "git": git_state(),
            "command": sys.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "packages": installed_packages()}
    if tokenizer is not None:
        meta["tokenizer"] = {"kind": tokenizer.kind, "checksum": tokenizer.checksum, "path": tokenizer.path,
                             "copy": os.path.join(config.metadata_dir, TOKENIZER_COPY)}
    if jax.process_index() == 0:
        directory = config.metadata_dir  # local or gs://
        for name, data in (tokenizer.files.items() if tokenizer is not None else ()):
            storage.write_bytes(os.path.join(directory, TOKENIZER_COPY, name), data)
        storage.write_text(os.path.join(directory, "config.yml"), yaml.safe_dump(config.to_dict(), sort_keys=False))
        storage.write_text(os.path.join(directory, "run.json"),
                           json.dumps({k: v for k, v in meta.items() if k not in ("config", "packages")}, indent=2))
        storage.write_text(os.path.join(directory, "requirements.txt"), "\n".join(meta["packages"]) + "\n")
    return meta
