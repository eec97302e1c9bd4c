"""scripts/gpu_ring_check.py (issue 60's GPU row: a ring of one against plain attention, and the flash kernel's
speed with its tiles skipped by position and with every tile run) in its --dry-run: the same code path on tiny
shapes with the kernels interpreted. Every row must check and time: a row that breaks here would break on the lent
GPU, where each minute counts (the "every tile" row did, 2026-12-02: it patched a function that had moved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow  # a subprocess compiling six interpreted forward+backward programs (~20 s of CPU)
def test_the_dry_run_checks_and_times_every_row(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_ring_check.py"), "--out",
                           str(tmp_path), "--dry-run"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "ring.json").read_text())
    assert report["check"] and all(row["pass"] for row in report["check"].values()), report["check"]
    assert {"ring of one (flash)", "ring of one (cudnn forward and backward)",
            "flash masked by position, every tile"} <= set(report["speed"])
    assert set(report["check"]) <= set(report["speed"])  # every checked row is timed too
    assert all(row["ms"] > 0 for row in report["speed"].values())
    assert "every check passed" in done.stdout
