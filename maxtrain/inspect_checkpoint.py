"""Look inside a checkpoint without loading it:

    python -m maxtrain.inspect_checkpoint PATH

PATH is a step directory (<run>/checkpoints/<step>), a checkpoints directory or a run directory (its
latest usable step). Prints the step, whether its files match their checksums, the latest usable step
of its run and any damaged ones, every array of the state (path, dtype, shape), the parameter count,
the data iterators' positions and the metadata (model settings, run, git commit, package versions).
docs/checkpoints.md describes the layout.
"""

from __future__ import annotations

import sys

from maxtrain.checkpointing import inspect
from maxtrain.checkpointing.files import CheckpointError
from maxtrain.errors import run_cli

USAGE = "usage: python -m maxtrain.inspect_checkpoint PATH   (a step, checkpoints or run directory)"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise CheckpointError(USAGE)
    print(inspect.describe(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("maxtrain.inspect_checkpoint", main, usage=__doc__))
