"""Eval input, with Pax `eval_loop_num_batches` semantics.

    eval_steps = N    the first N batches of the eval data, every evaluation (re-read from the start)
    eval_steps = -1   exactly one pass over the eval data

Eval is a collective, so every host must run the same number of batches. At start-up each host
counts its own batches (one pass, or up to N), the counts are gathered from every process, and the
number to run is N (or, for -1, the largest count). A host with fewer real batches fills in with
padding batches, whose loss weight is 0 (`generate_padding_batch_eval`, default true); with it
false, unequal counts are an error before training. Since the trainer divides the summed loss by
the summed weight, padding never changes the eval loss, and neither does the number of hosts
(eval packs whole pieces of documents, see packing.py).
"""

from __future__ import annotations

import functools
import itertools

from maxtrain.data import hosts, packing
from maxtrain.data import sources as sources_lib
from maxtrain.data.errors import DataError


class EvalInput:
    """Iterable over exactly `len(self)` host eval batches [b, T]; each iteration starts afresh."""

    def __init__(self, make_batches, num_batches: int, real_batches: int, rows: int, length: int):
        self._make_batches = make_batches
        self.num_batches, self.real_batches = num_batches, real_batches
        self._padding = hosts.padding_batch((rows,), length)

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> dict:
        """Batch `index` of a fresh pass (cheap for the first few, e.g. to look at one)."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"eval batch {index} of {self.num_batches}")
        return next(itertools.islice(iter(self), index, None))

    def __iter__(self):
        real = self._make_batches()
        for _ in range(self.real_batches):
            yield next(real)
        for _ in range(self.num_batches - self.real_batches):
            yield self._padding


def host_batches(sources: sources_lib.Sources, config, index: int, count: int, rows: int):
    """A fresh iterator over this host's eval batches [rows, T] (the last one padded with empty rows)."""
    docs = sources_lib.eval_documents(sources, config, index, count)
    batches = packing.eval_rows(docs, config, rows).batch(rows, drop_remainder=False)
    return iter(batches.map(functools.partial(hosts.fill_rows, rows=rows)))


def make_eval_input(sources: sources_lib.Sources, config, index: int, count: int, log=print) -> EvalInput:
    rows = hosts.host_micro_batch(config)
    make = functools.partial(host_batches, sources, config, index, count, rows)
    limit = config.eval_steps if config.eval_steps > 0 else None
    local = sum(1 for _ in itertools.islice(make(), limit))
    counts = hosts.agree(local, count)
    num = limit or max(counts)
    if max(counts) == 0:
        raise DataError("the eval data gives no batches (grain_eval_files holds no documents); fix it, or set "
                        "eval_interval=-1 to train without eval")
    short = [h for h, c in enumerate(counts) if c < num]
    if short and not config.generate_padding_batch_eval:
        raise DataError(f"eval runs {num} batches on every host, but host(s) {short} have only "
                        f"{[counts[h] for h in short]} real batches (per-host counts {counts}). Set "
                        "generate_padding_batch_eval=true (their missing batches become zero-weight padding, the "
                        f"loss is unchanged){' or a smaller eval_steps' if limit else ''}.")
    if limit and max(counts) < limit:
        log(f"eval: the eval data makes only {max(counts)} batches (fullest host), so eval_steps={limit} evaluates "
            f"them plus {limit - max(counts)} padding batches; eval_steps=-1 says this directly")
    log(f"eval: {num} batches of {rows} x {config.max_target_length} per evaluation on each of {count} host(s) "
        f"(host {index}: {min(local, num)} real)")
    return EvalInput(make, num, min(local, num), rows, config.max_target_length)
