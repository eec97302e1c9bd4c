"""Shared by the checkpoint tests: a tiny model on the default corpus, runs in-process or as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

# ~50k parameters, 8 sequences of 32 tokens per step over the 8 simulated devices.
TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=0.3", "eval_interval=-1", "max_new_tokens=0",
        "enable_tensorboard=false", "log_period=1000"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One tokenizer and tokenized corpus for every test of the session."""
    return str(tmp_path_factory.mktemp("corpus_cache"))


def args(out: Path, run_name: str, cache: str, *overrides: str) -> list[str]:
    """The command line; `overrides` replace the same keys above (a key given twice is refused)."""
    from maxtrain.config import with_overrides  # pylint: disable=import-outside-toplevel

    return with_overrides([str(REPO / "configs" / "base.yml"), *TINY, f"base_output_directory={out}",
                           f"run_name={run_name}", f"dataset_cache_dir={cache}"], *overrides)


def train(out: Path, run_name: str, cache: str, *overrides: str) -> dict:
    """One training run in this process (the suite's 8 CPU devices)."""
    from maxtrain import train as train_lib  # pylint: disable=import-outside-toplevel

    return train_lib.main(args(out, run_name, cache, *overrides))


def train_subprocess(out: Path, run_name: str, cache: str, *overrides: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "maxtrain.train", *args(out, run_name, cache, *overrides)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def logged(metrics_file: Path) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} from a metrics_file; a step logged twice must agree with itself."""
    out = {}
    for line in metrics_file.read_text().splitlines():
        m = json.loads(line)
        value = (m["learning/loss"], m["learning/grad_norm"])
        assert out.setdefault(m["step"], value) == value, f"step {m['step']} logged twice with different values"
    return out


def flat(tree) -> dict[str, np.ndarray]:
    import jax  # pylint: disable=import-outside-toplevel

    from maxtrain.checkpointing import files as checkpoint_files  # pylint: disable=import-outside-toplevel

    return {checkpoint_files.path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_bitwise_equal(a, b, what: str) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys(), what
    differing = [k for k in fa if fa[k].dtype != fb[k].dtype or fa[k].tobytes() != fb[k].tobytes()]
    assert not differing, f"{what}: not bitwise equal at {differing}"
