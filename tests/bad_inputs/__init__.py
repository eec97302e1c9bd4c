"""The bad-input table: what a user can get wrong, per entry point, and what maxtrain must answer.

Each row names one bad input: the tool, its arguments (with {placeholders} for the files of a small
"world" built once: a trained run with checkpoints at steps 2 and 4, raw data, a tokenizer, a
prepared directory), an optional setup that breaks something in the row's own scratch directory,
the exit status expected and a regular expression the answer must match, naming the offending key,
file or value. For every row the runner also checks that nothing was printed as a traceback and
that no file of the world (the existing run, the data) changed.

    tests/test_bad_inputs/          runs every row in-process through the entry points' own CLI
                                      wrapper (errors.run_cli), plus one real subprocess per tool
    python tests/bad_inputs [--python PY] [--repo DIR] [--json OUT]
                                      runs every row as a real command (any checkout, e.g. an older
                                      main for a before/after count) and prints one line per row and
                                      the counts: clear / unclear / silent / traceback

The rows live one module per tool (rows_<tool>.py); the world and the setups in world.py. To add a
row, append a Row to its tool's ROWS: a new id, the tool, argv, and what the answer must say.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable

from bad_inputs.world import (REPO, TINY, TOOLS, Row, World, build_world,  # noqa: F401 (the table's API)
                              tree_hash)
from bad_inputs import rows_train
from bad_inputs import rows_decode
from bad_inputs import rows_viz
from bad_inputs import rows_inspect_data
from bad_inputs import rows_prepare_data
from bad_inputs import rows_train_tokenizer
from bad_inputs import rows_convert_hf
from bad_inputs import rows_inspect

ROWS = rows_train.ROWS + rows_decode.ROWS + rows_viz.ROWS + rows_inspect_data.ROWS + rows_prepare_data.ROWS + rows_train_tokenizer.ROWS + rows_convert_hf.ROWS + rows_inspect.ROWS


# --------------------------------------------------------------------------------------------
# Running a row and judging the answer
# --------------------------------------------------------------------------------------------


def argv_for(row: Row, world: World, scratch: str) -> list[str]:
    args = [world.fmt(a, scratch) for a in row.args]
    if row.tiny:  # the tiny model's settings, unless the row sets the same key itself
        given = {a.partition("=")[0] for a in args[1:]}
        extra = [a for a in TINY + [f"dataset_cache_dir={world.paths['cache']}"] if a.partition("=")[0] not in given]
        args = args[:1] + extra + args[1:]
    return args


def judge(row: Row, code: int, out: str, err: str) -> tuple[str, str]:
    """("clear" | "unclear" | "silent" | "traceback", the line judged)."""
    prog = TOOLS[row.tool][0]
    text = out + err
    if "Traceback (most recent call last)" in text or "Check failure stack trace" in text:
        return "traceback", text.strip().splitlines()[-1] if text.strip() else ""
    if row.code == 0:
        found = re.search(row.expect, text)
        return ("clear" if code == 0 and found else "silent" if code == 0 else "unclear"), (
            found.group(0) if found else (text.strip().splitlines() or [""])[-1])
    if code == 0:
        return "silent", (text.strip().splitlines() or [""])[-1]
    lines = err.strip().splitlines()
    errors = [line for line in lines if ": error: " in line and (prog.split(".")[-1] in line.split(": error: ")[0]
                                                                or line.startswith("maxtrain"))]
    line = errors[-1] if errors else (lines[-1] if lines else "")
    ok = code == row.code and len(errors) == 1 and re.search(row.expect, line)
    return ("clear" if ok else "unclear"), line


def kind(row: Row, code: int, out: str, err: str) -> str:
    """The answer's shape, whatever its wording: traceback | silent | one-line error | other."""
    text = out + err
    if "Traceback (most recent call last)" in text or "Check failure stack trace" in text:
        return "traceback"
    if row.code != 0:
        if code == 0:
            return "silent"
        errors = [line for line in err.strip().splitlines() if ": error: " in line]
        return "one-line error" if code == 2 and len(errors) == 1 else "other"
    return "said so" if code == 0 and re.search(row.expect, text) else "silent" if code == 0 else "other"


def run_subprocess(row: Row, world: World, scratch: str, python: str, repo: str,
                   timeout: float = 150) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the row as a real command; a command still running after `timeout`
    seconds accepted the input and started work (it is stopped and counts as exit 0)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": repo}
    cmd = [python, *TOOLS[row.tool][1], *argv_for(row, world, scratch)]
    try:
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:  # still working: the bad input was accepted (e.g. it trains)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return 0, out + f"\n(still running after {timeout}s: stopped)", ""
    return done.returncode, done.stdout, done.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose maxtrain is judged")
    parser.add_argument("--repo", default=REPO, help="the checkout to run the tools from")
    parser.add_argument("--work", default="/tmp/bad_inputs", help="scratch directory (emptied first)")
    parser.add_argument("--only", default="", help="regex of row ids to run")
    parser.add_argument("--json", default="", help="write the verdicts to this file")
    parser.add_argument("--timeout", type=float, default=150, help="seconds after which a row counts as accepted")
    parser.add_argument("--skip", default="", help="regex of row ids not to run")
    parser.add_argument("--reuse-world", action="store_true", help="keep the world of an earlier run in --work")
    args = parser.parse_args(argv)
    world_dir = os.path.join(args.work, "world")
    if args.reuse_world and os.path.isdir(os.path.join(world_dir, "run")):
        world = World(world_dir)
        world.paths["base"] = os.path.join(args.repo, "configs", "base.yml")
        shutil.rmtree(os.path.join(args.work, "rows"), ignore_errors=True)
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        world = build_world(world_dir, args.python, args.repo)
    before = tree_hash(world.root)
    verdicts, counts, shapes = {}, {}, {}
    for row in ROWS:
        if (args.only and not re.search(args.only, row.id)) or (args.skip and re.search(args.skip, row.id)):
            continue
        scratch = os.path.join(args.work, "rows", row.id)
        os.makedirs(scratch)
        if row.setup:
            row.setup(world, scratch)
        code, out, err = run_subprocess(row, world, scratch, args.python, args.repo, args.timeout)
        verdict, line = judge(row, code, out, err)
        shape = kind(row, code, out, err)
        if tree_hash(world.root) != before:
            verdict = shape = "changed the world"
            before = tree_hash(world.root)
        counts[verdict] = counts.get(verdict, 0) + 1
        shapes[shape] = shapes.get(shape, 0) + 1
        verdicts[row.id] = {"tool": row.tool, "verdict": verdict, "kind": shape, "exit": code, "line": line}
        print(f"{verdict:<10} {shape:<15} exit {code:<3} {row.tool:<15} {row.id:<38} {line[:200]}", flush=True)
    print(f"{len(verdicts)} rows, as the table expects: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    print(f"{len(verdicts)} rows, by the answer's shape: " + ", ".join(f"{v} {n}" for v, n in sorted(shapes.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "shapes": shapes, "rows": verdicts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

