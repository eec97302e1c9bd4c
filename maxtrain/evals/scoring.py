"""The scoring step (jit, one shape) and running it over every process' packed rows.

Each process scores its own rows (its share of the examples, see runner.py): its host batches of
`eval_tasks_per_device_batch_size x local devices` rows join into one global batch sharded over the
data-parallel mesh axes, exactly as training batches do, and every process runs the same number of
batches (a process with fewer rows feeds padding rows, segment 0, which score nothing). The step
returns, per token, the log-probability of the target and whether it is the argmax; each process
reads back its own rows. The per-request sums are then shared between processes with one all-gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.model import Model
from maxtrain.parallel import sharding
from maxtrain.data import hosts

BATCH_AXES = ("batch", "length")


def model_logits(params, tokens, positions, segment_ids, config, rt):
    """float32 logits [B, T, V]: the one place evals call the model."""
    return Model.bind(config).forward(params, tokens, positions, segment_ids, rt)[0]


def make_score_step(config, rt, mesh):
    """jit(params, batch) -> (target log-prob float32 [B, T], target is argmax bool [B, T])."""
    out = sharding.named_sharding(mesh, BATCH_AXES, config.logical_axis_rules)

    def score_requests(params, batch):
        logits = model_logits(params, batch["inputs"], batch["positions"], batch["segment_ids"], config, rt)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
        return target - log_z, jnp.argmax(logits, axis=-1) == batch["targets"]

    return jax.jit(score_requests, out_shardings=(out, out))


def local_rows(x: jax.Array) -> np.ndarray:
    """This process' rows of a batch-sharded global array, in the order its host batch had them."""
    if jax.process_count() == 1:
        return np.asarray(x)
    shards = {}
    for shard in x.addressable_shards:  # replicas (e.g. over the tensor axis) hold the same rows
        shards.setdefault(shard.index[0].start or 0, shard)
    return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])


def score_rows(step_fn, params, packed, rows_per_batch: int, num_batches: int, mesh, rules):
    """Per-token (log-prob, is argmax) [R, T] for this process' packed rows."""
    outputs, logprobs, greedy = [], [], []
    for batch in packed.batches(rows_per_batch, num_batches):
        outputs.append(step_fn(params, hosts.to_global(batch, mesh, rules, BATCH_AXES)))
        if len(outputs) > 1:  # one batch runs while the next is prepared; more in flight can starve
            lp, g = outputs.pop(0)  # XLA:CPU's collectives of its thread pool
            logprobs.append(local_rows(lp))
            greedy.append(local_rows(g))
    for lp, g in outputs:
        logprobs.append(local_rows(lp))
        greedy.append(local_rows(g))
    length = packed.inputs.shape[1]
    if not outputs:
        return np.zeros((0, length), np.float32), np.zeros((0, length), bool)
    return (np.concatenate(logprobs)[:packed.num_rows], np.concatenate(greedy)[:packed.num_rows])


def all_gather_requests(ll: np.ndarray, greedy: np.ndarray, counts: list[int]):
    """Every process' per-request (float64 log-likelihood, is_greedy), as a list indexed by process.

    float64 travels as two float32 halves (hi + lo), so the sums are not rounded on the way."""
    if len(counts) == 1:
        return [(ll, greedy)]
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    width = max(max(counts), 1)
    hi = ll.astype(np.float32)
    lo = (ll - hi.astype(np.float64)).astype(np.float32)
    local = np.zeros((3, width), np.float32)
    local[0, :len(ll)], local[1, :len(ll)], local[2, :len(ll)] = hi, lo, greedy
    every = np.asarray(multihost_utils.process_allgather(local))  # [processes, 3, width]
    return [(every[p, 0, :n].astype(np.float64) + every[p, 1, :n].astype(np.float64), every[p, 2, :n] > 0.5)
            for p, n in enumerate(counts)]
