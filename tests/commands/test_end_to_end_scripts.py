"""The end-to-end scripts parse (bash -n, shellcheck when installed, Python compile), and the shared
checker passes and fails on the right figures. (Running them is end_to_end/run_cpu.sh's job.)"""

from __future__ import annotations

import json
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_SCRIPTS = sorted(ROOT.glob("end_to_end/**/*.sh"))
PYTHON_SCRIPTS = sorted(ROOT.glob("end_to_end/**/*.py"))
WITH_HELP = {"default_loss.py", "fp8_loss.py", "save_restore.py", "determinism.py", "multiprocess.py", "decode.py", "check.py"}


def test_the_suite_has_its_scripts():
    names = {p.relative_to(ROOT).as_posix() for p in SHELL_SCRIPTS + PYTHON_SCRIPTS}
    for name in ("end_to_end/run_cpu.sh", "end_to_end/cpu/default_loss.py", "end_to_end/cpu/save_restore.py",
                 "end_to_end/cpu/determinism.py", "end_to_end/cpu/multiprocess.py", "end_to_end/cpu/decode.py",
                 "end_to_end/gpu/gpt2_small.sh", "end_to_end/tpu/llama3_1b.sh"):
        assert name in names


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_python_scripts_compile_and_explain_themselves(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)
    if script.name in WITH_HELP:
        result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


def check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "end_to_end" / "check.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_check_eval_loss_uses_the_last_eval(tmp_path):
    metrics = tmp_path / "m.jsonl"
    lines = [{"step": 0, "eval/avg_loss": 8.3}, {"step": 1, "learning/loss": 8.0, "perf/per_device_tokens_per_sec": 10.0,
                                                  "perf/per_device_tflops_per_sec": 1.0, "perf/mfu": None},
             {"step": 50, "eval/avg_loss": 2.2}]
    metrics.write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    passed = check("eval-loss", metrics, "--below", 2.5, "--name", "x")
    assert passed.returncode == 0 and passed.stdout.startswith("PASS x: eval loss 2.2000 at step 50 (threshold < 2.5)")
    failed = check("eval-loss", metrics, "--below", 2.0)
    assert failed.returncode == 1 and failed.stdout.startswith("FAIL eval-loss: eval loss 2.2000")
    missing = check("eval-loss", tmp_path / "none.jsonl", "--below", 2.0)
    assert missing.returncode == 1 and "no metrics file" in missing.stdout
    throughput = check("throughput", metrics, "--skip", 0)
    assert throughput.returncode == 0 and "10 tokens/s/device" in throughput.stdout and "MFU nan%" in throughput.stdout
