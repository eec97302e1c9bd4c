"""Multi-process runtime: JAX's own multi-controller `jax.distributed`.

One process per host (or per GPU), each running the same program. `initialize(config)` joins them
before any other JAX call:
  - explicit: `coordinator_address`, `num_processes` and `process_id` in the config, or the
    environment variables MAXTRAIN_COORDINATOR_ADDRESS, MAXTRAIN_NUM_PROCESSES, MAXTRAIN_PROCESS_ID;
  - detected: on Cloud TPU pods, SLURM and Open MPI, `jax.distributed.initialize()` finds the
    coordinator itself.
On CPU the cross-process collectives use gloo.

Joining fails within `distributed_initialization_timeout` seconds, never hangs:
  - a process other than 0 first waits for the coordinator's port to accept connections and raises
    DistributedError ("nothing is listening at host:port") when it never does;
  - the join itself runs under a watchdog. JAX's runtime gives up on a join by aborting the whole
    process from C++ (with a message blaming "another task"), which no Python code can catch, so the
    watchdog, which fires first, prints a message that says what went wrong and ends the process
    with exit status 2 (EXIT_STATUS), the status maxtrain uses for every configuration error.

After the join, `agree_on_config` stops every process when their resolved configs (or their maxtrain
code) differ, naming the keys and each process' value, and `agree_on_checkpoint_step` makes sure
every process resumes from the same step.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time

import jax
import numpy as np

from maxtrain import config as config_lib
from maxtrain.config import checks as config_checks
from maxtrain.errors import UserError

EXIT_STATUS = 2
# JAX's own join deadline is set this much later than ours, so the watchdog always fires first.
_JAX_GRACE_SECONDS = 30


class DistributedError(UserError, RuntimeError):
    """Joining the other processes failed; the message says which address and what to check."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _detected_cluster() -> str | None:
    if _env_int("SLURM_NTASKS", 1) > 1 and "SLURM_PROCID" in os.environ:
        return "SLURM"
    if _env_int("OMPI_COMM_WORLD_SIZE", 1) > 1:
        return "Open MPI"
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "Cloud TPU pod"
    return None


def settings(config) -> dict | None:
    """The arguments for jax.distributed.initialize, or None for a single-process run."""
    address = config.coordinator_address or os.environ.get("MAXTRAIN_COORDINATOR_ADDRESS", "")
    num_processes = config.num_processes if config.num_processes != -1 else _env_int("MAXTRAIN_NUM_PROCESSES", -1)
    process_id = config.process_id if config.process_id != -1 else _env_int("MAXTRAIN_PROCESS_ID", -1)
    if address:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise DistributedError(
                f"coordinator_address={address!r} also needs num_processes (got {num_processes}) and a "
                f"process_id in [0, num_processes) (got {process_id}); set them as config keys or as "
                "MAXTRAIN_NUM_PROCESSES / MAXTRAIN_PROCESS_ID")
        _split_address(address)
        return {"coordinator_address": address, "num_processes": num_processes, "process_id": process_id}
    if num_processes > 1:
        raise DistributedError(f"num_processes={num_processes} needs coordinator_address=host:port of process 0")
    if _detected_cluster():
        return {}
    return None


def _split_address(address: str) -> tuple[str, int]:
    key = "coordinator_address" if address != os.environ.get("MAXTRAIN_COORDINATOR_ADDRESS") else \
        "MAXTRAIN_COORDINATOR_ADDRESS"
    return config_checks.split_address(address, key)


def _wait_for_coordinator(address: str, deadline: float, timeout: int, process_id: int) -> None:
    """Returns once something accepts TCP connections at `address`; DistributedError at the deadline."""
    host, port = _split_address(address)
    last_error = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(deadline - time.monotonic(), 0.1))):
                return
        except OSError as e:
            last_error = e
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"process {process_id} could not reach the coordinator at {address} within "
                f"distributed_initialization_timeout={timeout}s: nothing accepted a connection there "
                f"({last_error}). Start process 0 with the same coordinator_address, check that the host "
                "and port are right and reachable from this host (firewall), or raise "
                "distributed_initialization_timeout.")
        time.sleep(0.25)


