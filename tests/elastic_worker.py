"""`python -m maxtrain.train` with a tap on the input: every host batch the run reads is saved.

    python tests/elastic_worker.py TAP_PREFIX configs/base.yml key=value ...

Runs maxtrain.train.main unchanged (jax.distributed, the mesh, Orbax checkpoints, the Grain iterator
saved and restored with them, the elastic merge), except that make_inputs' train iterator is wrapped
in `Tap`, a grain DatasetIterator that passes get_state/set_state through to the real iterator and
records each batch it hands out. At exit the batches go to TAP_PREFIX-p<process>.npz (one array per
field, stacked over the batches). tests/checkpointing/test_elastic_resume.py counts the documents in them.
"""

from __future__ import annotations

import sys

import grain
import jax
import numpy as np


class Tap(grain.DatasetIterator):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.batches = inner, []

    def __next__(self):
        batch = next(self.inner)
        self.batches.append({k: np.asarray(v) for k, v in batch.items()})
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def main(prefix: str, argv: list[str]) -> None:
    from maxtrain import data as data_lib  # pylint: disable=import-outside-toplevel
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    taps = []
    make_inputs = data_lib.make_inputs

    def tapped(*args, **kwargs):
        inputs = make_inputs(*args, **kwargs)
        taps.append(Tap(inputs.train_iterator))
        inputs.train_iterator = taps[-1]
        return inputs

    data_lib.make_inputs = tapped  # the module train.py calls it from
    train.main(argv)
    batches = taps[0].batches if taps else []
    fields = {k: np.stack([b[k] for b in batches]) for k in (batches[0] if batches else {})}
    np.savez(f"{prefix}-p{jax.process_index()}.npz", **fields)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
