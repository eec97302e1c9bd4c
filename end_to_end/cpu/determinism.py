"""Two identical runs are bitwise equal: every logged loss and gradient norm, and the final params.

    python end_to_end/cpu/determinism.py [--steps 30]

Runs the same command twice (the default model with a smaller batch, on the default corpus, on 4
simulated CPU devices so the sharded code paths and cross-device sums are exercised), then
compares the metrics files and the params of the two final checkpoints array by array.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

SMALL = ["per_device_batch_size=2", "max_target_length=128", "eval_interval=-1", "max_new_tokens=0",
         "viz_period=-1", "log_period=10", "async_checkpointing=false"]


def read_params(step_dir: Path) -> dict:
    """The params of a checkpoint as host numpy arrays, by name (whatever devices wrote it)."""
    import jax  # pylint: disable=import-outside-toplevel
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    path = str(step_dir / "state")
    saved = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree["params"]
    item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    params = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))["params"]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="determinism", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    steps = common.positive(parser, "--steps", parser.parse_args(argv).steps)
    out = common.out_dir("determinism")
    for name in ("a", "b"):
        common.run("maxtrain.train", [*SMALL, f"base_output_directory={out}", f"run_name={name}", f"steps={steps}",
                                      f"metrics_file={out}/{name}.jsonl"], out / f"{name}.log", common.env(devices=4))
    a, b = common.train_losses(out / "a.jsonl"), common.train_losses(out / "b.jsonl")
    keys = ("learning/loss", "learning/grad_norm")
    equal_steps = sum(all(a[s][k] == b[s][k] for k in keys) for s in a if s in b)
    pa, pb = read_params(out / "a" / "checkpoints" / str(steps)), read_params(out / "b" / "checkpoints" / str(steps))
    differing = [k for k in pa if k not in pb or not np.array_equal(pa[k], pb[k])]
    size = sum(x.size for x in pa.values())
    ok = len(a) == steps and equal_steps == steps and not differing and pa.keys() == pb.keys()
    return common.verdict("determinism", ok,
                          f"{equal_steps}/{steps} steps with bitwise-equal loss and grad norm; final params "
                          f"{len(pa) - len(differing)}/{len(pa)} arrays ({size:,} values) bitwise equal"
                          + (f"; differing: {differing[:5]}" if differing else ""))


if __name__ == "__main__":
    common.main("determinism", main)
