"""float32 matmul rates on this machine, XLA against numpy's BLAS, for the shapes of a train step.

    python scripts/matmul_rates.py                       # the CPU reference configuration's shapes
    python scripts/matmul_rates.py --shapes 1024x256x32000 4096x4096x4096 --repeats 30

Each shape is M x K x N ([M, K] . [K, N]); the rate is 2 M K N over the median wall time of
`--repeats` calls (after one warm-up), for `jax.jit(lambda a, b: a @ b)` and for numpy.matmul (the
BLAS numpy was built with: OpenBLAS in the PyPI wheels). It shows which of a step's matmuls XLA:CPU
runs below what the machine's BLAS does (docs/performance.md, issue 13 item 5). Wall times: run it
on an otherwise idle machine, and read the load average it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np

from maxtrain.errors import run_cli

# The reference configuration's (D 256, F 1024, V 32000, 1,024 tokens) matmuls, then a large one.
REFERENCE_SHAPES = ["1024x256x32000", "1024x32000x256", "256x1024x32000", "1024x256x1024", "1024x1024x256",
                    "256x1024x1024", "1024x256x256", "2048x2048x2048"]


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def parse_shape(text: str, parser) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        parser.error(f"--shapes: {text!r} must be MxKxN with three positive numbers, e.g. 1024x256x32000")
    return tuple(int(p) for p in parts)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="matmul_rates", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=REFERENCE_SHAPES, help="MxKxN ...")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    shapes = [(shape, parse_shape(shape, parser)) for shape in args.shapes]
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    rng = np.random.default_rng(0)
    matmul = jax.jit(lambda a, b: a @ b)
    print(f"{'M x K x N':>18}  {'XLA GFLOP/s':>11}  {'numpy GFLOP/s':>13}  XLA / numpy")
    for shape, (m, k, n) in shapes:
        a, b = rng.random((m, k), np.float32), rng.random((k, n), np.float32)
        ja, jb = jax.device_put(a), jax.device_put(b)
        xla = median_seconds(lambda: matmul(ja, jb).block_until_ready(), args.repeats)  # pylint: disable=cell-var-from-loop
        blas = median_seconds(lambda: np.matmul(a, b), args.repeats)  # pylint: disable=cell-var-from-loop
        flop = 2 * m * k * n
        print(f"{shape:>18}  {flop / xla / 1e9:11.1f}  {flop / blas / 1e9:13.1f}  {blas / xla:.2f}")
    print(f"jax {jax.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    run_cli("matmul_rates", main)
