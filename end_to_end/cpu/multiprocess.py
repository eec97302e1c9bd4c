"""A real multi-process run: 2 JAX processes x 2 CPU devices (gloo) train like 1 process x 4 devices.

    python end_to_end/cpu/multiprocess.py [--steps 10]

The default model (a smaller batch) on dataset_type=synthetic, whose rows are drawn from their
global index, so both layouts see the same global batches:
    reference    1 process x 4 devices, steps 1..N
    two-process  2 processes x 2 devices (coordinator on 127.0.0.1), steps 1..N/2, saving at N/2;
                 then the same 2 commands with steps=N, which resume from N/2
PASS when every step's loss of the two-process run is within a relative 1e-5 of the reference
(the cross-device sums are added in a different order; measured differences are ~1e-7), the
second launch resumed from step N/2, and only process 0 printed metrics.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

RTOL = 1e-5
SMALL = ["dataset_type=synthetic", "per_device_batch_size=2", "max_target_length=128", "log_period=1",
         "max_new_tokens=0", "async_checkpointing=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(args: list[str], out: Path, name: str) -> list[str]:
    port, procs, logs = free_port(), [], []
    for i in range(2):
        logs.append(out / f"{name}_process{i}.log")
        procs.append(common.start("maxtrain.train", [*args, f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
                                                     f"process_id={i}"], logs[-1], common.env(devices=2)))
    common.wait(procs, logs)
    return [log.read_text() for log in logs]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="multiprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="N (even)")
    n = common.positive(parser, "--steps", parser.parse_args(argv).steps, even=True)
    out = common.out_dir("multiprocess")
    args = [*SMALL, f"base_output_directory={out}", f"learning_rate_schedule_steps={n}", f"checkpoint_period={n // 2}"]
    common.run("maxtrain.train", [*args, "run_name=reference", f"steps={n}", f"metrics_file={out}/reference.jsonl"],
               out / "reference.log", common.env(devices=4))
    mp = [*args, "run_name=two_process", f"metrics_file={out}/two_process.jsonl"]
    two_processes([*mp, f"steps={n // 2}"], out, "first")
    second = two_processes([*mp, f"steps={n}"], out, "second")

    ref, two = common.train_losses(out / "reference.jsonl"), common.train_losses(out / "two_process.jsonl")
    worst = max(abs(two[s]["learning/loss"] - ref[s]["learning/loss"]) / abs(ref[s]["learning/loss"]) for s in ref)
    resumed = f"Resuming from {out}/two_process/checkpoints/{n // 2}" in second[0]
    quiet = "| loss " not in second[1]
    ok = sorted(two) == list(range(1, n + 1)) and worst <= RTOL and resumed and quiet
    return common.verdict("multiprocess", ok,
                          f"max relative loss difference 2x2 vs 1x4 over {n} steps {worst:.2e} (tolerance {RTOL:g}); "
                          f"resumed from step {n // 2}: {resumed}; only process 0 printed metrics: {quiet}")


if __name__ == "__main__":
    common.main("multiprocess", main)
