"""The docs/scale.md table: the train step of real models compiled for TPU pods and H100 clusters on this CPU.

    python scripts/scale_table.py                  # compile every row not yet in the results file, then write the table
    python scripts/scale_table.py --rows 8b-v5p128 --attention dot_product
    python scripts/scale_table.py --table-only     # rewrite docs/scale.md from the results file
    python scripts/scale_table.py --maxtext-python /path/to/py312-venv/bin/python   # also MaxText 0.2.5's train_compile
    python scripts/scale_table.py --maxtext-python PY --only-maxtext             # MaxText's cells only
    python scripts/scale_table.py --same-compiler-python PY                      # maxtrain's TPU cells with MaxText's jax/libtpu
    python scripts/scale_table.py --maxtext-python PY --only-maxtext --maxtext-pinned-libtpu  # MaxText with our libtpu
    python scripts/scale_table.py --py312-python PY --only-py312                 # maxtrain with the Python 3.12 extras

Each cell is one `maxtrain.train_compile` run, in a subprocess of its own (a failed or killed compile
loses only that cell), appended as one JSON line to the results file (default
docs/scale_results.jsonl) with the command that made it. A cell already there is not compiled
again, so the script resumes where it stopped; --redo recompiles the selected cells. Compiles of 8B
and 70B models for 64-512 chips take minutes and GBs of RAM each: they run one at a time.

MaxText's cells run its own `train_compile` (MaxText 0.2.5 needs Python 3.12 and `pip install
'maxtext[tpu]==0.2.5'`) with the same model, topology, per-device batch, sequence length and remat
policy, and record the total memory it prints. MaxText 0.2.5 runs on a newer jax and libtpu than
maxtrain pins, and the two libtpu versions account memory differently; `--same-compiler-python`
also compiles maxtrain's TPU cells with a Python that has MaxText's jax and libtpu (MaxText's venv,
with maxtrain added by `pip install --no-deps -e .`), which gives the like-for-like ratio;
`--maxtext-pinned-libtpu` the other way round, MaxText compiled by maxtrain's pinned libtpu (its jax
0.12 loads the older libtpu; its Pallas kernels' Mosaic calls do not, so only dot_product cells).
`--py312-python` compiles maxtrain's cells, TPU and GPU rows, with a Python 3.12 virtualenv that has
`pip install -e '.[tpu,cuda]'`: what a user gets there (jax 0.12, libtpu 0.0.52, the CUDA plugin of jax 0.12).

Needs the [tpu] and [cuda] extras (libtpu; JAX's CUDA plugin and ptxas).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from maxtrain import errors, storage  # noqa: E402
from maxtrain.compile.scale_table import ATTENTIONS, RESULTS, ROWS, argv_of, compiler_versions, run  # noqa: E402


def compile_cell(argv: list[str]) -> dict:
    """Runs in the child process: one train_compile, its report as a dict (or the error)."""
    import jax  # pylint: disable=import-outside-toplevel  # deferred: the parent process never starts JAX

    jax.config.update("jax_platforms", "cpu")
    # pylint: disable=import-outside-toplevel  # deferred: after JAX is told to stay on this CPU
    from maxtrain.compile import libtpu, report, targets
    from maxtrain.training import ahead_of_time, builder

    try:
        config = builder.load_config(argv)
        target = targets.parse(config.compile_topology, config.compile_topology_num_slices)
        built, _, compiled, seconds = ahead_of_time.compile_for_target(config, target)
    except (ValueError, RuntimeError) as error:  # a kernel missing for the target, a compiler error
        refused = libtpu.out_of_memory(error)
        if refused:  # libtpu refuses a program whose temporaries exceed the chip
            return {"refused": {"temporaries_gib": refused[0], "available_gib": refused[1]}, "fits": False}
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    rep = report.report(built, compiled, target, seconds)
    rep["fits"] = report.fits(rep)
    rep["versions"] = compiler_versions()
    return rep


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="scale_table", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--attention", nargs="*", default=list(ATTENTIONS), choices=list(ATTENTIONS))
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--redo", action="store_true", help="compile the selected cells again")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--maxtext-python", help="a Python with maxtext 0.2.5 installed: also run its train_compile")
    parser.add_argument("--only-maxtext", action="store_true", help="with --maxtext-python: run MaxText's cells only")
    parser.add_argument("--same-compiler-python",
                        help="a Python with MaxText's jax and libtpu and maxtrain installed: also compile maxtrain's "
                             "TPU cells with it")
    parser.add_argument("--only-same-compiler", action="store_true",
                        help="with --same-compiler-python: run those cells only")
    parser.add_argument("--maxtext-pinned-libtpu", action="store_true",
                        help="with --maxtext-python: also compile MaxText's cells with this Python's (maxtrain's "
                             "pinned) libtpu")
    parser.add_argument("--py312-python",
                        help="a Python 3.12 virtualenv with `pip install -e '.[tpu,cuda]'`: also compile maxtrain's "
                             "cells with it (the table's last column)")
    parser.add_argument("--only-py312", action="store_true", help="with --py312-python: run those cells only")
    parser.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)  # child process: ROW ATTENTION
    args = parser.parse_args(argv)
    for flag, python in (("--maxtext-python", args.maxtext_python), ("--same-compiler-python", args.same_compiler_python)):
        if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise errors.PathError(f"{flag} {python} is not an executable file; give a Python interpreter, e.g. "
                                   "/path/to/venv/bin/python")
    if args.cell:  # the child process of one cell
        print("RESULT " + json.dumps(compile_cell(argv_of(*args.cell))), flush=True)
        return
    storage.check_output(args.results, True, f"--results {args.results}")
    with errors.user_paths():
        run(args)




if __name__ == "__main__":
    errors.run_cli("scale_table", main)
