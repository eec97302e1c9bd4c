"""Eval input: the first N batches every time, or exactly one epoch; padding never changes the loss."""

from __future__ import annotations

import data_helpers as h
import numpy as np
import pytest

from maxtrain.data import DataError, make_inputs
from maxtrain.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tok = h.tokenizer_path(tmp_path_factory)
    return h.prepared(tmp_path_factory, "eval_corpus", h.texts(80, "v", max_words=60), tok, ("--eval-fraction", "0.5"))


def _inputs(corpus, *overrides, logs=None):
    cfg = h.config("vocab_size=320", "dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord",
                   f"grain_eval_files={corpus}/eval-*.arrayrecord", "max_target_length=48", "per_device_batch_size=1",
                   *overrides)
    return make_inputs(cfg, log=(logs.append if logs is not None else lambda *_: None))


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_eval_steps_n_gives_the_same_first_n_batches_every_time(corpus):
    evals = _inputs(corpus, "eval_steps=3").eval_batches
    first, second = list(evals), list(evals)
    assert len(evals) == len(first) == 3 and _same(first, second) and _same([evals[2]], first[2:])
    everything = list(_inputs(corpus, "eval_steps=-1").eval_batches)
    assert _same(first, everything[:3])


def test_eval_steps_minus_one_is_exactly_one_epoch(corpus):
    inputs = _inputs(corpus, "eval_steps=-1")
    tok = tokenizer_lib.load(f"{corpus}/tokenizer.model")
    docs = [tok.decode(d[1:-1]) for d in inputs.sources.eval_pool]
    batches = list(inputs.eval_batches)
    assert sum(float(b["loss_weights"].sum()) for b in batches) == sum(len(d) - 1 for d in inputs.sources.eval_pool)
    assert sorted(t for b in batches for t in h.bos_documents(b, tok)) == sorted(h.doc_tag(d) for d in docs)
    assert batches[-1]["loss_weights"].sum() > 0  # no padding batch on a single host


def test_more_eval_steps_than_data_pads_with_zero_weight_batches(corpus):
    logs = []
    epoch = len(_inputs(corpus, "eval_steps=-1").eval_batches)
    batches = list(_inputs(corpus, f"eval_steps={epoch + 2}", logs=logs).eval_batches)
    assert len(batches) == epoch + 2
    assert all(b["loss_weights"].sum() == 0 and not b["segment_ids"].any() for b in batches[epoch:])
    assert any("evaluates them plus 2 padding batches" in m for m in logs)
    with pytest.raises(DataError, match=r"host\(s\) \[0\] have only \[\d+\] real batches.*generate_padding_batch_eval"):
        _inputs(corpus, f"eval_steps={epoch + 2}", "generate_padding_batch_eval=false")
