"""A run resumed from its checkpoint at step k is fed exactly the batches an uninterrupted run sees from k + 1."""

from __future__ import annotations

import shutil

import data_helpers as h
import jax
import numpy as np

from maxtrain import train
from maxtrain.data import pipeline


def test_resumed_run_sees_the_same_batches_as_an_uninterrupted_run(tmp_path, tmp_path_factory, monkeypatch):
    tok = h.tokenizer_path(tmp_path_factory)
    corpus = h.prepared(tmp_path_factory, "resume_corpus", h.texts(50, "r"), tok)
    seen = []
    to_global = pipeline.to_global

    def tap(batch, *args, **kwargs):  # records every training batch the trainer turns into a global array
        if batch["inputs"].ndim == 3:
            seen.append({k: v.copy() for k, v in batch.items()})
        return to_global(batch, *args, **kwargs)

    monkeypatch.setattr(pipeline, "to_global", tap)
    args = [h.BASE, *h.TINY_MODEL, "dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord",
            "grain_packing_type=concat_then_split", "max_target_length=32", "per_device_batch_size=1",
            "eval_interval=-1", "max_new_tokens=0", "enable_tensorboard=false", "checkpoint_period=3",
            "learning_rate_schedule_steps=6", f"base_output_directory={tmp_path}"]  # one schedule for both runs

    full = train.main(args + ["run_name=full", "steps=6"])
    uninterrupted, seen[:] = seen[:], []
    # a run stopped right after its step-3 checkpoint: the same directory, without what came later
    shutil.copytree(tmp_path / "full" / "checkpoints" / "3", tmp_path / "resumed" / "checkpoints" / "3")
    resumed = train.main(args + ["run_name=resumed", "steps=6"])  # resumes from the checkpoint at step 3

    assert len(uninterrupted) == 6 and len(seen) == 3
    for got, want in zip(seen, uninterrupted[3:]):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    assert len({b["inputs"].tobytes() for b in uninterrupted}) == 6  # six different batches
    # the same batches from the same restored state: the same parameters at the end
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["params"]),
                 jax.device_get(full.state["params"]))
