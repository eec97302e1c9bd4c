#!/usr/bin/env python3
"""What self-checking checkpoints cost: save and restore of a train state with and without checksums.

    python scripts/benchmark_checkpoint.py [--params-millions 300] [--rounds 3] [--dir /tmp/ckpt_bench]

Builds a train state shaped like maxtrain's (params, AdamW mu and nu: 3 float32 copies of the
parameters, random values so that compression is realistic) of about --params-millions parameters,
then, --rounds times, interleaved:

    save      Orbax saves the state as the trainer does (CheckpointManager, state + metadata items,
              synchronously), timed until it is complete; then the checksums of the step's files
              (checksums.write, what the trainer runs once Orbax is done), timed on their own
    restore   Orbax restores the state alone; then, as the trainer does (Checkpointer.restore),
              Orbax restores it while a thread verifies the step (checkpoint_files.check_step: every file
              hashed and compared with its checksum), and the restore waits for the verification.
              The page cache is dropped before each of the two when /proc/sys/vm/drop_caches is
              writable (else both read warm files); a verification alone is timed too, for reference

and prints each figure, the medians and the overhead (checksum time / Orbax time) with the load
average. The state needs about 4 x 4 bytes x parameters of memory at its peak (a host copy for the
save); the default 300M needs about 5 GB.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from maxtrain import errors, storage
from maxtrain.checkpointing import files as checkpoint_files, checksums


def make_state(params_millions: float, seed: int = 0) -> dict:
    """{"params", "mu", "nu"} of [L, D, D]-like float32 blocks adding up to about params_millions."""
    rng = np.random.default_rng(seed)
    per_block = 1024 * 4096  # one MLP matrix of a ~1B-class model
    blocks = max(1, int(params_millions * 1e6 // per_block))
    tree = {}
    for name in ("params", "mu", "nu"):
        tree[name] = {f"block_{i:03d}": jax.device_put(rng.standard_normal((1024, 4096), np.float32))
                      for i in range(blocks)}
    tree["step"] = jax.device_put(np.int32(1))
    return tree


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def check_dir(path: str) -> None:
    """--dir is emptied first and removed at the end: refuse one that holds anything but this benchmark's steps."""
    storage.check_output(path, False, f"--dir {path}")
    others = [n for n in (sorted(os.listdir(path)) if os.path.isdir(path) else [])
              if not n.split(".", 1)[0].isdigit()]  # its steps: "3", "3.orbax-checkpoint-tmp-..."
    if others:
        raise errors.PathError(f"--dir {path} holds other files ({', '.join(others[:3])}{' ...' if len(others) > 3 else ''}"
                               "), and the benchmark empties its directory first and removes it at the end; "
                               "give a new or empty directory")


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="benchmark_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--params-millions", type=float, default=300.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/tmp/ckpt_bench")
    args = p.parse_args(argv)
    if not args.params_millions > 0 or args.rounds < 1:
        p.error("--params-millions must be > 0 and --rounds >= 1")
    check_dir(args.dir)
    print("command: " + shlex.join(["python", "scripts/benchmark_checkpoint.py", *argv]))
    with errors.user_paths("--dir"):
        return measure(args)


def measure(args) -> dict:
    shutil.rmtree(args.dir, ignore_errors=True)
    t = time.time()
    state = make_state(args.params_millions)
    n = sum(x.size for x in jax.tree.leaves(state["params"]))
    size = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"state: {n / 1e6:.0f}M parameters, {size / 2**30:.2f} GiB with AdamW mu and nu (built in "
          f"{time.time() - t:.0f}s); {os.cpu_count()} CPUs")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    manager = ocp.CheckpointManager(args.dir, options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, create=True), item_handlers={
            "state": ocp.StandardCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()})
    figures = {k: [] for k in ("save", "checksums", "restore", "verify", "verified_restore")}
    dropped = False
    for r in range(args.rounds):
        step = r + 1
        t = time.perf_counter()
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    metadata=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()
        figures["save"].append(time.perf_counter() - t)
        step_dir = os.path.join(args.dir, str(step))
        t = time.perf_counter()
        checksums.write(step_dir)
        figures["checksums"].append(time.perf_counter() - t)

        def restore():
            t = time.perf_counter()
            restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
            jax.block_until_ready(restored.state)
            return time.perf_counter() - t

        def verified_restore():
            found = {}
            t = time.perf_counter()
            thread = threading.Thread(target=lambda: found.update(h=checkpoint_files.check_step(step_dir, remember=False)))
            thread.start()
            restore()
            thread.join()
            assert found["h"].status == "verified", found
            return time.perf_counter() - t

        dropped = drop_caches()
        figures["restore"].append(restore())
        dropped = drop_caches() and dropped
        figures["verified_restore"].append(verified_restore())
        drop_caches()
        t = time.perf_counter()
        assert checkpoint_files.check_step(step_dir, remember=False).status == "verified"
        figures["verify"].append(time.perf_counter() - t)
        print(f"round {r + 1}: save {figures['save'][-1]:.2f}s + checksums {figures['checksums'][-1]:.2f}s; "
              f"restore alone {figures['restore'][-1]:.2f}s, restore while verifying "
              f"{figures['verified_restore'][-1]:.2f}s (verification alone {figures['verify'][-1]:.2f}s)  "
              f"(load average {os.getloadavg()[0]:.2f})", flush=True)
        if step > 1:
            shutil.rmtree(os.path.join(args.dir, str(step - 1)), ignore_errors=True)
    manager.close()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"medians over {args.rounds} rounds: save {med['save']:.2f}s, checksums {med['checksums']:.2f}s "
          f"(+{100 * med['checksums'] / med['save']:.1f}% of the save); restore alone {med['restore']:.2f}s, "
          f"restore while verifying {med['verified_restore']:.2f}s (+{100 * (med['verified_restore'] / med['restore'] - 1):.1f}"
          f"% of the restore; verification alone {med['verify']:.2f}s); page cache "
          f"{'dropped before each restore' if dropped else 'not dropped (no permission): warm reads'}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return med


if __name__ == "__main__":
    errors.run_cli("benchmark_checkpoint", main)
