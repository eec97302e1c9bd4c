"""A rollout worker: the Ray actor (controller.py starts it) that holds one Engine and answers prompt batches.

    worker = Worker(config, stop_ids, hosts)     # the engine of grpo_rollout_engine, built in the worker's process
    worker.offer(version, host, [part_ref])      # trainer process `host` published its part of a version (boxed)
    completions, stats = worker.generate(requests, version, host, [part_ref])

A version is swapped in once the parts of all `hosts` trainer processes are here, assembled leaf by leaf
(rollout/multihost.assemble): each process sends only its own shards. With several, each process also leaves its
newest part with `Parts`, a named actor: a worker that Ray restarted lost what it was offered, and fetches there the
parts of the version its re-sent batch names.

Partial rollouts: with grpo_rollout_chunk_tokens = c > 0 a batch is generated c tokens at a time; between chunks the
newest offered version is swapped in and the unfinished completions continue (prompt + their tokens so far, the
chunk's seed derived from the request's), every token tagged with the version that produced it. c = 0 generates
each completion in one call (the colocated program; what grpo_off_policy_steps=0 needs, where no newer version can
come while a batch is out).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from maxtrain.training.rollout import engine as engine_lib, multihost
from maxtrain.training.rollout.engine import Completion, Request

GOLDEN = 0x9E3779B97F4A7C15
PARTS_SECONDS = 600  # how long a batch waits for every trainer process's part of the version it was sent with


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of a request's chunk (its own for the first)."""
    return seed if chunk == 0 else (seed ^ (GOLDEN * chunk)) & 0xFFFFFFFFFFFFFFFF


class Parts:
    """The newest published part of each trainer process (a named actor of process 0's, controller.py): where a
    restarted worker finds the parts it missed."""

    def __init__(self):
        self.newest: dict = {}  # trainer process -> (version, its part's ref)

    def put(self, version: int, host: int, boxed: list) -> None:
        if version > self.newest.get(host, (-1, None))[0]:
            self.newest[host] = (version, boxed[0])

    def get(self, version: int) -> dict:
        """{trainer process: [its part's ref]} of those whose newest part is of `version`."""
        return {host: [ref] for host, (v, ref) in self.newest.items() if v == version}


class Worker:
    def __init__(self, config, stop_ids, hosts: int = 1, parts=None):
        self.engine = engine_lib.make(config, stop_ids)
        self.chunk, self.hosts, self.parts = config.grpo_rollout_chunk_tokens, hosts, parts  # parts: Parts' handle
        self.lock = threading.Condition()   # the offered versions (offer runs while a batch generates or waits)
        self.generating = threading.Lock()  # one batch at a time: an engine is not re-entrant (vLLM's LLM is not)
        self.offered: dict = {}       # version -> {trainer process: its part's ref}, newer than the engine's
        self.current = -1             # the engine's
        self.assembling = 0.0         # seconds spent assembling the parts since the last batch's stats

    def pid(self) -> int:
        return os.getpid()

    def offer(self, version: int, host: int, boxed: list) -> None:
        """Trainer process `host`'s part of version `version` (the ref boxed: not fetched until swapped in)."""
        with self.lock:
            if version > self.current:
                self.offered.setdefault(version, {})[host] = boxed[0]
                self.lock.notify_all()

    def swap(self) -> float:
        """Seconds spent swapping in the newest version whose P parts are all here (0 when the engine has it)."""
        with self.lock:
            whole = [v for v, parts in self.offered.items() if len(parts) == self.hosts and v > self.current]
            if not whole:
                return 0.0
            version = max(whole)
            refs = [self.offered[version][h] for h in range(self.hosts)]
            self.offered = {v: p for v, p in self.offered.items() if v > version}
        import ray  # pylint: disable=import-outside-toplevel  (only a worker started by Ray gets here)
        started = time.perf_counter()
        params = multihost.assemble(ray.get(refs))
        self.assembling += time.perf_counter() - started
        self.engine.set_weights(version, params)
        self.current = version
        return time.perf_counter() - started

    def generate(self, requests: list[Request], version: int, host: int, boxed: list) -> tuple[list[Completion], dict]:
        """A batch's completions (two batches sent to one worker, k >= 1 with fewer workers than batches out, are
        generated one after the other; the actor's second thread is for `offer`)."""
        with self.generating:
            return self._generate(requests, version, host, boxed)

    def _generate(self, requests: list[Request], version: int, host: int, boxed: list) -> tuple[list[Completion], dict]:
        self.offer(version, host, boxed)  # the caller's part again: a restarted worker has lost what it was offered
        self.wait_for_parts(version)
        swap = self.swap()
        started = time.perf_counter()
        parts = {r.id: [] for r in requests}
        live, step = list(requests), 0
        while live:
            asks = []
            for r in live:
                done = sum(len(p.tokens) for p in parts[r.id])
                left = r.max_new_tokens - done
                so_far = [p.tokens for p in parts[r.id]]
                asks.append(Request(r.id, np.concatenate([r.prompt_ids, *so_far]).astype(np.int32),
                                    min(self.chunk, left) if self.chunk else left, chunk_seed(r.seed, step)))
            for c in self.engine.generate(asks):
                parts[c.id].append(c)
            live = [r for r in live if not parts[r.id][-1].stopped
                    and sum(len(p.tokens) for p in parts[r.id]) < r.max_new_tokens]
            step += 1
            if live:
                swap += self.swap()
        out = [Completion(r.id, *(np.concatenate([getattr(p, f) for p in parts[r.id]])
                                  for f in ("tokens", "log_probs", "versions")), parts[r.id][-1].stopped)
               for r in requests]
        assembling, self.assembling = self.assembling, 0.0
        return out, {"generate_seconds": time.perf_counter() - started - swap, "swap_seconds": swap,
                     "assemble_seconds": assembling, "chunks": step}

    def wait_for_parts(self, version: int) -> None:
        """Until every trainer process's part of `version` is here (the other processes' may still be on their way;
        a restarted worker fetches those it missed from Parts)."""
        deadline = time.monotonic() + PARTS_SECONDS
        while True:
            with self.lock:
                if self.lock.wait_for(lambda: self.current >= version
                                      or len(self.offered.get(version, {})) == self.hosts, timeout=1.0):
                    return
                held = len(self.offered.get(version, {}))
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout worker {os.getpid()} holds {held} of the {self.hosts} trainer processes' "
                                   f"parts of weights version {version} after {PARTS_SECONDS} s: a trainer process "
                                   "stopped publishing (its log says why); the run resumes from its last checkpoint "
                                   "once every trainer process is started again")
            if self.parts is not None:
                import ray  # pylint: disable=import-outside-toplevel  (only a worker started by Ray gets here)
                for host, boxed in ray.get(self.parts.get.remote(version)).items():
                    self.offer(version, host, boxed)

    def close(self) -> None:
        self.engine.close()
