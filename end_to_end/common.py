"""Shared by the end-to-end scripts: run maxtrain's commands as a user would, read what they wrote,
and print one verdict line:

    PASS <check>: <the figure it checked>
    FAIL <check>: <the figure it checked>

Each script exits 0 on PASS and 1 on FAIL, and 2 with one line `<script>: error: ...` when what it was
given cannot be used (maxtrain.errors.run_cli). Runs are written under $E2E_OUT (default
outputs/end_to_end/) in a directory per script, emptied at the start.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's maxtrain, as the commands the scripts run (cwd ROOT)

from maxtrain import errors, storage  # noqa: E402  pylint: disable=wrong-import-position


def main(prog: str, function) -> None:
    """Runs a script's `function(argv)` as the commands run theirs: its verdict's exit status, or one line
    `prog: error: ...` and exit status 2 for something it was given that cannot be used."""
    sys.exit(errors.run_cli(prog, function))


def out_dir(name: str) -> Path:
    base = Path(os.environ.get("E2E_OUT", ROOT / "outputs" / "end_to_end")).resolve()
    path = base / name
    storage.check_output(str(path), False, f"E2E_OUT={base}: {path}", "; set E2E_OUT to a writable directory")
    with errors.user_paths("E2E_OUT"):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    return path


def positive(parser, flag: str, value: int, even: bool = False) -> int:
    """`value` of an integer option, refused (argparse's usage error, exit 2) unless >= 1 (and even)."""
    if value < 1 or (even and value % 2):
        parser.error(f"{flag} {value} must be {'an even number' if even else 'a number'} >= {2 if even else 1}")
    return value


def env(devices: int | None = None, **extra) -> dict:
    """This environment, with `devices` simulated CPU devices when given."""
    out = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    if devices is not None:
        flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        out["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        out.setdefault("JAX_PLATFORMS", "cpu")
    return out


def command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, "configs/base.yml", *args]


def start(module: str, args: list[str], log: Path, environment: dict | None = None) -> subprocess.Popen:
    """Starts `python -m module configs/base.yml args...` in the repo root, output to `log`."""
    cmd = command(module, args)
    print(f"$ {shlex.join(cmd[1:])}    (log: {log})", flush=True)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=environment or env(), stdout=f, stderr=subprocess.STDOUT)


def wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 3600) -> None:
    """Waits for every process; exits with a FAIL line (and the log's end) if one failed."""
    deadline = time.time() + timeout
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            code = "timeout"
        if code != 0:
            print(Path(log).read_text()[-4000:], file=sys.stderr)
            sys.exit(verdict("run", False, f"{log} ended with {code}"))


def run(module: str, args: list[str], log: Path, environment: dict | None = None, timeout: float = 3600) -> str:
    """Runs the command to completion (FAIL on error) and returns its output."""
    wait([start(module, args, log, environment)], [log], timeout)
    return Path(log).read_text()


def metrics(path: Path) -> list[dict]:
    """The JSON lines of a metrics_file (ToolError naming the line that is not a JSON object)."""
    with errors.user_paths():
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append(None)
            if not isinstance(out[-1], dict) or not isinstance(out[-1].get("step"), int):
                raise errors.ToolError(f"{path} line {number} is not a metrics line (a JSON object with a step); "
                                       "give the metrics_file a run wrote")
    return out


def train_losses(path: Path) -> dict[int, dict]:
    """{step: that step's training metrics} from a metrics_file (eval lines left out)."""
    return {m["step"]: m for m in metrics(path) if "learning/loss" in m}


def eval_losses(path: Path) -> dict[int, float]:
    return {m["step"]: m["eval/avg_loss"] for m in metrics(path) if "eval/avg_loss" in m}


def verdict(check: str, ok: bool, figure: str) -> int:
    print(f"{'PASS' if ok else 'FAIL'} {check}: {figure}", flush=True)
    return 0 if ok else 1


def eval_loss_falls_below(name: str, overrides: list[str], steps: int, threshold: float, every: int = 10) -> int:
    """Trains `steps` steps with `overrides`, evaluating every `every`; PASS when the eval loss falls at every
    evaluation and ends below `threshold` (the tiny-family scripts' check)."""
    out = out_dir(name)
    log = run("maxtrain.train", [f"base_output_directory={out}", f"run_name={name}", f"steps={steps}",
                                 f"eval_interval={every}", f"metrics_file={out}/metrics.jsonl", *overrides],
              out / "train.log")
    evals = eval_losses(out / "metrics.jsonl")
    curve = [evals[s] for s in sorted(evals)]
    print(f"eval losses: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(evals.items()))}; last lines:\n"
          + "\n".join(log.splitlines()[-4:]), flush=True)
    loss = evals.get(steps)
    falling = len(curve) >= 2 and all(b < a for a, b in zip(curve, curve[1:]))
    ok = loss is not None and loss < threshold and falling
    return verdict(name, ok, f"eval loss {loss:.4f} at step {steps} (threshold < {threshold}), "
                   f"{'falling' if falling else 'not falling'} at every evaluation"
                   if loss is not None else f"no eval loss at step {steps}")
