"""Packing real text into 64k-token rows, and those rows under context parallelism 4.

At max_target_length = 65,536 a row holds many documents (segment ids 1, 2, ... and positions from 0 in each),
and a document longer than the row is cut as data/packing.py says: concat_then_split carries it on into the next
row (positions from 0 again there), first_fit cuts it into pieces starting every T tokens. Context parallelism
then lays each row out over 4 devices (parallel/context.py); the ring's mask of every (query block, key block)
pair, built from the tokens' segment ids and original indices, must be the unsplit causal mask of the row: no
attention across documents, whichever device holds which token.
"""

from __future__ import annotations

import data_helpers as h
import grain
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.data import packing
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.models.attention import ring
from maxtrain.parallel import context

T = 65536
CP = 4


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """The test corpus' texts as documents [bos, ids..., eos], and at index 200 one of 2 T + 3,003 tokens (the
    tokens of many texts run together): longer than two rows, its every piece over 1,000 tokens."""
    tok = tokenizer_lib.load(h.tokenizer_path(tmp_path_factory))
    out = [np.asarray(tokenizer_lib.document(tok, ids), np.int32) for ids in tok.encode_batch(h.texts(400, "a"))]
    long_ids = [i for ids in tok.encode_batch(h.texts(6000, "long")) for i in ids]
    assert len(long_ids) > 2 * T + 3001 and max(len(d) for d in out) < 1000
    out.insert(200, np.asarray(tokenizer_lib.document(tok, long_ids[:2 * T + 3001]), np.int32))
    return out


def _rows(docs, kind):
    cfg = h.config(f"max_target_length={T}", f"grain_packing_type={kind}")
    return list(packing.train_rows(grain.MapDataset.source(docs).to_iter_dataset(), cfg, 2))


def _segments(ex):
    """(segment id, its input tokens, its positions) of every packed segment of a row, in order."""
    seg = ex["segment_ids"]
    return [(s, ex["inputs"][seg == s], ex["positions"][seg == s]) for s in np.unique(seg[seg > 0])]


@pytest.mark.parametrize("kind", ["concat_then_split", "first_fit"])
def test_64k_rows_keep_documents_apart_and_cut_a_long_one_as_documented(docs, kind):
    rows = _rows(docs, kind)
    long_doc = docs[200]
    pieces_of_long = []
    for ex in rows:
        assert ex["inputs"].shape == (T,)
        segments = _segments(ex)
        for s, tokens, positions in segments:
            where = np.flatnonzero(ex["segment_ids"] == s)
            assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))  # one run a segment
            assert np.array_equal(positions, np.arange(len(positions)))  # positions restart per document
            assert ex["loss_weights"][where[-1]] == 0 or where[-1] == T - 1  # no target across a boundary
            if len(tokens) > 1000:  # with its last target when that continues it (the row's last token)
                last = ex["targets"][where[-1]:] if ex["loss_weights"][where[-1]] else []
                pieces_of_long.append(np.concatenate([tokens, last]))
        assert np.all(ex["loss_weights"][ex["segment_ids"] == 0] == 0)
    # the long document, cut as data/packing.py says
    if kind == "concat_then_split":  # back to back: its pieces are consecutive runs of it, continued row to row
        assert len(pieces_of_long) == 3 and np.array_equal(np.concatenate(pieces_of_long), long_doc)
        assert [len(p) for p in pieces_of_long[1:-1]] == [T + 1]  # a middle piece fills its whole row
    else:  # whole pieces starting every T tokens (one token shared), each alone at the start of its row
        expected = packing.pieces(long_doc, T)
        assert len(pieces_of_long) == len(expected) >= 3
        for got, want in zip(pieces_of_long, expected):
            assert np.array_equal(got, want)


@pytest.mark.parametrize("reorder", context.REORDER_STRATEGIES)
def test_under_context_parallelism_4_the_ring_masks_are_the_rows_causal_document_mask(docs, reorder):
    ex = _rows(docs, "concat_then_split")[0]
    seg, pos = ex["segment_ids"], ex["positions"]
    order = context.layout(T, CP, reorder)  # order[p]: the original index of the token at layout position p
    laid = {k: np.asarray(context.to_layout(jnp.asarray(ex[k])[None], CP, reorder=reorder))[0]
            for k in ("inputs", "segment_ids", "positions")}
    for k, laid_out in laid.items():  # each token keeps its segment id and position on whichever device holds it
        assert np.array_equal(laid_out, ex[k][order])
        assert np.array_equal(np.asarray(context.from_layout(jnp.asarray(laid_out)[None], CP, reorder=reorder))[0],
                              ex[k])
    rng = np.random.default_rng(0)
    per = T // CP
    crossing = 0
    for i in range(CP):  # query block of device i against the key block of device j, sampled
        for j in range(CP):
            qs, ks = rng.choice(per, 768, replace=False), rng.choice(per, 768, replace=False)
            q_idx, k_idx = order[i * per + qs], order[j * per + ks]
            got = np.asarray(ring.block_mask(jnp.asarray(laid["segment_ids"][i * per + qs])[None],
                                             jnp.asarray(laid["segment_ids"][j * per + ks])[None],
                                             jnp.asarray(q_idx), jnp.asarray(k_idx), causal=True,
                                             sliding_window=0))[0]
            # the reference: the same document piece (positions count up from its start) and not in the future
            start = q_idx[:, None] - pos[q_idx][:, None]
            want = (k_idx[None, :] <= q_idx[:, None]) & (k_idx[None, :] >= start)
            np.testing.assert_array_equal(got, want, err_msg=f"devices {i}, {j}")
            crossing += int(np.sum((k_idx[None, :] <= q_idx[:, None]) & ~want))
    assert crossing > 0  # earlier tokens of other documents were in the samples, and masked
    assert len(np.unique(seg)) > 50  # many documents in the row
