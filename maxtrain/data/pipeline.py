"""The training input: documents -> packed rows -> host batches [A, b, T] -> global jax.Array.

Every JAX process builds its own pipeline over its own shard of the data (sources.py) and
contributes its rows of the global batch through `jax.make_array_from_process_local_data`
(hosts.to_global). Host batches are numpy dicts with

    inputs, targets, positions, segment_ids, loss_weights   [accumulation steps, host micro batch, T]

(eval batches have no accumulation axis; see eval_batches.py). The train iterator is a Grain
DatasetIterator end to end, so its state (which documents were read, what is half packed) is
saved in the checkpoint and restored exactly.
"""

from __future__ import annotations

import functools
import itertools

import grain
import numpy as np
from grain import experimental as grain_exp

from maxtrain.data import default_corpus, hosts, packing, worker_processes
from maxtrain.data.hosts import BATCH_AXES, EVAL_BATCH_AXES, host_micro_batch, to_global  # noqa: F401 (train.py)


def _accumulation_axis(batch: dict, accum: int, micro: int) -> dict:
    return {k: v.reshape((accum, micro) + v.shape[1:]) for k, v in batch.items()}


def train_iterator(docs: grain.IterDataset, config, process_index: int = 0, log=print) -> grain.DatasetIterator:
    """Checkpointable Grain iterator of host batches [A, b, T]; endless unless num_epoch is set."""
    rows = config.gradient_accumulation_steps * host_micro_batch(config)
    return train_iterator_from_rows(packing.train_rows(docs, config, rows), config, process_index, log)


def train_iterator_from_rows(examples: grain.IterDataset, config, process_index: int = 0,
                             log=print, finish=None) -> grain.DatasetIterator:
    """The same, from examples [T] already packed (pre-training documents, or conversations: conversations.py);
    finish: a picklable map of each host batch [A, b, ...] (run in the workers too), e.g. image conversations' image
    layout (image_conversations.ToModelImages); it also makes the padding batches'."""
    accum, micro = config.gradient_accumulation_steps, host_micro_batch(config)
    rows = accum * micro
    batches = examples.batch(rows, drop_remainder=False)
    batches = batches.map(functools.partial(hosts.fill_rows, rows=rows))
    batches = batches.map(functools.partial(_accumulation_axis, accum=accum, micro=micro))
    if finish is not None:
        batches = batches.map(finish)
    if config.grain_worker_count > 0:  # each worker builds every n-th batch from its slice of the documents
        from absl import flags  # pylint: disable=import-outside-toplevel

        if not flags.FLAGS.is_parsed():  # Grain reads absl flags with workers (google/grain#1355)
            flags.FLAGS.mark_as_parsed()
        # batches travel pickled, not in shared memory: they are small, and Grain's shared-memory
        # arrays print tracebacks when the interpreter exits
        batches = grain_exp.WithOptionsIterDataset(batches, grain_exp.DatasetOptions(min_shm_size=1 << 62))
        batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.grain_worker_count),
                                      worker_init_fn=worker_processes.exit_with_parent)
    if config.num_epoch != -1:
        padding = hosts.padding_batch((accum, micro), config.max_target_length)
        batches = hosts.PadWhenExhausted(
            batches, padding if finish is None else finish(padding),
            allow=config.generate_padding_batch_train, process_index=process_index,
            what=f"the training data (num_epoch={config.num_epoch})", log=log,
            fix="Set steps to at most the batches available, num_epoch=-1 to repeat the data, or "
                "generate_padding_batch_train=true (zero-weight batches; with several hosts it keeps the hosts whose "
                "data lasts longer from waiting for this one forever).")
    return iter(batches)


class _Synthetic:
    """Random tokens, one document per row: for benchmarks, where only the shapes matter.

    Each row is drawn from (seed, batch index, global row) alone, where row r of process p is global
    row p * b + r (b rows per host). Where process p's devices hold global rows p * b .. (CPU, the
    usual GPU cluster), the global batch is therefore the same for any number of processes, which is
    what lets a 2-process run be compared with a 1-process run (tests/parallel/test_multiprocess.py).
    """

    def __init__(self, config, process_index: int):
        self.seed, self.process_index = config.seed, process_index
        self.vocab_size = config.vocab_size
        self.shape = (config.gradient_accumulation_steps, host_micro_batch(config), config.max_target_length)

    def __call__(self, index: int) -> dict:
        accum, micro, length = self.shape
        rows = [np.random.default_rng([self.seed, index, self.process_index * micro + r]).integers(
            4, self.vocab_size, size=(accum, length + 1), dtype=np.int32) for r in range(micro)]
        tokens = np.stack(rows, axis=1)  # [A, b, T + 1]
        ones = np.ones(self.shape, np.int32)
        return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "segment_ids": ones,
                "positions": np.broadcast_to(np.arange(self.shape[-1], dtype=np.int32), self.shape).copy(),
                "loss_weights": ones.astype(np.float32)}


def synthetic_iterator(config, process_index: int) -> grain.DatasetIterator:
    ds = grain.MapDataset.range(2**62).map(_Synthetic(config, process_index))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


# The spine's helpers, kept for callers outside maxtrain/data (viz, tests): in-memory documents.


def default_corpus_documents(config, log=print):
    """(tokenizer, train docs, eval docs) of the embedded corpus; see default_corpus.documents."""
    return default_corpus.documents(config, log=log)


def eval_batches(docs: list, config, process_index: int, process_count: int, num_batches: int) -> list[dict]:
    """The first `num_batches` host eval batches [b, T] of in-memory documents (padding batches if short)."""
    rows = host_micro_batch(config)
    ds = grain.MapDataset.source(docs)[process_index::process_count].to_iter_dataset()
    real = packing.eval_rows(ds, config, rows).batch(rows, drop_remainder=False)
    real = list(itertools.islice(real.map(functools.partial(hosts.fill_rows, rows=rows)), num_batches))
    return real + [hosts.padding_batch((rows,), config.max_target_length)] * (num_batches - len(real))
