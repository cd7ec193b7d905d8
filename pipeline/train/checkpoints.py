"""Crash-safe training checkpoints: one directory per checkpoint, published by an atomic rename.

    <run_dir>/checkpoints/
        ckpt-000000120/          after 120 training batches (the global step)
            ckpt.index           tf.train.Checkpoint: model weights, optimizer (slots, iterations,
            ckpt.data-*          loss-scale state, gradient accumulators), the layers' RNG states and
                                 the compiled metrics' running sums (for the epoch in progress)
            state.json           epoch and batch reached, skipped-step counts, history so far, config

tf.train.CheckpointManager writes the data files, then the index, then its `checkpoint` pointer, none
of them atomically, so a SIGKILL can leave a pointer to a half-written checkpoint or a checkpoint
without the bookkeeping that goes with it. Here a checkpoint is written into a hidden temporary
sibling and published by artifacts.publish_dir (fsync, rename, fsync of the directory): a `ckpt-N`
directory is always complete, and the newest one is the one to resume from. A second checkpoint of
the same step (an epoch end right after a step checkpoint, a resumed run that stops at once) replaces
the first only once it is complete, so a kill at any moment leaves one of the two. What a killed
process left behind is cleaned up (or put back) when the next Checkpointer opens the directory.

Saving is two halves so that training need not wait for the disk: write() copies the values as they
are now into the temporary sibling (TensorFlow, the caller's thread), publish() fsyncs and renames it
(no TensorFlow; the run recorder runs it on a background thread). save() does both.

The data order is a function of (seed, epoch) (see loops.py), so (epoch, batch) is the data iterator's
position; with the RNG states this makes a resumed run repeat the uninterrupted one's steps, and with
the metrics' running sums it reports the interrupted epoch's metrics as if nothing had happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from pipeline import artifacts
from pipeline.artifacts import CHECKPOINTS_DIR
from pipeline.train.discard import discard

STATE_FILE = "state.json"
_PREFIX = "ckpt"
_NAME = re.compile(r"^ckpt-(\d+)$")


@dataclasses.dataclass
class TrainingState:
    """Where training stands; saved beside the weights so that both always agree."""

    epoch: int = 0  # finished epochs
    step_in_epoch: int = 0  # batches trained in the current epoch
    global_step: int = 0  # batches trained in all
    skipped_steps: int = 0  # updates skipped by dynamic loss scaling, in all
    epoch_skipped_steps: int = 0  # ... in the current epoch
    train_seconds: float = 0.0  # training time so far, summed over resumed processes
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # one entry per finished epoch
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the resolved config that trained it
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)  # PolicyInfo.to_dict(): what `auto` chose

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainingState":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


@dataclasses.dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint written into a hidden temporary directory, not yet published as `final`."""

    tmp: Path
    final: Path


