"""scripts/gpu_selected_check.py (issue 58's GPU row: the selected-key kernel against a float32 reference, and its
speed against dense cuDNN) in its --dry-run: the same code path on tiny shapes with the kernels interpreted, both
backwards and the fused index scores checked, every speed item timed and written to selected.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_the_dry_run_checks_both_backwards_and_times_every_item(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_selected_check.py"), "--out",
                           str(tmp_path), "--dry-run", "--tiles", "4x8x4", "--iters", "1"],  # each item timed once
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "selected.json").read_text())
    for name in ("selected kernel bf16", "selected kernel bf16, atomic backward"):
        check = report["check"][name]
        assert check["pass"] and max(check[key] for key in ("o_c", "dq_c", "dq_r", "dc", "dk_r")) < 2e-2, check
    assert report["check"]["index scores kernel"]["scores"] < 1e-5
    every = ("selected kernel", "selected kernel, atomic backward", "selected kernel forward", "selected plain jnp",
             "indexer choice", "indexer choice, fused scores", "fused scores alone, every key")
    assert set(report["speed"]) == ({f"{name} T{t}" for name in every for t in (256, 512)}
                                    | {"forward tiles 4x8 w4 T256", "fwd+bwd tiles 4x8 w4 T256"})  # tiles: 1st length
    assert all(item["ms"] > 0 for item in report["speed"].values()) and not report["skipped"]
    assert "every check passed" in done.stdout


def test_it_refuses_to_run_without_a_gpu_or_dry_run(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_selected_check.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2 and "needs a GPU" in done.stderr and "--dry-run" in done.stderr
