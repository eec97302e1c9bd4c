"""Proves and times maxtrain on one GPU (an H100 or H200) in one command, within a wall-time budget.

    python scripts/gpu_report.py --out DIR [--budget 420] [--parts kernels,model,...]   # on a GPU
    python scripts/gpu_report.py --out DIR --dry-run      # the same code path on a CPU: tiny shapes, interpret mode
    python scripts/gpu_report.py --print-device-call      # the `device` tool call a session with a lent GPU makes

Parts, in order, each within its share of the budget (compiles included; docs/gpu.md):

    environment  device, memory, driver, CUDA, cuDNN, JAX and dependency versions; the dense bf16 peak used
                 for MFU (the chip records, config/chips.py) and what a large bf16 matmul reaches
    kernels      every attention autoselected can choose, against the float32 jnp reference, output and
                 gradients (bf16 and float32, GQA 4:1, packed segment ids, causal and not, length 1000 (not a
                 multiple of the 128 block), head_dim 64, 128 and 256): flash always; in bf16 cuDNN, tokamax
                 (the [gpu] extra, where installed) and bf16 dot_product (the yardstick) beside it
    model        loss and gradients of a 2-layer model with attention=dot_product|flash|cudnn|tokamax|autoselected
                 against dot_product in float32 at full matmul precision
    speed        forward+backward TFLOP/s of every candidate (flash, cudnn, tokamax; dot_product at 2k tokens):
                 causal, GQA 4:1 (32/8 heads), bf16, head_dim 64, 128 and 256 at 2k, 8k and 16k tokens (16k
                 tokens per batch): the rows of config/attention_speeds.MEASURED
    training     llama3.2-1b at sequence 4096, bf16, synthetic data: the user's command as typed (USER_COMMAND,
                 no tuning keys), the best bf16 configuration measured (BEST_BF16), it with quantization=fp8
                 (tokens/s over the best bf16), the former default (flash, remat full); step time, tokens/s,
                 TFLOP/s, MFU, compiled and peak memory; the default model's step
    frontier     (only when named in --parts) the same figures for a DeepSeek-V3-shaped and a gpt-oss-shaped
                 model that fit one GPU, and llama3.2-1b with float8 matmuls and with Muon

A part runs until the end of its share (time a part leaves passes to the next); an item whose estimated
cost exceeds what its part has left is skipped and listed. DIR/report.json and DIR/report.md are
rewritten after every item, so a run cut short leaves what it measured; a watchdog writes them and stops
the process 45 s after the budget (a hung compile). Exit status: 0 when every check that ran passed,
1 when one failed or a check or training run raised, 3 when the watchdog stopped the run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # before JAX starts: the 1B model's larger batches
# pylint: disable=wrong-import-position

import argparse
import time

import jax

from maxtrain import storage
from maxtrain.errors import UserError, run_cli
from maxtrain.gpu_check import parts
from maxtrain.gpu_check.plan import BUDGET_SECONDS, DEFAULT_PARTS, PARTS, device_call_text

START = time.monotonic()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpu_report", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", help="folder for report.json and report.md (on the device machine: $OUT)")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                        help=f"wall seconds for all parts, compiles included (default {BUDGET_SECONDS})")
    parser.add_argument("--dry-run", action="store_true", help="run on this CPU with tiny shapes (interpret mode)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated, in order, of {', '.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--print-device-call", action="store_true", help="print the `device` tool call and exit")
    args = parser.parse_args(argv)
    given, args.parts = args.parts, [p for p in args.parts.split(",") if p]
    if not args.parts:
        parser.error(f"--parts {given!r} names no part; choose from {', '.join(PARTS)}")
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if not args.print_device_call and not args.out:
        parser.error("--out DIR is required (on the device machine: --out $OUT)")
    if not args.budget > 0 or args.budget == float("inf"):  # nan compares false
        parser.error(f"--budget {args.budget} must be a finite number of seconds > 0")
    if args.out:  # the report is written as the parts finish: refused before the first
        storage.check_output(args.out, False, f"--out {args.out}")
    return args


def main(argv):
    args = parse_args(argv)
    if args.print_device_call:
        print(device_call_text())
        return 0
    backend = jax.default_backend()
    if not args.dry_run and backend != "gpu":
        raise UserError(f"no GPU here (JAX's backend is {backend}): run this on a lent GPU (docs/gpu.md, "
                        "--print-device-call), or add --dry-run to check the command on this CPU")
    return parts.run(args.out, args.budget, args.dry_run, args.parts, "python scripts/gpu_report.py " + " ".join(argv),
                     START)


if __name__ == "__main__":
    raise SystemExit(run_cli("gpu_report", main))
