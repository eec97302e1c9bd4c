"""The trainer's side of the rollout workers: Ray started (or joined), N workers, weights published by version,
prompt batches out and completions back, a dead worker's batch re-issued to its restart.

    controller = Controller(config, stop_ids, log)     # ray.init (RAY_ADDRESS's cluster, else a local one), workers
    sync = controller.publish(version, params)         # this host's shards, ray.put once; every worker offered them
    controller.submit(tag, requests)                   # to the least busy worker
    completions, stats = controller.collect(tag)       # waits; a worker that died is restarted by Ray and asked again
    controller.close()

Over P trainer processes (rollout/multihost.py) process 0 is the driver: it starts the workers, named in the run's
namespace, and alone submits and collects; the others join its Ray (its address broadcast over JAX) only to publish
their own shards of each version to the same workers.

A worker is a Ray actor (max_restarts: Ray restarts one that dies) built from worker.Worker; it holds the engine and
the newest weights it was offered. It asks Ray for one CPU, and for grpo_rollout_worker_devices accelerators
(`placement`): GPUs where the cluster has GPUs, TPU chips where it has TPUs; Ray places it where they are free and
makes only those visible to it. A cluster that cannot hold the workers is refused before any starts (Ray would
otherwise wait for the resources forever). A batch sent to a worker that dies is sent again, with the same requests and seeds,
to the restarted worker (which takes the newest published version): no prompt is lost, none answered twice.
"""

from __future__ import annotations

import os
import time

import jax

from maxtrain import errors
from maxtrain.training.rollout import multihost, worker as worker_lib

MAX_RESTARTS = 8          # Ray restarts a dead worker this many times at most
RETRIES = 8               # a batch is re-sent this many times at most
RESTART_SECONDS = 1800    # how long a restarting worker may take to answer again (a vLLM engine starts in minutes)
ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "JAX_ENABLE_X64")  # what a worker's process needs of the trainer's


def placement(config, resources: dict, address: str = "") -> dict:
    """The Ray options of each rollout worker: one CPU, and grpo_rollout_worker_devices GPUs or TPU chips, whichever
    the cluster has (`resources`: ray.cluster_resources()). A ConfigError (one line, the fix) when the cluster cannot
    hold grpo_rollout_workers such workers."""
    workers, devices = config.grpo_rollout_workers, config.grpo_rollout_worker_devices
    where = f"the Ray cluster at {address}" if address else "the local Ray (this machine)"
    has = ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU", "TPU")) or "nothing"
    if workers > resources.get("CPU", 0):
        raise errors.ConfigError(f"grpo_rollout_workers={workers} workers need one CPU each, but {where} has {has}; "
                                 f"set grpo_rollout_workers <= {int(resources.get('CPU', 0))}, or add nodes to it")
    if devices == 0:
        return {"num_cpus": 1}
    kind = next((k for k in ("GPU", "TPU") if resources.get(k, 0) > 0), None)
    if kind is None:
        raise errors.ConfigError(f"grpo_rollout_worker_devices={devices} asks Ray for {devices} accelerators per rollout "
                                 f"worker, but {where} has none ({has}); set grpo_rollout_worker_devices=0 (a CPU "
                                 "each), or join a Ray cluster with GPUs or TPUs (RAY_ADDRESS)")
    if workers * devices > resources[kind]:
        raise errors.ConfigError(f"grpo_rollout_workers={workers} x grpo_rollout_worker_devices={devices} = "
                                 f"{workers * devices} {kind}s, but {where} has {resources[kind]:g}; set fewer "
                                 "workers or devices per worker, or add nodes to it")
    return {"num_cpus": 1, "num_gpus": devices} if kind == "GPU" else {"num_cpus": 1, "resources": {"TPU": devices}}


def describe(options: dict) -> str:
    devices = [f"{options['num_gpus']} GPU(s)"] if "num_gpus" in options else [
        f"{n} {k} chip(s)" for k, n in options.get("resources", {}).items()]
    return " and ".join(["one CPU", *devices])


