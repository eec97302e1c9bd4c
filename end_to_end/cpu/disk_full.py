"""A real full disk: train into a 1.6 MB tmpfs until a checkpoint no longer fits.

    sudo python end_to_end/cpu/disk_full.py        # needs root (mount); says SKIP otherwise

Checked, and printed with PASS/FAIL: the run stops with exit status 2 and an error that names the
failed step, "No space left on device" and the complete checkpoints; those checkpoints still read
back; after space is freed, the same command removes the half-written step, resumes from the
latest complete one and finishes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from maxtrain.checkpointing import files as checkpoint_files  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.errors import run_cli  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=0.3", "eval_interval=-1", "max_new_tokens=0",
        "enable_tensorboard=false", "log_period=1000", "checkpoint_period=20"]


def train(disk: str, cache: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "maxtrain.train", os.path.join(REPO, "configs", "base.yml"), *TINY,
           f"base_output_directory={disk}", "run_name=full", f"dataset_cache_dir={cache}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="disk_full", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    work = tempfile.mkdtemp(prefix="maxtrain_disk_full_")
    disk, cache = os.path.join(work, "disk"), os.path.join(work, "cache")
    os.makedirs(disk)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", disk], capture_output=True, text=True)
    if mounted.returncode != 0:
        print(f"SKIP disk_full: cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}); run as root")
        shutil.rmtree(work, ignore_errors=True)
        return 0
    failures = []
    try:
        full = train(disk, cache, "steps=200", "max_num_checkpoints_to_keep=-1")
        ckpts = os.path.join(disk, "full", "checkpoints")
        error = (re.findall(r"maxtrain: error: .*", full.stderr + full.stdout) or ["(none)"])[-1]
        intact = checkpoint_files.complete_steps(ckpts)
        print(f"run into a full disk: exit {full.returncode}; complete checkpoints {intact}; "
              f"left {[n for n in os.listdir(ckpts) if 'tmp' in n]}")
        print(f"  {error[:260]} ...")
        if full.returncode != 2 or "No space left on device" not in error or f"Complete checkpoints on disk: {intact}" \
                not in error or not intact:
            failures.append("the run did not stop with the expected error")
        for step in intact:
            checkpoint_files.read_params(os.path.join(ckpts, str(step)))  # raises if damaged
        print(f"  checkpoints {intact} read back")
        for step in intact[:-1]:  # free some space
            shutil.rmtree(os.path.join(ckpts, str(step)))
        last = intact[-1] if intact else None
        again = train(disk, cache, f"steps={last + 20 if last else 20}", "max_num_checkpoints_to_keep=1")
        resumed = re.search(r"Resuming from .*/(\d+)", again.stdout)
        removed = "removing a checkpoint that was never completed" in again.stdout
        print(f"after freeing space: exit {again.returncode}, removed the partial step: {removed}, resumed from "
              f"{resumed.group(1) if resumed else None}, complete checkpoints {checkpoint_files.complete_steps(ckpts)}")
        if again.returncode != 0 or not removed or not resumed or int(resumed.group(1)) != last:
            failures.append(f"the re-run did not resume cleanly:\n{again.stdout[-2000:]}{again.stderr[-2000:]}")
    finally:
        subprocess.run(["umount", disk], check=False)
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("FAIL disk_full: " + "\n      ".join(failures))
        return 1
    print("PASS disk_full: a full disk stopped the run with a clear error, earlier checkpoints stayed intact, and the run resumed")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("disk_full", main))
