"""How long a training run is: batches per epoch, epochs and steps, from train.epochs, train.steps_per_epoch and
train.max_steps (a large corpus is not counted in passes: docs/large-models.md).

The training batches are one stream of passes over the training rows, pass p shuffled by (seed, p); epoch e takes
its batches [e × steps_per_epoch, ...) of that stream. By default an epoch is one pass, so epoch e is pass e.
"""

from __future__ import annotations

import dataclasses
import math

from pipeline.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class RunLength:
    pass_steps: int  # batches in one pass over the training rows
    steps_per_epoch: int
    total_steps: int

    @property
    def epochs(self) -> int:
        return math.ceil(self.total_steps / self.steps_per_epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        """The epoch's batches: steps_per_epoch, fewer in a last epoch that train.max_steps cuts short."""
        return max(0, min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch))

    def position(self, epoch: int, step_in_epoch: int) -> tuple[int, int]:
        """(pass, batches into that pass) of the epoch's step_in_epoch-th batch in the stream."""
        return divmod(epoch * self.steps_per_epoch + step_in_epoch, self.pass_steps)

    @property
    def passes(self) -> float:
        """Passes over the training rows the run reads (1.5: one and a half)."""
        return self.total_steps / self.pass_steps


def run_length(train: TrainConfig, train_examples: int) -> RunLength:
    """The run's length for train_examples training rows in batches of train.batch_size."""
    pass_steps = math.ceil(train_examples / train.batch_size)
    steps_per_epoch = train.steps_per_epoch or pass_steps
    total = train.max_steps or train.epochs * steps_per_epoch
    return RunLength(pass_steps, steps_per_epoch, total)


def describe(length: RunLength, batch_size: int) -> str:
    """'925 steps (5 epochs of 185, batch 32; 5 passes over the training rows)'."""
    epochs = length.epochs
    last = length.steps_in_epoch(epochs - 1)
    shape = f"{epochs} epoch{'' if epochs == 1 else 's'} of {length.steps_per_epoch}"
    if last != length.steps_per_epoch:
        shape += f", the last of {last}"
    passes = length.passes
    return (f"{length.total_steps:,} steps ({shape}, batch {batch_size}; "
            f"{passes:.3g} pass{'' if passes == 1 else 'es'} over the training rows)")
