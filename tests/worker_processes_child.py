"""Started by tests/data/test_worker_processes.py: starts the worker processes a training run starts (a dataset-cache
tokenizing pool and a Grain `grain_worker_count` worker), waits until each has done some work, prints "ready" and
sleeps until it is killed."""

from __future__ import annotations

import multiprocessing
import sys
import time
import types
from concurrent import futures

import numpy as np


def row(i):
    tokens = np.full((8,), i % 7, np.int32)
    return {"inputs": tokens, "targets": tokens, "positions": np.arange(8, dtype=np.int32),
            "segment_ids": np.ones((8,), np.int32), "loss_weights": np.ones((8,), np.float32)}


def main():
    import grain

    from maxtrain.data import pipeline, prepare

    context = multiprocessing.get_context("spawn")
    pool = futures.ProcessPoolExecutor(1, mp_context=context, initializer=prepare.init_worker,
                                       initargs=(None, context.Value("q", 0)))
    assert pool.submit(sum, [1, 2]).result() == 3

    config = types.SimpleNamespace(gradient_accumulation_steps=1, per_device_batch_size=1, grain_worker_count=1,
                                   num_epoch=-1, max_target_length=8)
    batches = pipeline.train_iterator_from_rows(grain.MapDataset.range(10_000).map(row).to_iter_dataset(), config)
    next(batches)
    print("ready", flush=True)
    time.sleep(600)
    sys.exit(1)


if __name__ == "__main__":
    main()
