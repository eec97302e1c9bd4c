"""Packing: every target counted once, attention never crosses documents, padding never counts."""

from __future__ import annotations

import functools
import itertools
import json

import data_helpers as h
import grain
import jax
import numpy as np
import pytest

from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.data import packing

T = 32


def _docs(lengths, start=10):
    """Documents [BOS, distinct tokens..., EOS] so every token says where it came from."""
    out, next_token = [], start
    for n in lengths:
        body = np.arange(next_token, next_token + n - 2, dtype=np.int32)
        next_token += n - 2
        out.append(np.concatenate([[1], body, [2]]).astype(np.int32))
    return out


def _rows(docs, *overrides, rows=4, eval_rows=False):
    cfg = h.config(f"max_target_length={T}", *overrides)
    ds = grain.MapDataset.source(docs).to_iter_dataset()
    made = (packing.eval_rows if eval_rows else packing.train_rows)(ds, cfg, rows)
    return list(made)


def test_pieces_predict_every_target_of_a_document_exactly_once():
    rng = np.random.default_rng(0)
    for n in list(range(2, 80)) + list(rng.integers(2, 500, size=50)):
        doc = np.arange(n)
        predicted = [t for p in packing.pieces(doc, T) for t in p[1:]]
        assert predicted == list(range(1, n))
        assert all(2 <= len(p) <= T + 1 for p in packing.pieces(doc, T))


@pytest.mark.parametrize("setting", [("packing=false",), ("grain_packing_type=first_fit",)])
def test_piece_packings_keep_documents_whole_and_count_each_target_once(setting):
    docs = _docs([5, 40, 33, 2 * T + 7, 12, 3, 90])
    examples = _rows(docs, *setting)
    predicted = []
    for ex in examples:
        w, seg = ex["loss_weights"], ex["segment_ids"]
        assert np.all(w[seg == 0] == 0)  # padding never counts
        predicted += list(ex["targets"][w > 0])
        for s in set(seg[seg > 0]):  # a segment is one run of one document, positions from 0
            where = np.flatnonzero(seg == s)
            assert np.array_equal(ex["positions"][where], np.arange(len(where)))
            piece = list(ex["inputs"][where])
            assert any(piece == list(d[i:i + len(piece)]) for d in docs for i in range(len(d)))
    assert sorted(predicted) == sorted(t for d in docs for t in d[1:])


@pytest.mark.parametrize("kind", ["concat_then_split", "first_fit"])
@pytest.mark.parametrize("lengths", [[T + 1, 5, 2 * T + 2, 3, T, T + 2, 40, T + 1, 2, 9],
                                     [2 * T + 2, 2 * T + 2, 2, T + 1, 60, 40, 2 * T + 2, T + 1]])
def test_every_state_of_the_packers_restores_the_rest_exactly(kind, lengths):
    # lengths that fill rows exactly (T + 1, 2T + 2), leave one token over, or are tiny: Grain's own
    # ConcatThenSplitIterDataset restores several of these states wrongly (grain 0.2.18)
    docs = _docs(lengths)
    cfg = h.config(f"max_target_length={T}", f"grain_packing_type={kind}")

    def rows():
        return iter(packing.train_rows(grain.MapDataset.source(docs).to_iter_dataset(), cfg, 3))

    it, states, expected = rows(), [], []
    while True:
        states.append(json.loads(json.dumps(it.get_state())))
        try:
            expected.append(next(it)["inputs"])
        except StopIteration:
            break
    for k, state in enumerate(states):
        restored = rows()
        restored.set_state(state)
        rest = [r["inputs"] for r in restored]
        assert len(rest) == len(expected) - k and all(np.array_equal(a, b) for a, b in zip(rest, expected[k:])), k


def test_concat_then_split_rows_are_the_document_stream_without_padding():
    docs = _docs([5, 40, 33, 2 * T + 7, 12, 3, 90])
    examples = _rows(docs, "grain_packing_type=concat_then_split")
    stream = np.concatenate(docs)
    rebuilt = np.concatenate([np.append(ex["inputs"], ex["targets"][-1]) for ex in examples])
    assert np.array_equal(rebuilt[:len(stream)], stream) and not rebuilt[len(stream):].any()
    for ex in examples[:-1]:  # only the end of this finite stream is padded
        assert np.all(ex["segment_ids"] > 0)
    for ex in examples:  # a target counts unless it is padding (0) or the BOS (1) that starts the next document
        assert np.array_equal(ex["loss_weights"] > 0, (ex["segment_ids"] > 0) & (ex["targets"] >= 2))


