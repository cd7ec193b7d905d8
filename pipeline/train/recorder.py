"""Records a training run as it goes, for both loops: the one callback that writes the run directory.

Per step: counts skipped updates (the dynamic loss scale halves on non-finite gradients), buffers the
loss scale and the skipped-step count for TensorBoard, hands the step to the TrainingGuard (guard.py),
which stops training on a run of non-finite steps, a collapsed loss scale or non-finite weights, and
checkpoints every train.checkpoint_every_steps steps.
Per epoch: appends the metrics, loss scale, skipped steps and timing (`seconds` spent on the epoch's
training steps in this process, validation excluded, and `examples_per_second`) to the history
(history.py: history.json/.png) and to TensorBoard (scalars.py), and checkpoints.

It has to be cheap: on a small model a step takes a few milliseconds, and one TensorFlow call from
Python costs ~0.25 ms on 2 CPU cores. So per step it does Python bookkeeping only, plus one read of
the loss scale under dynamic scaling; the guard checks the weights every guard.WEIGHTS_CHECK_EVERY
steps (and whenever a checkpoint is due or the loss went non-finite); TensorBoard scalars are buffered
and written in one graph call per epoch; history.png is redrawn at most every PLOT_EVERY_SECONDS; and
on a background thread checkpoint files are fsynced and published, history.json is rewritten and the
scalars are written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from pathlib import Path

import keras
import tensorflow as tf

from pipeline import precision
from pipeline.artifacts import HISTORY_PLOT, LOGS_DIR
from pipeline.config import TrainConfig
from pipeline.train import checkpoints, scalars
from pipeline.train.guard import TrainingGuard
from pipeline.train.input_wait import INPUT_BOUND_SHARE, InputClock
from pipeline.train.length import RunLength
from pipeline.train.history import plot_history, write_history_json

log = logging.getLogger(__name__)

# Drawing history.png takes ~0.3 s: per epoch that doubled short epochs. Redrawn when this much time has
# passed since the last drawing, and when training ends (history.json is still rewritten every epoch).
PLOT_EVERY_SECONDS = 60.0
# Buffered TensorBoard scalars are also written whenever this many are waiting (a long epoch).
SCALARS_FLUSH_AT = 2000


class RunRecorder(keras.callbacks.Callback):
    """Writes history, TensorBoard scalars and checkpoints, and has its TrainingGuard stop non-finite training.

    Skipped steps are seen from outside the train step, the same way in both loops: under dynamic loss
    scaling the scale only ever goes down when LossScaleOptimizer skipped an update
    (docs/keras3-mixed-precision.md §2). (Its `iterations` cannot tell: with gradient accumulation it
    advances once per update, not per batch.)
    """

    def __init__(self, run_dir: Path, checkpointer: checkpoints.Checkpointer, state: checkpoints.TrainingState,
                 train: TrainConfig, policy: precision.PolicyInfo, length: RunLength,
                 examples_per_pass: int | None = None, clock: InputClock | None = None, input_advice: str = ""):
        super().__init__()
        self.clock, self.input_advice = clock, input_advice
        self.run_dir = run_dir
        self.checkpointer = checkpointer
        self.state = state
        self.checkpoint_every = train.checkpoint_every_steps
        self.length = length
        # a batch's examples on average: the last batch of a pass may be short
        self.examples_per_step = (examples_per_pass or length.pass_steps * train.batch_size) / length.pass_steps
        self.guard = TrainingGuard(state, train, policy, length.steps_per_epoch, self._published_checkpoint)
        self._epoch_start: tuple[float, int] = (time.perf_counter(), 0)  # (clock, step_in_epoch) at epoch begin
        self._epoch_seconds: float | None = None  # the epoch's training steps, set at its last batch
        self.last_checkpoint = checkpoints.latest_checkpoint(run_dir)
        self._resuming_mid_epoch = state.step_in_epoch > 0
        self._scale: float | None = None
        self._direct_scale_read = False  # see _loss_scale
        self._scalars: dict[str, scalars.ScalarLog] = {}
        self._weights_finite = None  # a tf.function over the model's weights, made once the model is set
        self._background: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._plotted = (time.perf_counter(), len(state.history))  # (when, epochs) of the last history.png
        self._clock = time.perf_counter()

    def on_train_begin(self, logs=None):
        if not self._scalars:
            self._scalars = scalars.open_logs(self.run_dir / LOGS_DIR)
        self._scale = precision.current_loss_scale(self.model.optimizer)
        self._direct_scale_read = (isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)
                                   and not tf.distribute.has_strategy()
                                   and self.model.distribute_strategy is tf.distribute.get_strategy())
        self._clock = time.perf_counter()
        if self._weights_finite is None:
            variables = self.model.trainable_variables
            self._weights_finite = tf.function(
                lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables]))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start, self._epoch_seconds = (time.perf_counter(), self.state.step_in_epoch), None
        if self._resuming_mid_epoch:  # the loop has just reset the metrics; continue the checkpoint's sums
            self.checkpointer.restore_metrics()
            self._resuming_mid_epoch = False

    def on_train_batch_begin(self, batch, logs=None):
        if self.clock is not None:
            self.clock.step_began()

    def on_train_batch_end(self, batch, logs=None):
        if self.clock is not None:
            self.clock.step_ended()
        state = self.state
        state.global_step += 1
        state.step_in_epoch += 1
        epoch_done = state.step_in_epoch == self.length.steps_in_epoch(state.epoch)
        if epoch_done:  # before validation, which is not training time
            self._epoch_seconds = time.perf_counter() - self._epoch_start[0]
        scale = self._loss_scale()
        skipped = self.guard.dynamic and scale < self._scale
        self._scale = scale
        state.skipped_steps += skipped
        state.epoch_skipped_steps += skipped
        train_log = self._scalars["train"]
        if scale is not None:
            train_log.add("batch_loss_scale", state.global_step, scale)
        train_log.add("batch_skipped_steps", state.global_step, state.skipped_steps)
        if len(train_log) >= SCALARS_FLUSH_AT:
            self._write_scalars()
        checkpoint_due = (self.checkpoint_every and state.global_step % self.checkpoint_every == 0
                          and not epoch_done)  # the epoch end saves the last batch
        # Raises TrainingError on a stop rule. Weights are checked before a checkpoint and an epoch end.
        self.guard.after_step(scale, skipped, float((logs or {}).get("loss", math.nan)), self._weights_finite,
                              check_weights=bool(checkpoint_due or epoch_done))
        if checkpoint_due:
            self._save()

    def on_epoch_end(self, epoch, logs=None):
        state = self.state
        entry = {"epoch": epoch + 1, **{name: float(value) for name, value in (logs or {}).items()}}
        scale = precision.current_loss_scale(self.model.optimizer)
        if scale is not None:
            entry["loss_scale"] = scale
        entry["skipped_steps"] = state.epoch_skipped_steps
        entry.update(self._epoch_timing())
        self._say_if_input_bound(entry)
        state.history.append(entry)
        state.epoch, state.step_in_epoch, state.epoch_skipped_steps = epoch + 1, 0, 0
        self._save()  # the guard checked the weights after the last batch
        scalars.add_epoch(self._scalars, entry)
        self._write_scalars()
        self._in_background(write_history_json, self.run_dir, list(state.history))
        if time.perf_counter() - self._plotted[0] >= PLOT_EVERY_SECONDS:
            self._plot_history()

    def _loss_scale(self) -> float | None:
        """precision.current_loss_scale, without Keras' convert_to_numpy for the dynamic scale: reading the
        variable directly takes ~15 µs instead of ~120 µs, which is 2% of a small model's step. (Not for a
        distributed variable, which float() does not read.)"""
        optimizer = self.model.optimizer
        if self._direct_scale_read and optimizer.built:
            return float(optimizer.dynamic_scale.value)
        return precision.current_loss_scale(optimizer)

    def _epoch_timing(self) -> dict:
        """This process's share of the epoch: a resumed epoch counts only the batches trained after the resume."""
        clock, first_step = self._epoch_start
        seconds = self._epoch_seconds if self._epoch_seconds is not None else time.perf_counter() - clock
        examples = self.examples_per_step * (self.state.step_in_epoch - first_step)
        timing = {"seconds": round(seconds, 4),
                  "examples_per_second": round(examples / seconds, 1) if seconds > 0 else None}
        if self.clock is not None:
            timing["input_wait"] = round(min(1.0, self.clock.take() / seconds), 4) if seconds > 0 else None
        return timing

    def _say_if_input_bound(self, entry: dict) -> None:
        wait = entry.get("input_wait")
        if wait is not None and wait > INPUT_BOUND_SHARE:
            log.warning("epoch %d is input-bound: its steps waited for their batches %.0f%% of the time (%s "
                        "examples/s); %s (docs/data.md#input-bound)", entry["epoch"], 100 * wait,
                        f"{entry['examples_per_second']:,.0f}" if entry.get("examples_per_second") else "-",
                        self.input_advice)

    def on_train_end(self, logs=None):
        self._tick()
        self._write_scalars()
        for scalar_log in self._scalars.values():
            self._in_background(scalar_log.writer.flush)

    def close(self) -> None:
        """Finishes what is still buffered or in flight (scalars, history.png, checkpoint publishing);
        call it once training has ended or stopped."""
        try:
            self._wait_background()
        finally:
            if self._background is not None:
                self._background.shutdown()
                self._background = None
            for scalar_log in self._scalars.values():
                scalar_log.close()
            self._scalars = {}
        if self._plotted[1] != len(self.state.history):
            self._plot_history()

    def loss_scale_health(self) -> dict:
        """The guard's loss-scale summary for metrics.json, with the loss scale training ended on."""
        scale = precision.current_loss_scale(self.model.optimizer) if self.model is not None else None
        return self.guard.loss_scale_health(scale)

    def _published_checkpoint(self) -> Path | None:
        """The newest checkpoint, once its publishing has finished: the one a stopped run resumes from."""
        self._wait_background()
        return self.last_checkpoint

    def _save(self) -> None:
        if not self.guard.may_checkpoint():
            return
        self._tick()
        self._wait_background()  # at most one checkpoint in flight
        staged = self.checkpointer.write(self.state)
        self._in_background(self.checkpointer.publish, staged)
        self.last_checkpoint = staged.final

    def _tick(self) -> None:
        now = time.perf_counter()
        self.state.train_seconds += now - self._clock
        self._clock = now

    def _write_scalars(self) -> None:
        """Writes the buffered TensorBoard scalars on the background thread (a TensorFlow call, but one that
        touches only its summary writer; ~2 ms an epoch here, overlapping the next steps)."""
        for scalar_log in self._scalars.values():
            buffered = scalar_log.take()
            if buffered is not None:
                self._in_background(scalar_log.write, buffered)

    def _plot_history(self) -> None:
        if self.state.history:
            plot_history(self.state.history, self.run_dir / HISTORY_PLOT)
        self._plotted = (time.perf_counter(), len(self.state.history))

    def _in_background(self, function, *args) -> None:
        """Runs file writing and publishing on one background thread, in order; its errors surface here on a
        later call or in close()."""
        for future in [f for f in self._pending if f.done()]:
            self._pending.remove(future)
            future.result()
        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self._pending.append(self._background.submit(function, *args))

    def _wait_background(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
