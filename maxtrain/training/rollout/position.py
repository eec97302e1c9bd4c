"""The train iterator's position when prompt batches go out before the updates that train on them (rollout workers,
grpo_off_policy_steps = k): a checkpoint saves the position of the first prompt batch its state has not trained on,
so a resumed run re-issues exactly the batches that were out (none lost, none trained twice).

    prompts = Position(train_iterator)     # what the checkpoint saves and restores (train.py: inputs.train_iterator)
    batch = prompts.read(step)             # the next prompt batch, for the update of `step`
    prompts.trained(done)                  # the state holds the updates of steps < done

The saved state is the Grain iterator's own (the parent's) as of the oldest read whose step is not trained yet, or
its current one when every read is trained (k = 0: always; the state then is today's, byte for byte). A read after
that oldest one which is trained (dynamic sampling's further prompt batches of an earlier step, drawn after later
steps' batches went out) is listed by its offset: {"parent": state, "trained_reads": [offsets]}, passed over when the
resumed run reads again.
"""

from __future__ import annotations

import copy

import grain

TRAINED = -1  # the step of a read that a restored state said was trained


class Position(grain.DatasetIterator):
    def __init__(self, parent):
        super().__init__(parent)
        self.step = 0         # the step a plain next() reads for (Rollouts.begin sets it: the step under way)
        self.done = 0         # updates of steps < done are in the state
        self.reads = []       # (the parent's state before the read, its step), oldest first, from the oldest untrained
        self.skips, self.offset = set(), 0  # a restored state's trained reads, by offset; reads since the restore

    def __next__(self):
        return self.read(self.step)

    def read(self, step: int):
        while self.offset in self.skips:  # trained before the checkpoint: read past it (kept in order for get_state)
            self.reads.append((copy.deepcopy(self._parent.get_state()), TRAINED))
            next(self._parent)
            self.offset += 1
        self.reads.append((copy.deepcopy(self._parent.get_state()), step))
        batch = next(self._parent)
        self.offset += 1
        return batch

    def trained(self, done: int) -> None:
        self.done = max(self.done, done)
        while self.reads and self.reads[0][1] < self.done:  # TRAINED < any done
            self.reads.pop(0)

    def get_state(self) -> dict:
        self.trained(self.done)
        pending = sorted(o - self.offset for o in self.skips if o >= self.offset)  # skips not reached yet
        if not self.reads:
            state, trained = self._parent.get_state(), pending
        else:
            state = self.reads[0][0]
            trained = [i for i, (_, s) in enumerate(self.reads) if s < self.done]
            trained += [len(self.reads) + o for o in pending]
        return {"parent": state, "trained_reads": trained} if trained else state

    def set_state(self, state: dict) -> None:
        nested = "trained_reads" in state
        self._parent.set_state(state["parent"] if nested else state)
        self.skips, self.offset = set(state["trained_reads"] if nested else ()), 0
        self.reads = []