@functools.cache
def _tiny_model():
    cfg = h.config(*h.TINY_MODEL, f"max_target_length={T}")
    rt = Runtime.from_config(cfg)
    forward = jax.jit(lambda p, tokens, positions, segments: Model.bind(cfg).forward(p, tokens, positions, segments, rt)[0])
    loss = jax.jit(lambda p, batch: Model.bind(cfg).loss_fn(p, batch, rt)[:2])
    return forward, loss, Model.bind(cfg).init_params(jax.random.key(3))


@pytest.mark.parametrize("kind", ["first_fit", "concat_then_split"])
def test_a_tokens_logits_do_not_change_when_another_document_in_its_row_changes(kind):
    forward, _, params = _tiny_model()
    rng = np.random.default_rng(1)
    a = np.concatenate([[1], rng.integers(4, 320, 11), [2]]).astype(np.int32)

    def logits_of_a(others_before, others_after, one_segment=False):
        row = _rows([*others_before, a, *others_after], f"grain_packing_type={kind}", rows=1)[0]
        segments = np.ones_like(row["segment_ids"]) if one_segment else row["segment_ids"]
        positions = np.arange(T, dtype=np.int32) if one_segment else row["positions"]
        logits = forward(params, row["inputs"][None], positions[None], segments[None])
        start = int(np.flatnonzero((row["inputs"] == 1) & (row["positions"] == 0))[len(others_before)])
        assert np.array_equal(row["inputs"][start:start + len(a)], a)  # a lies whole in the row
        return np.asarray(logits[0, start:start + len(a)])

    def doc(n):
        return np.concatenate([[1], rng.integers(4, 320, n - 2), [2]]).astype(np.int32)

    reference = logits_of_a([doc(6)], [doc(9)])
    # The same up to float32 rounding: where a sits in the row changes which of the matmuls' blocks its
    # keys fall in, so its sums add the same terms (the masked ones are exactly 0) in another order
    # (a few elements differ by ~1e-6 on CPU); a leak across documents is ~1e-3 (below).
    for before, after in [([doc(6)], [doc(9)]), ([doc(12)], [doc(3)]), ([], [doc(15)]), ([doc(4), doc(5)], [])]:
        np.testing.assert_allclose(logits_of_a(before, after), reference, rtol=0, atol=1e-5)
    # the test can fail: were the row one segment, a's logits would depend on the document before it
    first, second = logits_of_a([doc(6)], [], one_segment=True), logits_of_a([doc(6)], [], one_segment=True)
    assert np.abs(first - second).max() > 1e-3


def test_padding_never_contributes_to_the_loss():
    _, loss_fn, params = _tiny_model()
    docs = _docs([5, 20, 9, 14], start=4)
    rows = _rows(docs, "grain_packing_type=first_fit", rows=3)
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    pad = batch["segment_ids"] == 0
    assert pad.any()
    loss, weight = loss_fn(params, batch)
    assert float(weight) == sum(len(d) - 1 for d in docs)
    garbage = {k: v.copy() for k, v in batch.items()}
    noise = np.random.default_rng(0).integers(4, 320, size=pad.sum())
    garbage["inputs"][pad] = noise
    garbage["targets"][pad] = noise[::-1]
    garbage["positions"][pad] = 7
    loss2, weight2 = loss_fn(params, garbage)
    assert float(weight2) == float(weight)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)


def test_eval_rows_pack_pieces_even_when_training_concatenates():
    docs = _docs([5, 2 * T + 7, 12])
    examples = _rows(docs, "grain_packing_type=concat_then_split", eval_rows=True, rows=2)
    segments = [ex["positions"][ex["segment_ids"] == s][0] for ex in examples for s in set(ex["segment_ids"]) - {0}]
    assert all(p == 0 for p in segments)  # every piece starts at position 0 of its own segment
    assert sum(float(ex["loss_weights"].sum()) for ex in examples) == sum(len(d) - 1 for d in docs)
    assert list(itertools.chain(*[ex["targets"][ex["loss_weights"] > 0] for ex in examples])) == [
        t for d in docs for t in d[1:]]
