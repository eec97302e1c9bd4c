"""SIGTERM to ONE of two training processes: both save the same step and exit 143; the same
commands then resume from it on both.

    python end_to_end/cpu/preempt_multiprocess.py

Two local JAX processes (2 CPU devices each, gloo collectives) train the tiny model. After some
steps process 1 alone gets SIGTERM; JAX's preemption service tells process 0, and both save at the
same step (maxtrain/training/preemption.py). Prints PASS/FAIL with the step checked.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from maxtrain.checkpointing import files as checkpoint_files  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.errors import run_cli  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=0.3", "eval_interval=-1", "max_new_tokens=0",
        "enable_tensorboard=false", "log_period=1000", "checkpoint_period=100000"]


def start(out: str, port: int, steps: int) -> list[subprocess.Popen]:
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "maxtrain.train", os.path.join(REPO, "configs", "base.yml"), *TINY,
               f"steps={steps}", f"base_output_directory={out}", "run_name=mp", f"dataset_cache_dir={out}/cache",
               f"metrics_file={out}/metrics.jsonl", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
               f"process_id={i}"]
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        with open(os.path.join(out, f"process{i}_{steps}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="preempt_multiprocess", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    out = tempfile.mkdtemp(prefix="maxtrain_preempt_")
    metrics = os.path.join(out, "metrics.jsonl")
    failures = []
    procs = start(out, free_port(), steps=100000)
    deadline = time.time() + 400
    while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 20):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            failures.append("training did not get going")
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=300) for p in procs]
    ckpts = os.path.join(out, "mp", "checkpoints")
    saved = checkpoint_files.complete_steps(ckpts)
    log0 = open(os.path.join(out, "process0_100000.log")).read()
    said = re.search(r"SIGTERM \(preemption\): saving step (\d+)", log0)
    print(f"SIGTERM to process 1 only: exit codes {codes}, process 0 logged "
          f"{said.group(0) if said else 'nothing'!r}, checkpoints on disk {saved}")
    if codes != [143, 143] or not said or saved != [int(said.group(1))]:
        failures.append("both processes should exit 143 after saving the same step")
    if saved:
        procs = start(out, free_port(), steps=saved[-1] + 5)
        codes = [p.wait(timeout=400) for p in procs]
        logs = [open(os.path.join(out, f"process{i}_{saved[-1] + 5}.log")).read() for i in range(2)]
        resumed = "Resuming from" in logs[0] and f"/{saved[-1]}" in logs[0]
        print(f"re-run to step {saved[-1] + 5}: exit codes {codes}, resumed from {saved[-1]}: {resumed}, "
              f"checkpoints {checkpoint_files.complete_steps(ckpts)}")
        if codes != [0, 0] or not resumed or checkpoint_files.complete_steps(ckpts)[-1] != saved[-1] + 5:
            failures.append("the re-run did not resume and finish:\n" + logs[0][-2000:] + logs[1][-2000:])
    shutil.rmtree(out, ignore_errors=True)
    if failures:
        print("FAIL preempt_multiprocess: " + "\n      ".join(failures))
        return 1
    print(f"PASS preempt_multiprocess: both processes saved step {saved[-1]} on a SIGTERM to one of them, and resumed from it")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("preempt_multiprocess", main))