class Checkpointer:
    """Saves and restores one model's training checkpoints under <run_dir>/checkpoints/."""

    def __init__(self, run_dir: Path, model: keras.Model, keep: int):
        """Build the optimizer and the compiled metrics first: the checkpoint holds the variables that
        exist now, and restoring into unbuilt objects is deferred and checked against nothing."""
        self.directory = Path(run_dir) / CHECKPOINTS_DIR
        self.keep = keep
        self.model = model
        if self.directory.is_dir():  # before anyone looks for the newest checkpoint
            artifacts.remove_stale_temporaries(self.directory)
        self._metric_variables = [v for metric in model.metrics for v in metric.variables]
        self._metric_values: list | None = None
        # Dropout-like layers keep their RNG state in seed generators that tf.train.Checkpoint does not
        # reach through the model (docs/keras3-mixed-precision.md §4); list them so a resumed run draws the same masks.
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, rng=_seed_states(model),
                                               metrics=self._metric_variables)
        # An eager write walks the object graph in Python on every save (~18 ms for make bench's MLP on 2
        # cores); traced once, a save takes ~5 ms. The variables it captures are fixed once the optimizer and
        # metrics are built (see above). Only under the default strategy: the distributed ones keep the
        # eager path they were tested with.
        default = not tf.distribute.has_strategy() and model.distribute_strategy is tf.distribute.get_strategy()
        self._traced_write = tf.function(self._checkpoint.write) if default else None

    def save(self, state: TrainingState) -> Path:
        """Writes a checkpoint of the model, optimizer and state and publishes it; keeps only the newest `keep`."""
        return self.publish(self.write(state))

    def write(self, state: TrainingState) -> StagedCheckpoint:
        """Writes the model, optimizer and state as they are now into a hidden temporary directory.

        Nothing is visible as a checkpoint until publish(); a process killed before that leaves only a
        temporary, which the next save removes.
        """
        final = self.directory / f"ckpt-{state.global_step:09d}"
        tmp = artifacts.staging_dir(final)
        try:
            if self._traced_write is not None:
                self._traced_write(tf.constant(str(tmp / _PREFIX)))
            else:
                self._checkpoint.write(str(tmp / _PREFIX))
            # Not write_json_atomic: the directory is what becomes visible atomically, and publish() fsyncs it.
            (tmp / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=2, sort_keys=True) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return StagedCheckpoint(tmp, final)

    def publish(self, staged: StagedCheckpoint) -> Path:
        """Makes a written checkpoint durable and visible (fsync, atomic rename), then drops all but the
        newest `keep`. Uses no TensorFlow, so it may run on another thread while training goes on."""
        try:
            # replace: the same step again (e.g. an epoch end right after a step checkpoint) keeps the old
            # checkpoint until the new one has its name.
            artifacts.publish_dir(staged.tmp, staged.final, replace=True)
        finally:
            if staged.tmp.exists():
                shutil.rmtree(staged.tmp, ignore_errors=True)
        discard(list_checkpoints(self.directory.parent)[:-self.keep], inside=self.directory)
        return staged.final

    def restore(self, path: Path) -> TrainingState:
        """Restores model, optimizer, RNG and metric states from one checkpoint directory; returns its state."""
        self._checkpoint.read(str(path / _PREFIX)).assert_existing_objects_matched()
        # Both loops reset the metrics when an epoch begins; restore_metrics() puts these back afterwards.
        self._metric_values = [v.numpy() for v in self._metric_variables]
        return TrainingState.from_dict(artifacts.read_json(path / STATE_FILE))

    def restore_metrics(self) -> None:
        """Puts back the restored running metric sums, once, at the start of the interrupted epoch."""
        for variable, value in zip(self._metric_variables, self._metric_values or ()):
            variable.assign(value)
        self._metric_values = None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoint directories of a run, oldest first."""
    directory = Path(run_dir) / CHECKPOINTS_DIR
    found = []
    for child in directory.iterdir() if directory.is_dir() else ():
        match = _NAME.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def read_state(checkpoint: Path) -> TrainingState:
    return TrainingState.from_dict(artifacts.read_json(Path(checkpoint) / STATE_FILE))


def recorded_policy(run_dir: Path) -> dict | None:
    """The policy the run's newest checkpoint trained under, so that a resumed `auto` run keeps what it chose
    rather than measuring again (precision.apply_policy's recorded); None without a checkpoint that records one."""
    latest = latest_checkpoint(run_dir)
    return (read_state(latest).policy or None) if latest is not None else None


def load_weights_into(model: keras.Model, source: str | os.PathLike) -> Path:
    """Loads a checkpoint's weights into a model of the same architecture, whatever its dtype policy.

    Mixed-precision policies keep float32 variables, so a checkpoint trained under mixed_float16 loads
    into a float32 model and the reverse (e.g. to compare precisions, or to fine-tune). Only the
    model's weights are read: optimizer state and step counters stay as they are.

    Args:
        model: a built keras.Model with the trained model's layers.
        source: a run directory (its newest checkpoint is used) or one checkpoint directory.

    Returns:
        The checkpoint directory that was loaded.

    Raises:
        FileNotFoundError: no checkpoint at source.
        AssertionError: a model variable has no value in the checkpoint (a different architecture).
    """
    source = Path(source)
    checkpoint = source if (source / STATE_FILE).is_file() else latest_checkpoint(source)
    if checkpoint is None:
        raise FileNotFoundError(f"{source}: no checkpoint (expected {source}/{CHECKPOINTS_DIR}/ckpt-N/ "
                                "or a ckpt-N directory)")
    status = tf.train.Checkpoint(model=model).read(str(checkpoint / _PREFIX))
    status.expect_partial()  # the optimizer's and RNG values are not wanted here
    status.assert_existing_objects_matched()
    return checkpoint


def _seed_states(model: keras.Model) -> list:
    return [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]
