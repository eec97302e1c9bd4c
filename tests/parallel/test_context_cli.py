"""Context parallelism through the real train command: maxtrain.train's main with overrides, 3 steps of the tiny
model on the embedded corpus (packed rows: several documents a row) on 8 simulated CPU devices, with
ici_context_parallelism=4 and each strategy, logs the per-step losses of ici_context_parallelism=1 within 1e-5
relative (float32 sums in another order: measured differences ~1e-7 relative; a wrong mask moves the loss at the 1e-2
level). usp runs on 2 simulated slices (num_slices=2) with dcn_context_parallelism=2 x ici_context_parallelism=2.
"""

from __future__ import annotations

import functools
import json

import pytest

from maxtrain import train
from maxtrain.config import with_overrides

STEPS = 3  # kv heads 4 (TINY has 2): ulysses splits them over CP 4
RUN = ("base_num_kv_heads=4", "default_corpus_max_mb=0.3", "eval_interval=-1", "enable_checkpointing=false", "log_period=1",
       f"steps={STEPS}", "learning_rate=1e-2", "max_target_length=64")


@functools.lru_cache(maxsize=None)
def _losses(tmp_root: str, *overrides: str) -> list[float]:
    from conftest import BASE_YML, TINY  # pylint: disable=import-outside-toplevel
    name = "-".join(o.split("=")[1] for o in overrides) or "cp1"
    metrics = f"{tmp_root}/{name}.jsonl"
    args = with_overrides([BASE_YML, *TINY, f"base_output_directory={tmp_root}", f"run_name={name}"], *RUN,
                          f"metrics_file={metrics}", *overrides)
    train.main(args)
    with open(metrics, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if "learning/loss" in line]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return [r["learning/loss"] for r in rows]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cp_cli"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all_gather", "ring", "ulysses", "usp"])
def test_the_train_command_with_context_parallelism_logs_the_losses_of_one_context_device(tmp_root, strategy):
    reference = _losses(tmp_root)
    if strategy == "usp":
        cp = ("ici_context_parallelism=2", "dcn_context_parallelism=2", "num_slices=2")
    else:
        cp = ("ici_context_parallelism=4",)
    losses = _losses(tmp_root, *cp, f"context_parallel_strategy={strategy}")
    assert losses == pytest.approx(reference, rel=1e-5)
    assert len(set(reference)) == STEPS  # the steps train: a loss that did not move would compare nothing


@pytest.mark.slow
def test_the_train_command_with_sparse_attention_under_context_parallelism_logs_the_losses_of_one_device(tmp_root):
    """DeepSeek Sparse Attention (a tiny DeepSeek-V3.2, index_topk=6 of 64 tokens) with the indexer's sparse stage
    trained, ici_context_parallelism=4 (all_gather, selected_context.py) against 1."""
    # deferred: as conftest's above (the test directory's modules import once pytest has set the path)
    from test_context_sparse_attention import DEEPSEEK  # pylint: disable=import-outside-toplevel
    dsa = tuple(o for o in DEEPSEEK if o.split("=")[0] not in {r.split("=")[0] for r in RUN})
    dsa += ("indexer_training=sparse",)
    reference = _losses(tmp_root, *dsa)
    assert _losses(tmp_root, *dsa, "ici_context_parallelism=4") == pytest.approx(reference, rel=1e-5)
    assert len(set(reference)) == STEPS


V4_STEPS = 2  # the second step's loss already follows the first step's gradients under context parallelism
# one layer of each kind (the preset's 4th layer is a second CSA): the compile is most of the run's time
V4_LAYERS = ("base_num_decoder_layers=3",
             "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention,sliding_attention]")


@functools.lru_cache(maxsize=None)
def _v4_losses(tmp_root: str, *overrides: str) -> list[float]:
    """_losses for deepseek4-tiny (its own sizes, not TINY's; 3 layers, 2 steps) at 64 tokens: the 32-token window,
    HCA's 16-token and CSA's 4-token entries and the indexer's top 8 all drop keys."""
    from conftest import BASE_YML  # pylint: disable=import-outside-toplevel
    name = "v4-" + ("-".join(o.split("=")[1] for o in overrides) or "cp1")
    metrics = f"{tmp_root}/{name}.jsonl"
    run = [o for o in RUN if not o.startswith(("base_num_kv_heads", "steps"))]
    # max_new_tokens=0, as TINY's runs above: no end-of-run greedy sample (a prefill and decode loop compiled after
    # the steps, nothing this test reads; V4's greedy decoding is test_deepseek_v4_decode's)
    args = with_overrides([BASE_YML, "model_name=deepseek4-tiny", "vocab_size=512", "per_device_batch_size=1",
                           "dtype=float32", "remat_policy=none", "enable_tensorboard=false", "max_new_tokens=0",
                           f"base_output_directory={tmp_root}", f"run_name={name}"], *run, *V4_LAYERS,
                          f"steps={V4_STEPS}", f"metrics_file={metrics}", *overrides)
    train.main(args)
    with open(metrics, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if "learning/loss" in line]
    assert [r["step"] for r in rows] == list(range(1, V4_STEPS + 1)), rows
    return [r["learning/loss"] for r in rows]


@pytest.mark.slow
def test_the_train_command_with_deepseek_v4_under_context_parallelism_logs_the_losses_of_one_device(tmp_root):
    """deepseek4-tiny (sliding, CSA and HCA layers; packed rows of the embedded corpus), ici_context_parallelism=4
    (all_gather, deepseek_v4/compressed_context.py) against 1."""
    reference = _v4_losses(tmp_root)
    assert _v4_losses(tmp_root, "ici_context_parallelism=4") == pytest.approx(reference, rel=1e-5)
    assert len(set(reference)) == V4_STEPS
