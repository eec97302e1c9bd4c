"""A compiled train step saved to a file (`compiled_trainstep_file`), and loaded by train.py instead of compiling.

    python -m maxtrain.train_compile configs/base.yml compile_topology=v5p-128 compiled_trainstep_file=step.bin ...
    python -m maxtrain.train configs/base.yml compiled_trainstep_file=step.bin ...   # on the v5p-128 itself

The file holds XLA's serialized executable and, to refuse one that is not the step this run
would compile, a fingerprint of the lowered program (its StableHLO text: the model, shapes,
shardings, optimizer and schedule are all in it), the config it was compiled from, the device
kind and count, and the jax version. train.py lowers its own step (seconds, no compile) and loads
the file only when the fingerprints agree; otherwise it stops and names the config keys that differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle

import jax

from maxtrain.errors import UserError

FORMAT = "maxtrain-compiled-step-1"

# Keys that do not change the compiled step: where a run writes, what it reads, how often it logs.
# A difference in any other key is reported as a likely cause when the fingerprints differ.
_IRRELEVANT = ("run_name", "run_dir", "checkpoint_dir", "tensorboard_dir", "metadata_dir", "cache_dir",
               "base_output_directory", "config_path", "given_keys", "run_name_was_generated",
               "compiled_trainstep_file", "compile_topology", "compile_topology_num_slices")


class ExecutableError(UserError, ValueError):
    """A compiled step file that cannot be used for this run; the message says why and what to do."""


def fingerprint(lowered) -> str:
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _devices_of(run) -> tuple[str, int]:
    devices = list(run.mesh.devices.flat)
    return devices[0].device_kind, len(devices)


@contextlib.contextmanager
def compiled_afresh():
    """XLA compiles the step to be saved rather than loading it from JAX's persistent compilation cache
    (JAX_COMPILATION_CACHE_DIR): on CPU, an executable loaded from that cache serializes into a file whose
    step fails when it runs (JaxRuntimeError "NOT_FOUND: Function ... not found"; jax 0.10.2)."""
    from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel

    if not (jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache):
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # the cache is looked up once per process; forget that it was on
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def save(path: str, run, lowered, compiled) -> int:
    """Writes the compiled step of `run` to `path` (atomically); returns its size in bytes."""
    from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    kind, count = _devices_of(run)
    record = {"format": FORMAT, "payload": payload, "in_tree": in_tree, "out_tree": out_tree,
              "fingerprint": fingerprint(lowered), "config": run.config.to_dict(), "device_kind": kind,
              "num_devices": count, "platform": run.rt.backend, "jax_version": jax.__version__}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return os.path.getsize(path)


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise ExecutableError(f"compiled_trainstep_file={path!r} does not exist. Write it with python -m "
                              "maxtrain.train_compile <the same config> compiled_trainstep_file=PATH, or unset it")
    try:
        with open(path, "rb") as f:
            record = pickle.load(f)
    except Exception as error:  # a truncated or foreign file: say so, whatever unpickling raised
        raise ExecutableError(f"compiled_trainstep_file={path!r} is not a compiled step written by "
                              f"maxtrain.train_compile ({type(error).__name__}: {error}); write it again") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ExecutableError(f"compiled_trainstep_file={path!r} is not a compiled step written by this version of "
                              "maxtrain.train_compile; write it again")
    return record


def _differing_keys(saved: dict, config) -> list[str]:
    current = config.to_dict()
    keys = sorted((set(saved) | set(current)) - set(_IRRELEVANT))
    return [f"{k}={saved.get(k)!r} there, {current.get(k)!r} here" for k in keys if saved.get(k) != current.get(k)]


def load(path: str, run):
    """The compiled step saved at `path`, checked to be exactly the step `run` would compile (for
    its abstract state and batch, which the real ones match); raises ExecutableError otherwise."""
    from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel

    record = _read(path)
    kind, count = _devices_of(run)
    if (record["device_kind"], record["num_devices"]) != (kind, count):
        raise ExecutableError(
            f"compiled_trainstep_file={path!r} was compiled for {record['num_devices']} x {record['device_kind']}, "
            f"but this run has {count} x {kind}. Compile it for this machine (train_compile with the matching "
            "compile_topology), or unset compiled_trainstep_file")
    if record["jax_version"] != jax.__version__:
        raise ExecutableError(f"compiled_trainstep_file={path!r} was compiled with jax {record['jax_version']}, "
                              f"this is jax {jax.__version__}; compile it again with this jax, or unset it")
    if record["fingerprint"] != fingerprint(run.lower()):
        differing = _differing_keys(record["config"], run.config)
        raise ExecutableError(
            f"compiled_trainstep_file={path!r} holds a different train step than this run's "
            + (f"(config: {'; '.join(differing[:6])}{' ...' if len(differing) > 6 else ''})" if differing
               else "(same config, so the code or an installed package changed)")
            + ". Compile it again with the same config, or unset compiled_trainstep_file")
    return serialize_executable.deserialize_and_load(record["payload"], record["in_tree"], record["out_tree"],
                                                     execution_devices=list(run.mesh.devices.flat))
