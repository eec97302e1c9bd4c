"""Elastic resume of the input: P processes' saved iterator states merged into Q, counted exactly.

P "processes" (real train pipelines built with make_inputs(process_index=i, process_count=P)) each
emit the same number of batches, as in training; their states are merged (elastic.merge) into Q new
ones, and the Q pipelines run to the end of the epoch (num_epoch=1). Over everything emitted before
and after, every document must appear exactly once: each document's BOS starts a row segment once,
and the multiset of emitted tokens equals the epoch's (so no part of a document is repeated or
skipped either, including the one a process was cutting into rows when it stopped).
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

import data_helpers as h
from maxtrain.data import elastic, make_inputs
from maxtrain.data.errors import DataError

DOCS = 37
LENGTH = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tok = h.tokenizer_path(tmp_path_factory)
    return h.prepared(tmp_path_factory, "elastic_corpus", h.texts(DOCS, "e"), tok), tok


def cfg(corpus, *extra):
    return h.config("dataset_type=arrayrecord", f"grain_train_files={corpus[0]}/train-*.arrayrecord",
                    f"max_target_length={LENGTH}", "per_device_batch_size=1", "num_epoch=1",
                    "generate_padding_batch_train=true", *h.TINY_MODEL, *extra)


def iterator(config, index, count, state=None):
    it = make_inputs(config, log=lambda *a: None, process_index=index, process_count=count).train_iterator
    if state is not None:
        it.set_state(json.loads(json.dumps(state)))  # through JSON, as a checkpoint stores it
    return it


def is_padding(batch) -> bool:
    return not batch["segment_ids"].any()


def rows(batch):
    return [{k: v[i] for k, v in batch.items()} for i in np.ndindex(batch["inputs"].shape[:-1])]


def host_stream(batches, bos: int, packed: bool) -> list[int]:
    """The tokens one process emitted, in order, each once (rows are back-to-back pieces of its documents)."""
    out = []
    for batch in batches:
        for row in rows(batch):
            seg, inputs, targets, weights = row["segment_ids"], row["inputs"], row["targets"], row["loss_weights"]
            if packed:  # a row is T + 1 consecutive tokens of the stream; the last is only a target
                out += inputs[seg != 0].tolist()
                if seg[-1] != 0 and (weights[-1] == 1 or targets[-1] == bos):
                    out.append(int(targets[-1]))
            elif seg[0] != 0:  # one piece per row; a piece that continues a document repeats its first token
                out += ([bos] if inputs[0] == bos else []) + targets[weights == 1].tolist()
    return out


def documents_read(streams: list[list[int]], bos: int, eos: int):
    """The documents in the processes' streams: whole ones, and the halves of a document one process
    stopped in (a head without EOS) and another continued (a tail without BOS), joined."""
    whole, heads, tails = [], [], []
    for stream in streams:
        piece = []
        for token in stream:
            piece.append(token)
            if token == eos:
                (whole if piece[0] == bos else tails).append(tuple(piece))
                piece = []
        if piece:
            assert piece[0] == bos, "a stream ends inside a continuation"
            heads.append(tuple(piece))
    return collections.Counter(whole), heads, tails


def joined(heads, tails, docs: set) -> list[tuple]:
    out, tails = [], list(tails)
    for head in heads:
        match = [t for t in tails if head + t in docs]
        assert len(match) == 1, f"no single continuation for a document cut after {len(head)} tokens"
        tails.remove(match[0])
        out.append(head + match[0])
    assert not tails, f"{len(tails)} continuation(s) of documents nobody started"
    return out


def epoch_documents(config) -> collections.Counter:
    docs = make_inputs(config, log=lambda *a: None, process_index=0, process_count=1).sources.train[0].documents
    return collections.Counter(tuple(docs[i].tolist()) for i in range(len(docs)))


def run_elastic(config, old: int, new: int, before: int):
    """Each process' batches: `old` processes for `before` steps, then `new` (merged) to the epoch's end."""
    iterators = [iterator(config, i, old) for i in range(old)]
    batches = [[next(it) for _ in range(before)] for it in iterators]
    assert not any(is_padding(b) for bs in batches for b in bs), "the epoch ended before the checkpoint"
    merged = elastic.merge([it.get_state() for it in iterators], config, new)
    for i, state in enumerate(merged):
        it, mine = iterator(config, i, new, state), []
        for _ in range(1000):
            batch = next(it)
            if is_padding(batch):
                break
            mine.append(batch)
        batches.append(mine)
    return batches, merged


def assert_every_document_once(config, batches, packed: bool):
    bos, eos = 1, 2
    want = epoch_documents(config)
    whole, heads, tails = documents_read([host_stream(b, bos, packed) for b in batches], bos, eos)
    got = whole + collections.Counter(joined(heads, tails, set(want)))
    assert got == want, (sum((got - want).values()), "repeated", sum((want - got).values()), "skipped")
    return heads


@pytest.mark.parametrize("old, new, before", [(2, 1, 2), (2, 3, 1), (3, 2, 1), (1, 4, 3)])
def test_merged_states_read_every_document_exactly_once(corpus, old, new, before):
    config = cfg(corpus)
    batches, merged = run_elastic(config, old, new, before)
    heads = assert_every_document_once(config, batches, packed=True)
    assert heads, "some process stopped inside a document (its remainder is a leftover with an offset)"
    layouts = [s["parent"]["parent"]["layout"] for s in merged]
    assert [(l["index"], l["count"]) for l in layouts] == [(q, new) for q in range(new)]


def test_unpacked_rows_merge_at_piece_boundaries(corpus):
    config = cfg(corpus, "packing=false")
    batches, _ = run_elastic(config, 2, 1, 2)
    assert_every_document_once(config, batches, packed=False)


def test_an_unchanged_process_count_restores_as_saved(corpus):
    """A merge into the same count is a resume like any other: the batches that follow are the same."""
    config = cfg(corpus, "num_epoch=-1")
    a = iterator(config, 0, 2)
    for _ in range(3):
        next(a)
    state = a.get_state()
    after = [next(a)["inputs"] for _ in range(3)]
    b = iterator(config, 0, 2, state)
    assert all((x == next(b)["inputs"]).all() for x in after)
    assert state["parent"]["layout"] == elastic.fresh_layout(0, 2)


def test_endless_data_continues_past_the_merge_into_the_next_epoch(corpus):
    config = cfg(corpus, "num_epoch=-1")
    olds = [iterator(config, i, 2) for i in range(2)]
    for _ in range(2):
        for it in olds:
            next(it)
    (state,) = elastic.merge([it.get_state() for it in olds], config, 1)
    it = iterator(config, 0, 1, state)
    for _ in range(30):  # well past the 37 documents of one epoch: the tail goes on
        assert not is_padding(next(it))


def test_merge_arithmetic():
    layouts = elastic.merge_layouts([(elastic.fresh_layout(0, 2), 3, 0), (elastic.fresh_layout(1, 2), 5, 7)], 1)
    # process 0 read positions 0, 2, 4; process 1 read 1, 3, 5, 7, 9 and 7 tokens of 11
    assert layouts == [{"index": 0, "count": 1, "start": 12, "leftovers": [[6, 0], [8, 0], [10, 0], [11, 7]]}]


def test_a_state_saved_before_layouts_restores(corpus):
    """Checkpoints written before elastic.py kept {"next_index": n} for the documents, without a layout."""
    config = cfg(corpus, "num_epoch=-1")
    a = iterator(config, 1, 2)
    for _ in range(2):
        next(a)
    state = a.get_state()
    del state["parent"]["layout"]
    after = [next(a)["inputs"] for _ in range(2)]
    b = iterator(config, 1, 2, state)
    assert all((x == next(b)["inputs"]).all() for x in after)


def test_synthetic_data_continues_at_the_same_batch():
    config = h.config("dataset_type=synthetic", *h.TINY_MODEL)
    assert elastic.merge([{"next_index": 4}, {"next_index": 4}], config, 3) == [{"next_index": 4}] * 3
    with pytest.raises(DataError, match="disagree on the batch index"):
        elastic.merge([{"next_index": 4}, {"next_index": 5}], config, 1)


@pytest.mark.parametrize("extra, message", [
    (["grain_packing_type=first_fit"], "first_fit holds documents in open bins"),
    (["grain_worker_count=2"], "each worker process keeps its own position"),
])
def test_inputs_that_cannot_merge_are_refused_with_the_alternative(corpus, extra, message):
    config = cfg(corpus, *extra)
    assert message in elastic.unsupported(config)
    with pytest.raises(DataError, match=message):
        elastic.merge([{}, {}], config, 1)


def test_sequential_sources_are_refused(tmp_path):
    path = h.write_jsonl(str(tmp_path / "a.jsonl"), h.texts(4))
    config = h.config("dataset_type=jsonl", f"grain_train_files={path}", "tokenizer_path=x.model", *h.TINY_MODEL)
    assert "shards by file" in elastic.unsupported(config) and "dataset_type=arrayrecord" in elastic.unsupported(config)
