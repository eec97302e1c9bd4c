"""A rollout worker: the Ray actor (controller.py starts it) that holds one Engine and answers prompt batches.

    worker = Worker(config, stop_ids)            # the engine of grpo_rollout_engine, built in the worker's process
    worker.offer(version, [weights_ref])         # the trainer published a version (the ref boxed: not fetched yet)
    completions, stats = worker.generate(requests, version, [weights_ref])

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

from maxtrain.training.rollout import engine as engine_lib
from maxtrain.training.rollout.engine import Completion, Request

GOLDEN = 0x9E3779B97F4A7C15


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of a request's chunk (its own for the first)."""
    return seed if chunk == 0 else (seed ^ (GOLDEN * chunk)) & 0xFFFFFFFFFFFFFFFF


class Worker:
    def __init__(self, config, stop_ids):
        self.engine = engine_lib.make(config, stop_ids)
        self.chunk = config.grpo_rollout_chunk_tokens
        self.lock = threading.Lock()        # the offered version (offer runs while a batch generates)
        self.generating = threading.Lock()  # one batch at a time: an engine is not re-entrant (vLLM's LLM is not)
        self.offered = (-1, None)     # the newest version the trainer published, its weights' ref boxed
        self.current = -1             # the engine's

    def pid(self) -> int:
        return os.getpid()

    def offer(self, version: int, boxed: list) -> None:
        with self.lock:
            if version > self.offered[0]:
                self.offered = (version, boxed[0])

    def swap(self) -> float:
        """Seconds spent swapping in the newest offered version (0 when the engine has it)."""
        with self.lock:
            version, ref = self.offered
        if ref is None or version <= self.current:
            return 0.0
        import ray  # pylint: disable=import-outside-toplevel  (only a worker started by Ray gets here)
        started = time.perf_counter()
        self.engine.set_weights(version, ray.get(ref))
        self.current = version
        return time.perf_counter() - started

    def generate(self, requests: list[Request], version: int, boxed: list) -> tuple[list[Completion], dict]:
        """A batch's completions (two batches sent to one worker, k >= 1 with fewer workers than batches out, are
        generated one after the other; the actor's second thread is for `offer`)."""
        with self.generating:
            return self._generate(requests, version, boxed)

    def _generate(self, requests: list[Request], version: int, boxed: list) -> tuple[list[Completion], dict]:
        self.offer(version, boxed)
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
        return out, {"generate_seconds": time.perf_counter() - started - swap, "swap_seconds": swap,
                     "chunks": step}

    def close(self) -> None:
        self.engine.close()
