"""Requests -> tokens -> fixed-shape packed rows, once per run.

Tokenizing one (context, continuation) request follows lm-eval's causal-LM rules, so that the same
tokenizer gives the same tokens: whitespace at the end of the context moves to the front of the
continuation; the context is encoded alone and together with the continuation, and the
continuation's tokens are what the whole has beyond the context's length; both start with BOS when
the tokenizer has one (as maxtrain's training documents do, and as Llama-family tokenizers do under
lm-eval). The model reads context + continuation minus the last token and is scored on the
continuation's tokens. A request longer than T + 1 tokens loses tokens on the left (lm-eval's
`max_length` truncation).

Packing: the requests are placed whole into rows of T tokens, longest first, each into the row that
has least room left for it ("best fit decreasing"). Each request is its own segment: its positions
start at 0 and attention never crosses into the requests beside it, so a packed row scores every
request exactly as it would be scored alone. Rows are grouped into batches [rows, T], and every
batch has the same shape, so the scoring step compiles once.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from maxtrain.errors import ConfigError


@dataclasses.dataclass
class Packed:
    """Rows [R, T] of packed requests and, per request, where its scored tokens are."""

    inputs: np.ndarray        # int32 [R, T]
    targets: np.ndarray       # int32 [R, T]
    positions: np.ndarray     # int32 [R, T]
    segment_ids: np.ndarray   # int32 [R, T]; 0 = padding
    row: np.ndarray           # int32 [n]: each request's row
    end: np.ndarray           # int32 [n]: one past its last token in that row
    scored: np.ndarray        # int32 [n]: its number of continuation tokens (scored at end - scored .. end)
    truncated: int            # requests that lost context tokens on the left

    @property
    def num_rows(self) -> int:
        return self.inputs.shape[0]

    def batches(self, rows_per_batch: int, num_batches: int):
        """`num_batches` host batches of `rows_per_batch` rows; rows past the end are padding."""
        length = self.inputs.shape[1]
        for b in range(num_batches):
            lo, hi = b * rows_per_batch, min((b + 1) * rows_per_batch, self.num_rows)
            batch = {}
            for key in ("inputs", "targets", "positions", "segment_ids"):
                block = np.zeros((rows_per_batch, length), np.int32)
                if hi > lo:
                    block[:hi - lo] = getattr(self, key)[lo:hi]
                batch[key] = block
            yield batch


def prefix_ids(tokenizer) -> list[int]:
    bos = tokenizer.bos_id
    return [] if bos is None or bos < 0 else [int(bos)]


def tokenize(requests: list[tuple[str, str]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context tokens, continuation tokens) per request; each unique string is encoded once."""
    bos = prefix_ids(tokenizer)
    moved = []
    for context, continuation in requests:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        moved.append((context, continuation))
    texts = sorted({t for c, k in moved for t in ((c, c + k) if c else (k,))})
    encoded = dict(zip(texts, tokenizer.encode_batch(texts)))
    out = []
    for context, continuation in moved:
        if not context:  # nothing to condition on: the continuation follows BOS (or EOS) alone
            if not bos and tokenizer.eos_id is None:
                raise ConfigError(f"eval_tasks: the tokenizer {tokenizer.path} has neither a BOS nor an EOS token, so "
                                  f"a request without context ({continuation[:40]!r}) has nothing to follow; use the "
                                  "model's tokenizer with its config files (tokenizer_config.json names them)")
            start = bos or [int(tokenizer.eos_id)]
            cont = list(encoded[continuation])
            out.append((start, cont) if cont[:1] != start else (start, cont[1:]))
        else:
            ctx = bos + list(encoded[context])
            whole = bos + list(encoded[context + continuation])
            out.append((ctx, whole[len(ctx):]))
        if not out[-1][1]:
            raise ConfigError(f"eval_tasks: the continuation {continuation!r} (after {context[-40:]!r}) gives no "
                              f"tokens of its own with the tokenizer {tokenizer.path}, so it cannot be scored; use "
                              "the model's own tokenizer (tokenizer_path)")
    return out


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(row, start) per item and the number of rows; every item fits (length <= capacity)."""
    order = np.argsort(-lengths, kind="stable")
    row = np.zeros(len(lengths), np.int32)
    start = np.zeros(len(lengths), np.int32)
    room: dict[int, list[int]] = {}   # room left -> rows with that much room
    rooms: list[int] = []             # sorted room sizes that some row has
    num_rows = 0
    for i in order:
        need = int(lengths[i])
        k = bisect.bisect_left(rooms, need)
        if k < len(rooms):
            have = rooms[k]
            r = room[have].pop()
            if not room[have]:
                del room[have]
                rooms.pop(k)
        else:
            have, r = capacity, num_rows
            num_rows += 1
        row[i], start[i] = r, capacity - have
        left = have - need
        if left > 0:
            if left not in room:
                room[left] = []
                bisect.insort(rooms, left)
            room[left].append(r)
    return row, start, num_rows


def pack(tokenized: list[tuple[list[int], list[int]]], length: int, what: str = "requests") -> Packed:
    """Packs tokenized requests into rows of `length` tokens (see the module docstring)."""
    seqs, scored, truncated = [], [], 0
    for i, (ctx, cont) in enumerate(tokenized):
        if not cont:
            raise ValueError(f"{what}: request {i} has an empty continuation after tokenization")
        if len(cont) > length:
            raise ConfigError(f"{what}: a continuation of {len(cont)} tokens does not fit a scoring row of {length}; "
                             f"raise eval_tasks_max_target_length to at least {len(cont)}")
        seq = ctx + cont
        if len(seq) > length + 1:
            seq, truncated = seq[-(length + 1):], truncated + 1
        seqs.append(seq)
        scored.append(len(cont))
    lengths = np.asarray([len(s) - 1 for s in seqs], np.int64)
    row, start, num_rows = _best_fit_decreasing(lengths, length) if seqs else (np.zeros(0, np.int32),) * 2 + (0,)
    arrays = {k: np.zeros((num_rows, length), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    segment_count = np.zeros(num_rows, np.int32)
    for i, seq in enumerate(seqs):
        r, s, n = row[i], start[i], lengths[i]
        segment_count[r] += 1
        arrays["inputs"][r, s:s + n] = seq[:-1]
        arrays["targets"][r, s:s + n] = seq[1:]
        arrays["positions"][r, s:s + n] = np.arange(n)
        arrays["segment_ids"][r, s:s + n] = segment_count[r]
    return Packed(**arrays, row=row, end=(start + lengths).astype(np.int32), scored=np.asarray(scored, np.int32),
                  truncated=truncated)


def request_scores(packed: Packed, logprobs: np.ndarray, greedy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-likelihood float64 [n], is_greedy bool [n]) per request from per-token results [R, T]."""
    if len(packed.row) == 0:
        return np.zeros(0, np.float64), np.zeros(0, bool)
    zero = np.zeros((logprobs.shape[0], 1))
    ll_sum = np.concatenate([zero, np.cumsum(logprobs.astype(np.float64), axis=1)], axis=1)
    misses = np.concatenate([zero, np.cumsum(~greedy.astype(bool), axis=1)], axis=1)
    lo = packed.end - packed.scored
    ll = ll_sum[packed.row, packed.end] - ll_sum[packed.row, lo]
    return ll, (misses[packed.row, packed.end] - misses[packed.row, lo]) == 0
