"""A compiled train step saved to a file (`compiled_trainstep_file`), and loaded by train.py instead of compiling.

    python -m maxtrain.train_compile configs/base.yml compile_topology=v5p-128 compiled_trainstep_file=step.bin ...
    python -m maxtrain.train configs/base.yml compiled_trainstep_file=step.bin ...   # on the v5p-128 itself

The file is plain data, read without running any Python code from it (no pickle):

    MAGIC                      b"maxtrain-compiled-step\\n"
    8 bytes                    the header's length, little-endian
    header                     UTF-8 JSON: format version, fingerprint, config, device kind and count,
                               platform, jax version, the step's input and output tree structures as
                               text, and the executable's size and sha256
    executable                 XLA's serialized executable (PjRt's own binary format)

To refuse a file that is not the step this run would compile, the header holds a fingerprint of the
lowered program (its StableHLO text: the model, shapes, shardings, optimizer and schedule are all in
it), the config it was compiled from, the device kind and count, and the jax version. train.py lowers
its own step (seconds, no compile) and loads the file only when all of them agree; otherwise it
stops and names the config keys that differ. The Python side of the step (the input and output tree
structures, shardings and layouts) is rebuilt from that lowering, as if compiling it; only XLA's
compilation is replaced by the executable of the file, and its tree structures must match the header's.

Like any program, the executable itself is native code for the devices (and, on CPU, for the host):
use files written by your own train_compile. What the format rules out is a file that runs Python
code as it is read (the earlier pickle format, jax.experimental.serialize_executable's, could).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct

import jax

from maxtrain.errors import UserError

MAGIC = b"maxtrain-compiled-step\n"
FORMAT = 2  # 1 was a pickle (never read now)
_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 1 << 26  # the config and two tree structures: kilobytes; a larger length is a damaged file
_PICKLE_PROTOCOL_OPCODE = 0x80

# Keys that do not change the compiled step: where a run writes, what it reads, how often it logs.
# A difference in any other key is reported as a likely cause when the fingerprints differ.
_IRRELEVANT = ("run_name", "run_dir", "checkpoint_dir", "tensorboard_dir", "metadata_dir", "cache_dir",
               "base_output_directory", "config_path", "given_keys", "preset_keys", "run_name_was_generated",
               "compiled_trainstep_file", "compile_topology", "compile_topology_num_slices")


class ExecutableError(UserError, ValueError):
    """A compiled step file that cannot be used for this run; the message says why and what to do."""


def fingerprint(lowered) -> str:
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _devices_of(run) -> tuple[str, int]:
    devices = list(run.mesh.devices.flat)
    return devices[0].device_kind, len(devices)


def _plain(config) -> dict:
    """The config as JSON reads it back (tuples become lists), so saved and current values compare equal."""
    return json.loads(json.dumps(config.to_dict(), default=str))


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


def _serialized(compiled) -> bytes:
    """XLA's own bytes of a compiled step's executable (a loaded one, or one compiled for a topology)."""
    xla_executable = compiled.runtime_executable()
    if hasattr(xla_executable, "serialize"):
        return xla_executable.serialize()
    return xla_executable.client.serialize_executable(xla_executable)


def save(path: str, run, lowered, compiled) -> int:
    """Writes the compiled step of `run` to `path` (atomically); returns its size in bytes."""
    payload = _serialized(compiled)
    kind, count = _devices_of(run)
    header = {"format": FORMAT, "fingerprint": fingerprint(lowered), "config": _plain(run.config),
              "device_kind": kind, "num_devices": count, "platform": run.rt.backend, "jax_version": jax.__version__,
              "in_tree": str(lowered.in_tree), "out_tree": str(lowered.out_tree),
              "executable_bytes": len(payload), "executable_sha256": hashlib.sha256(payload).hexdigest()}
    header_bytes = json.dumps(header).encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + _LENGTH.pack(len(header_bytes)) + header_bytes)
        f.write(payload)
    os.replace(tmp, path)
    return os.path.getsize(path)


def _not_ours(path: str, why: str) -> ExecutableError:
    return ExecutableError(f"compiled_trainstep_file={path!r} is not a compiled step written by "
                           f"maxtrain.train_compile ({why}); write it again with python -m maxtrain.train_compile")


def read(path: str) -> tuple[dict, bytes]:
    """(header, executable bytes) of a compiled step file; its bytes are only parsed, never run."""
    if not os.path.isfile(path):
        raise ExecutableError(f"compiled_trainstep_file={path!r} does not exist. Write it with python -m "
                              "maxtrain.train_compile <the same config> compiled_trainstep_file=PATH, or unset it")
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + _LENGTH.size)
        if not start.startswith(MAGIC):
            if start[:1] == bytes([_PICKLE_PROTOCOL_OPCODE]):
                raise _not_ours(path, "it is a pickle, as an older train_compile wrote them; pickles are never "
                                      "loaded, since reading one can run any code")
            raise _not_ours(path, "it does not start with the format's marker")
        if len(start) < len(MAGIC) + _LENGTH.size:
            raise _not_ours(path, "it ends inside its header")
        (length,) = _LENGTH.unpack(start[len(MAGIC):])
        if length > _MAX_HEADER_BYTES:
            raise _not_ours(path, f"its header length {length} is not plausible")
        header_bytes = f.read(length)
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _not_ours(path, "its header is not JSON") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            found = header.get("format") if isinstance(header, dict) else None
            raise _not_ours(path, f"format {found!r}, this maxtrain reads format {FORMAT}")
        payload = f.read()
    expected = ("fingerprint", "config", "device_kind", "num_devices", "jax_version", "in_tree", "out_tree",
                "executable_bytes", "executable_sha256")
    missing = [k for k in expected if k not in header]
    if missing:
        raise _not_ours(path, f"its header lacks {', '.join(missing)}")
    if len(payload) != header["executable_bytes"] or hashlib.sha256(payload).hexdigest() != header["executable_sha256"]:
        raise ExecutableError(f"compiled_trainstep_file={path!r} is damaged: its executable has {len(payload)} bytes "
                              f"and another checksum than the {header['executable_bytes']} bytes its header records "
                              "(a truncated or altered copy). Copy it again, or write it again with train_compile")
    return header, payload


def _differing_keys(saved: dict, config) -> list[str]:
    current = _plain(config)
    keys = sorted((set(saved) | set(current)) - set(_IRRELEVANT))
    return [f"{k}={saved.get(k)!r} there, {current.get(k)!r} here" for k in keys if saved.get(k) != current.get(k)]


@contextlib.contextmanager
def _xla_compilation_replaced_by(payload: bytes):
    """Inside: JAX's compilation of a lowered program returns the executable deserialized from `payload` by
    XLA (jax._src.compiler.compile_or_get_cached, which jax 0.10-0.12 call for every compile, is swapped
    for that). Everything JAX builds around the executable (shardings, layouts, trees) is built as usual."""
    from jax._src import compiler  # pylint: disable=import-outside-toplevel

    original = compiler.compile_or_get_cached

    def from_file(backend, computation, devices, compile_options, host_callbacks, executable_devices,
                  pgle_profiler=None):
        del computation, devices, host_callbacks, pgle_profiler
        return backend.deserialize_executable(payload, executable_devices, compile_options)

    compiler.compile_or_get_cached = from_file
    try:
        yield
    finally:
        compiler.compile_or_get_cached = original


def load(path: str, run, lowered=None):
    """The compiled step saved at `path`, checked to be exactly the step `run` would compile (for
    its abstract state and batch, which the real ones match); raises ExecutableError otherwise."""
    header, payload = read(path)
    kind, count = _devices_of(run)
    if (header["device_kind"], header["num_devices"]) != (kind, count):
        raise ExecutableError(
            f"compiled_trainstep_file={path!r} was compiled for {header['num_devices']} x {header['device_kind']}, "
            f"but this run has {count} x {kind}. Compile it for this machine (train_compile with the matching "
            "compile_topology), or unset compiled_trainstep_file")
    if header["jax_version"] != jax.__version__:
        raise ExecutableError(f"compiled_trainstep_file={path!r} was compiled with jax {header['jax_version']}, "
                              f"this is jax {jax.__version__}; compile it again with this jax, or unset it")
    lowered = run.lower() if lowered is None else lowered
    if header["fingerprint"] != fingerprint(lowered):
        differing = _differing_keys(header["config"], run.config)
        raise ExecutableError(
            f"compiled_trainstep_file={path!r} holds a different train step than this run's "
            + (f"(config: {'; '.join(differing[:6])}{' ...' if len(differing) > 6 else ''})" if differing
               else "(same config, so the code or an installed package changed)")
            + ". Compile it again with the same config, or unset compiled_trainstep_file")
    trees = {"in_tree": str(lowered.in_tree), "out_tree": str(lowered.out_tree)}
    if any(header[k] != v for k, v in trees.items()):
        raise ExecutableError(f"compiled_trainstep_file={path!r} records other input or output structures than this "
                              "run's step; write it again with train_compile")
    try:
        with _xla_compilation_replaced_by(payload):
            compiled = lowered.compile(compiler_options={})  # options given: never an executable cached in `lowered`
    except jax.errors.JaxRuntimeError as error:
        raise ExecutableError(f"compiled_trainstep_file={path!r}: XLA cannot load its executable on this machine "
                              f"({str(error).splitlines()[0][:300]}); write it again with train_compile") from None
    if (compiled.in_tree, compiled.out_tree) != (lowered.in_tree, lowered.out_tree):
        raise ExecutableError(f"compiled_trainstep_file={path!r}: the loaded step's input or output structures "
                              "differ from this run's; write it again with train_compile")
    return compiled