class Controller:
    def __init__(self, config, stop_ids, log=print):
        import ray  # pylint: disable=import-outside-toplevel  (the [rl] extra; config/objectives.py checked it)
        self.ray, self.log = ray, log
        self.index, self.hosts = jax.process_index(), jax.process_count()
        address = os.environ.get("RAY_ADDRESS", "")
        self.started_ray = not ray.is_initialized()
        namespace = f"maxtrain-{config.run_name}"  # the run's: the other trainer processes find its workers by name
        if self.started_ray and self.index == 0:
            env = {k: os.environ[k] for k in ENV if k in os.environ}
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False, namespace=namespace,
                     runtime_env={"env_vars": env})
        names = [f"rollout-worker-{i}" for i in range(config.grpo_rollout_workers)]
        self.workers, options = [], {}
        if self.index == 0:  # the driver: starts the workers (named, in the run's namespace)
            try:  # a cluster that cannot hold the workers: refused, and a Ray this run started stopped
                options = placement(config, ray.cluster_resources(), address)
            except errors.ConfigError:
                self.close()
                raise
            # a thread per batch that may be out at once, and one for `offer`
            actor = ray.remote(worker_lib.Worker)
            common = {"max_restarts": MAX_RESTARTS, "max_task_retries": 0, "namespace": namespace,
                      "max_concurrency": 3 + config.grpo_off_policy_steps, **options}
            self.parts = None
            if self.hosts > 1:  # every process's newest part, for a worker Ray restarts
                self.parts = ray.remote(worker_lib.Parts).options(name="weight-parts", namespace=namespace,
                                                                  num_cpus=0).remote()
            self.workers = [actor.options(name=n, **common).remote(config, tuple(stop_ids), self.hosts, self.parts)
                            for n in names]
        if self.hosts > 1:  # the others join process 0's Ray as drivers and reach the workers by name
            said = (f"{ray.get_runtime_context().gcs_address} {os.environ.get('RAY_AUTH_MODE', '')}"
                    if self.index == 0 else "")
            gcs, _, mode = multihost.text_from_zero(said).partition(" ")
            if self.index:
                if mode and os.environ.get("RAY_AUTH_MODE") != mode:  # Ray's token auth, on where process 0
                    os.environ["RAY_AUTH_MODE"] = mode  # started it; its token (~/.ray/auth_token, RAY_AUTH_TOKEN)
                    from ray._raylet import Config  # pylint: disable=import-outside-toplevel  (Ray's, read at import)
                    Config.initialize("")  # must be this machine's too
                if self.started_ray:
                    ray.init(address=gcs, include_dashboard=False, log_to_driver=False, namespace=namespace)
                self.workers = [ray.get_actor(n, namespace=namespace) for n in names]
                self.parts = ray.get_actor("weight-parts", namespace=namespace)
        self.busy, self.turn = [0] * len(self.workers), 0
        self.flight: dict = {}       # tag -> (worker index, requests, future)
        self.weights = (-1, None)    # the newest published version and this host's part's ref
        self.reissued, self.said = 0, False
        log(f"GRPO rollouts: {len(self.workers)} {config.grpo_rollout_engine} workers on Ray "
            f"({'the cluster at ' + address if address else 'a local Ray'}), at most {config.grpo_off_policy_steps} "
            f"versions stale; weights published by {self.hosts} trainer process(es), each its own shards"
            + (f"; each worker holds {describe(options)}" if options else ""))

    def pids(self) -> list[int]:
        return self.ray.get([w.pid.remote() for w in self.workers])

    def publish(self, version: int, params) -> dict:
        """Version `version` of the weights to every worker, this host's replica-0 shards only (no host gathers the
        whole model): this host's bytes and seconds of the sync, and the bytes of all hosts."""
        started = time.perf_counter()
        part, size = multihost.shards(params)
        ref = self.ray.put(part)
        self.weights = (version, ref)
        if self.hosts > 1:
            self.parts.put.remote(version, self.index, [ref])
        for w in self.workers:
            w.offer.remote(version, self.index, [ref])
        seconds = time.perf_counter() - started
        if not self.said:  # once per run, by every trainer process
            self.said = True
            self.log(f"GRPO rollouts: trainer process {self.index} of {self.hosts} publishes {size} bytes of weights "
                     f"per version, {multihost.whole_leaves(part)} of {len(part)} leaves whole")
        return {"aux/grpo_sync_bytes": float(size), "aux/grpo_sync_seconds": seconds,
                "aux/grpo_sync_bytes_total": multihost.total(size), "aux/grpo_sync_hosts": float(self.hosts)}

    def submit(self, tag, requests: list, index: int | None = None) -> None:
        if index is None:  # the least busy, in turn among equals
            order = [(self.busy[i], (i - self.turn) % len(self.workers)) for i in range(len(self.workers))]
            index = min(range(len(self.workers)), key=order.__getitem__)
            self.turn = index + 1
        version, ref = self.weights
        self.busy[index] += 1
        self.flight[tag] = (index, requests, self.workers[index].generate.remote(requests, version, self.index, [ref]))

    def collect(self, tag) -> tuple[list, dict]:
        """(completions in the requests' order, the worker's stats) of a submitted batch."""
        for attempt in range(RETRIES + 1):
            index, requests, future = self.flight[tag]
            try:
                completions, stats = self.ray.get(future)
                break
            except self.ray.exceptions.RayActorError as e:
                if attempt == RETRIES or "creation task" in str(e):  # a worker that cannot start is a bug, not a fault
                    raise
                self.reissued += 1
                self.log(f"rollout worker {index} died ({type(e).__name__}); Ray restarts it and its batch of "
                         f"{len(requests)} prompts is re-issued to it")
                self.busy[index] -= 1
                self.restarted(index)
                self.submit(tag, requests, index)
        del self.flight[tag]
        self.busy[index] -= 1
        if [c.id for c in completions] != [r.id for r in requests]:
            raise RuntimeError(f"rollout worker {index} answered requests {[c.id for c in completions]} for "
                               f"{[r.id for r in requests]}")
        return completions, stats

    def restarted(self, index: int) -> None:
        """Waits until Ray has restarted worker `index` (it answers again): a batch sent while it restarts fails at
        once ("the actor is temporarily unavailable"), which would spend every retry within a second."""
        started = time.monotonic()
        unavailable = (self.ray.exceptions.ActorUnavailableError, self.ray.exceptions.GetTimeoutError)
        while True:
            try:
                self.ray.get(self.workers[index].pid.remote(), timeout=60)
                return
            except unavailable:
                if time.monotonic() - started > RESTART_SECONDS:
                    raise
                time.sleep(1.0)

    def close(self) -> None:
        for w in [*self.workers, getattr(self, "parts", None)] if self.index == 0 else ():  # the driver's to stop
            if w is not None:
                self.ray.kill(w)
        self.workers = []
        if self.started_ray:
            self.ray.shutdown()