def _give_up(message: str) -> None:
    print(f"maxtrain: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)  # pylint: disable=protected-access


def _timeout_message(args: dict, timeout: int) -> str:
    if "coordinator_address" not in args:
        return (f"could not join the multi-process run found by {_detected_cluster()} within "
                f"distributed_initialization_timeout={timeout}s. Check that every process of the job started, "
                "or set coordinator_address, num_processes and process_id explicitly.")
    address, n, pid = args["coordinator_address"], args["num_processes"], args["process_id"]
    if pid == 0:
        return (f"process 0 started the coordinator at {address} and waited distributed_initialization_timeout="
                f"{timeout}s, but not all num_processes={n} processes joined. Start processes 1..{n - 1} with "
                f"the same coordinator_address and num_processes, check that {address} is reachable from "
                "their hosts, or raise distributed_initialization_timeout.")
    return (f"process {pid} reached the coordinator at {address}, but the run did not start within "
            f"distributed_initialization_timeout={timeout}s: not all num_processes={n} processes joined, "
            f"or another process already has process_id={pid}. Start every process once, with the same "
            "coordinator_address and num_processes and a distinct process_id.")


def _check_port_free(address: str) -> None:
    """Process 0 starts the coordinator at `address`: refuse at once when something already listens there
    (another process 0, e.g. two processes given process_id=0, or another program)."""
    host, port = _split_address(address)
    try:
        with socket.create_connection((host, port), timeout=1.0):
            pass
    except OSError:
        return  # nothing listens: the coordinator can start
    raise DistributedError(
        f"process 0 cannot start the coordinator at {address}: something already listens on that port. Either "
        "another process was also started with process_id=0 (give each process a distinct process_id in "
        "[0, num_processes)), or another program uses the port (choose another coordinator_address port).")


def initialize(config) -> None:
    """Joins the other processes (a no-op for a single-process run). Call before any other JAX use."""
    args = settings(config)
    if args is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = config.distributed_initialization_timeout
    deadline = time.monotonic() + timeout
    if args.get("process_id") == 0:
        _check_port_free(args["coordinator_address"])
    if args.get("process_id", 0) != 0:
        _wait_for_coordinator(args["coordinator_address"], deadline, timeout, args["process_id"])
    remaining = max(deadline - time.monotonic(), 1.0)
    watchdog = threading.Timer(remaining, _give_up, args=(_timeout_message(args, timeout),))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**args, initialization_timeout=int(remaining) + _JAX_GRACE_SECONDS)
    except Exception as e:  # pylint: disable=broad-except
        where = args.get("coordinator_address") or f"the coordinator found by {_detected_cluster()}"
        raise DistributedError(
            f"could not join the multi-process run at {where}: {e}. Check that process 0 is running, that the "
            "address and port are reachable from this host, and that every process got the same "
            "num_processes.") from e
    finally:
        watchdog.cancel()



# Keys that differ between the processes of one run by design.
PER_PROCESS_KEYS = ("process_id",)


def code_version() -> str:
    """A hash of maxtrain's own source files (catches a host running other code than the rest)."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for directory, dirs, names in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(directory, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _fingerprint_values(config) -> dict[str, str]:
    """{key: canonical JSON of its value} for every setting that must agree, plus the code version."""
    skip = PER_PROCESS_KEYS + (("run_name",) if config.run_name_was_generated else ())  # with_devices refuses that
    out = {k: json.dumps(v, sort_keys=True, default=str) for k, v in config.to_dict().items()
           if k in config_lib.table() and k not in skip}
    out["maxtrain code"] = json.dumps(code_version())
    return out


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _allgather_bytes(data: bytes) -> list[bytes]:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    lengths = all_values(len(data))
    buffer = np.zeros(max(lengths), np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer))
    return [bytes(row[:n]) for row, n in zip(gathered, lengths)]


def agree_on_config(config) -> None:
    """Every process must run the same resolved config and code; else DistributedError on every process,
    naming each differing key with every process' value. (A collective: every process calls it.)"""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    values = _fingerprint_values(config)
    keys = sorted(values)
    if len(set(all_values(_hash63(" ".join(keys))))) > 1:
        raise DistributedError("the processes run different maxtrain versions (their config keys differ). Start "
                               "every process with the same maxtrain code, config file and overrides.")
    mine = np.asarray([_hash63(values[k]) for k in keys], np.int64)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    differing = [k for i, k in enumerate(keys) if len(set(everyone[:, i].tolist())) > 1]
    if not differing:
        return
    shown = json.dumps({k: values[k] for k in differing}).encode()
    per_process = [json.loads(b) for b in _allgather_bytes(shown)]
    parts = []
    for k in differing:
        seen = ", ".join(f"process {p}: {v[k]}" for p, v in enumerate(per_process))
        parts.append(f"{k} ({seen})")
    raise DistributedError(
        "the processes of this run were started with different settings: " + "; ".join(parts)
        + ". Start every process with the same config file, overrides and maxtrain code (only process_id may "
        "differ). Nothing was done.")


def all_values(value: int) -> list[int]:
    """`value` as seen by every process, in process order (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.asarray(value, np.int64)))]


def agree_on_checkpoint_step(step: int | None, checkpoint_dir: str) -> int | None:
    """Every process' latest checkpoint step must be the same; returns it, or raises DistributedError.

    Processes that resumed from different steps would train on different states and corrupt the
    next checkpoint, so the run stops before any work instead.
    """
    values = all_values(-1 if step is None else step)
    if len(set(values)) > 1:
        seen = ", ".join(f"process {i}: {'none' if v < 0 else v}" for i, v in enumerate(values))
        raise DistributedError(
            f"the processes see different latest checkpoints in {checkpoint_dir} ({seen}). Every process "
            "must read and write the same checkpoint directory: put base_output_directory on storage that "
            "all hosts share (a bucket or a shared file system) and start every process with the same "
            "run_name. Nothing was changed.")
    return step
