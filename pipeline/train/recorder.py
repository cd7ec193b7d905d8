"""Records a training run as it goes, for both loops: the one callback that writes the run directory.

Per step: watches the optimizer for skipped updates (the dynamic loss scale halves on non-finite
gradients), logs the loss scale and the skipped-step count to TensorBoard, stops training on a run of
non-finite steps, a collapsed loss scale or non-finite weights, and checkpoints every
train.checkpoint_every_steps steps.
Per epoch: appends the metrics, loss scale, skipped steps and timing (`seconds` spent on the epoch's
training steps in this process, validation excluded, and `examples_per_second`) to history.json/.png and
TensorBoard, and checkpoints.

It has to be cheap: on a small model a step takes a few milliseconds, and one TensorFlow call from
Python costs ~0.25 ms on 2 CPU cores. So per step it does Python bookkeeping only, plus one read of
the loss scale under dynamic scaling; the weights are checked every WEIGHTS_CHECK_EVERY steps (and
whenever a checkpoint is due or the loss went non-finite); TensorBoard scalars are buffered and
written in one graph call per epoch; history.png is redrawn at most every PLOT_EVERY_SECONDS; and
on a background thread checkpoint files are fsynced and published, history.json is rewritten and the
scalars are written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import re
import time
from pathlib import Path

import keras
import tensorflow as tf
from tensorboard.plugins.scalar import metadata as scalar_metadata

from pipeline import artifacts, precision
from pipeline.artifacts import HISTORY_FILE, HISTORY_PLOT, LOGS_DIR
from pipeline.config import TrainConfig
from pipeline.errors import TrainingError
from pipeline.train import checkpoints

log = logging.getLogger(__name__)

# The first steps normally skip while the dynamic scale settles down from its initial 32768.
HEALTH_WARMUP_STEPS = 50
# Far below the usual 2**10..2**20: gradients this small in float16 lose precision or underflow; < 1 is fatal.
LOW_LOSS_SCALE = 2.0 ** 5
DEFAULT_MAX_SKIPPED_SHARE = 0.05
# Per-epoch entries that are not compiled metrics. The timing keys differ between runs of the same config.
TIMING_KEYS = ("seconds", "examples_per_second")
NON_METRIC_KEYS = ("epoch", "loss_scale", "skipped_steps", *TIMING_KEYS)
# Non-finite weights with a finite loss (see _check) are caught within this many steps; a checkpoint,
# an epoch end and a non-finite loss always check first, so no checkpoint ever holds them.
WEIGHTS_CHECK_EVERY = 20
# Drawing history.png takes ~0.3 s: per epoch that doubled short epochs. Redrawn when this much time has
# passed since the last drawing, and when training ends (history.json is still rewritten every epoch).
PLOT_EVERY_SECONDS = 60.0
# Buffered TensorBoard scalars are also written whenever this many are waiting (a long epoch).
SCALARS_FLUSH_AT = 2000



class RunRecorder(keras.callbacks.Callback):
    """Writes history, TensorBoard scalars and checkpoints, and guards against non-finite training.

    Skipped steps are seen from outside the train step, the same way in both loops: under dynamic loss
    scaling the scale only ever goes down when LossScaleOptimizer skipped an update. (Its `iterations`
    cannot tell: with gradient accumulation it advances once per update, not per batch.)
    """

    def __init__(self, run_dir: Path, checkpointer: checkpoints.Checkpointer, state: checkpoints.TrainingState,
                 train: TrainConfig, policy: precision.PolicyInfo, steps_per_epoch: int,
                 examples_per_epoch: int | None = None):
        super().__init__()
        self.run_dir = run_dir
        self.checkpointer = checkpointer
        self.state = state
        self.checkpoint_every = train.checkpoint_every_steps
        self.max_nonfinite_steps = train.max_nonfinite_steps
        self.steps_per_epoch = steps_per_epoch
        self.examples_per_epoch = examples_per_epoch or steps_per_epoch * train.batch_size
        self._epoch_start: tuple[float, int] = (time.perf_counter(), 0)  # (clock, step_in_epoch) at epoch begin
        self._epoch_seconds: float | None = None  # the epoch's training steps, set at its last batch
        self.dynamic = policy.loss_scale == "dynamic"
        # Below 1 the loss is scaled down: float16 overflows even without scaling, and Keras would keep
        # halving towards 0, where every update becomes NaN (docs/keras3-mixed-precision.md §2).
        self.min_loss_scale = min(1.0, policy.initial_scale or 1.0)
        self.last_checkpoint = checkpoints.latest_checkpoint(run_dir)
        self.nonfinite_streak = 0
        self.last_finite: tuple[int, float] | None = None  # (step, running loss)
        self._resuming_mid_epoch = state.step_in_epoch > 0
        self._scale: float | None = None
        self._direct_scale_read = False  # see _loss_scale
        self._scalars: dict[str, ScalarLog] = {}
        self._weights_finite = None  # a tf.function over the model's weights, made once the model is set
        self._weights_checked_at = state.global_step  # the last step whose weights were found finite
        self._background: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._plotted = (time.perf_counter(), len(state.history))  # (when, epochs) of the last history.png
        self._clock = time.perf_counter()
        precision_cfg = state.config.get("precision", {})  # train() sets it before the recorder exists
        self.max_skipped_share = precision_cfg.get("max_skipped_share", DEFAULT_MAX_SKIPPED_SHARE)
        self.low_loss_scale = min(LOW_LOSS_SCALE, policy.initial_scale or LOW_LOSS_SCALE)
        self.min_scale: float | None = None
        self.health_warnings: list[str] = []
        self._warned: set[str] = set()
        self._steps_after_warmup = 0
        self._skipped_after_warmup = 0

    def on_train_begin(self, logs=None):
        if not self._scalars:
            self._scalars = {name: ScalarLog(self.run_dir / LOGS_DIR / name) for name in ("train", "validation")}
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

    def on_train_batch_end(self, batch, logs=None):
        state = self.state
        state.global_step += 1
        state.step_in_epoch += 1
        epoch_done = state.step_in_epoch == self.steps_per_epoch
        if epoch_done:  # before validation, which is not training time
            self._epoch_seconds = time.perf_counter() - self._epoch_start[0]
        scale = self._loss_scale()
        skipped = self.dynamic and scale < self._scale
        self._scale = scale
        state.skipped_steps += skipped
        state.epoch_skipped_steps += skipped
        self._watch_health(scale, skipped)
        loss = float((logs or {}).get("loss", math.nan))
        # A non-finite loss gives non-finite gradients, which dynamic scaling skips (and counts). Without it
        # the running loss is all there is to go by; _check also stops once an update poisoned the weights.
        nonfinite = skipped if self.dynamic else not math.isfinite(loss)
        self.nonfinite_streak = self.nonfinite_streak + 1 if nonfinite else 0
        if not nonfinite and math.isfinite(loss):
            self.last_finite = (state.global_step, loss)
        scalars = self._scalars["train"]
        if scale is not None:
            scalars.add("batch_loss_scale", state.global_step, scale)
        scalars.add("batch_skipped_steps", state.global_step, state.skipped_steps)
        if len(scalars) >= SCALARS_FLUSH_AT:
            self._write_scalars()
        checkpoint_due = (self.checkpoint_every and state.global_step % self.checkpoint_every == 0
                          and not epoch_done)  # the epoch end saves the last batch
        self._check(scale, loss, weights=(checkpoint_due or epoch_done or state.global_step % WEIGHTS_CHECK_EVERY == 0
                                          or (nonfinite and not self.dynamic)))
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
        state.history.append(entry)
        state.epoch, state.step_in_epoch, state.epoch_skipped_steps = epoch + 1, 0, 0
        self._save()  # the last batch's on_train_batch_end checked the weights
        self._write_epoch_scalars(entry)
        self._in_background(artifacts.write_json_atomic, self.run_dir / HISTORY_FILE, list(state.history))
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
        examples = self.examples_per_epoch * (self.state.step_in_epoch - first_step) / self.steps_per_epoch
        return {"seconds": round(seconds, 4),
                "examples_per_second": round(examples / seconds, 1) if seconds > 0 else None}

    def on_train_end(self, logs=None):
        self._tick()
        self._write_scalars()
        for scalars in self._scalars.values():
            self._in_background(scalars.writer.flush)

    def close(self) -> None:
        """Finishes what is still buffered or in flight (scalars, history.png, checkpoint publishing);
        call it once training has ended or stopped."""
        try:
            self._wait_background()
        finally:
            if self._background is not None:
                self._background.shutdown()
                self._background = None
            for scalars in self._scalars.values():
                scalars.close()
            self._scalars = {}
        if self._plotted[1] != len(self.state.history):
            self._plot_history()

    def _check(self, scale: float | None, loss: float, weights: bool) -> None:
        # Without dynamic scaling an inf/NaN gradient is applied. Keras' cross-entropy clips its input and
        # ReLU maps NaN to 0 on CPU, so the loss can stay finite while the weights are already NaN. The
        # weights are checked when asked (a ~0.3 ms call), the rest on every step.
        if weights:
            if not bool(self._weights_finite()):
                raise TrainingError(self._stopped(
                    "the weights became non-finite (an update with inf/NaN gradients was applied at step "
                    f"{self._weights_checked_at + 1} or later; the running loss is {loss:.4g})"))
            self._weights_checked_at = self.state.global_step
        if self.nonfinite_streak >= self.max_nonfinite_steps:
            raise TrainingError(self._stopped(
                f"{self.nonfinite_streak} consecutive steps with a non-finite loss or gradients "
                f"(train.max_nonfinite_steps is {self.max_nonfinite_steps})"))
        if self.dynamic and scale < self.min_loss_scale:
            raise TrainingError(self._stopped(
                f"the dynamic loss scale collapsed to {scale:g} (below {self.min_loss_scale:g}) after "
                f"{self.state.skipped_steps} skipped steps, {self.nonfinite_streak} of them in a row"))

    def _watch_health(self, scale: float | None, skipped: bool) -> None:
        """Warns, once per condition, when dynamic loss scaling is struggling but training goes on."""
        if not self.dynamic or scale is None:
            return
        self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)
        if self.state.global_step > HEALTH_WARMUP_STEPS:
            self._steps_after_warmup += 1
            self._skipped_after_warmup += skipped
        share = self._skipped_after_warmup / max(self._steps_after_warmup, 1)
        if self._steps_after_warmup >= HEALTH_WARMUP_STEPS and share > self.max_skipped_share:
            self._warn("skipped_share", (
                f"{share:.0%} of the steps after the first {HEALTH_WARMUP_STEPS} were skipped for inf/NaN gradients "
                f"({self._skipped_after_warmup} of {self._steps_after_warmup}; precision.max_skipped_share is "
                f"{self.max_skipped_share:g}), so those batches do not train the model. Likely cause: values that "
                "overflow float16 (max 65504): unnormalized inputs or large activations. Fix: set model.normalize "
                "true, add the overflowing layers to precision.float32_layers, lower train.learning_rate, or train "
                "under precision.policy mixed_bfloat16"))
        if scale < self.low_loss_scale:
            self._warn("low_scale", (
                f"the dynamic loss scale fell to {scale:g} (below {self.low_loss_scale:g}) at step "
                f"{self.state.global_step}: small gradients now underflow in float16, and below 1 training stops. "
                "Likely cause: activations or gradients that overflow float16 even unscaled. Fix: set "
                "model.normalize true, add the overflowing layers to precision.float32_layers, or train under "
                "precision.policy mixed_bfloat16"))

    def _warn(self, condition: str, message: str) -> None:
        if condition not in self._warned:
            self._warned.add(condition)
            self.health_warnings.append(message)
            log.warning("loss scale: %s", message)

    def loss_scale_health(self) -> dict:
        """The run's loss-scale summary for metrics.json (this process's steps for min and warnings)."""
        scale = precision.current_loss_scale(self.model.optimizer) if self.model is not None else None
        state = self.state
        return {
            "final": scale,
            "min": self.min_scale if self.min_scale is not None else scale,
            "skipped_steps": state.skipped_steps,
            "skipped_share": round(state.skipped_steps / state.global_step, 4) if state.global_step else 0.0,
            "warnings": list(self.health_warnings),
        }

    def _stopped(self, reason: str) -> str:
        state = self.state
        self._wait_background()  # the checkpoint named below is published
        last = (f"last finite loss {self.last_finite[1]:.4g} at step {self.last_finite[0]}" if self.last_finite
                else "no finite loss yet")
        kept = (f"the last good checkpoint is kept: {self.last_checkpoint} (re-running resumes from it)"
                if self.last_checkpoint else "no checkpoint was written yet")
        scale = precision.current_loss_scale(self.model.optimizer)
        return (f"training stopped at step {state.global_step} (epoch {state.epoch + 1}, batch {state.step_in_epoch} "
                f"of {self.steps_per_epoch}): {reason}; {last}; loss scale now "
                f"{'none' if scale is None else f'{scale:g}'}; {kept}. Check the data for NaN/inf values, lower "
                "train.learning_rate, or train under precision.policy mixed_bfloat16 or float32")

    def _save(self) -> None:
        # _check has stopped training before any step that left non-finite weights; and under dynamic
        # scaling skipped updates leave the weights untouched. Without it, a non-finite loss is not
        # saved either, in case its update has not shown in the weights yet.
        if not self.dynamic and self.nonfinite_streak:
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

    def _write_epoch_scalars(self, entry: dict) -> None:
        # Keras' TensorBoard callback layout: logs/train and logs/validation, "epoch_<metric>" tags.
        for name, value in entry.items():
            if name == "epoch" or value is None:
                continue
            self._scalars["validation" if name.startswith("val_") else "train"].add(
                f"epoch_{name.removeprefix('val_')}", entry["epoch"], value)
        self._write_scalars()

    def _write_scalars(self) -> None:
        """Writes the buffered TensorBoard scalars on the background thread (a TensorFlow call, but one that
        touches only its summary writer; ~2 ms an epoch here, overlapping the next steps)."""
        for scalars in self._scalars.values():
            buffered = scalars.take()
            if buffered is not None:
                self._in_background(scalars.write, buffered)

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


class ScalarLog:
    """One TensorBoard writer's scalars, buffered and written by one graph call per flush.

    An eager tf.summary.scalar costs ~0.4 ms, a tenth of a small model's training step; a tf.function
    loop writes a whole buffer for about the price of one. The events are tf.summary.scalar's (same tag,
    float32 value, step and plugin metadata), except that their wall time is the flush's.
    """

    def __init__(self, logdir: Path):
        self.writer = tf.summary.create_file_writer(str(logdir))
        self._tags: list[str] = []
        self._steps: list[int] = []
        self._values: list[float] = []
        writer, metadata = self.writer, scalar_metadata.create_summary_metadata(display_name=None, description=None)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.int64),
                                      tf.TensorSpec([None], tf.float32)])
        def write(tags, steps, values):
            with writer.as_default():
                for i in tf.range(tf.size(tags)):
                    tf.summary.write(tags[i], values[i], step=steps[i], metadata=metadata)

        self._write = write

    def __len__(self) -> int:
        return len(self._tags)

    def add(self, tag: str, step: int, value: float) -> None:
        self._tags.append(tag)
        self._steps.append(step)
        self._values.append(value)

    def take(self) -> tuple | None:
        """The buffered scalars, as write() takes them, and an empty buffer; None when there are none."""
        if not self._tags:
            return None
        buffered = (self._tags, self._steps, self._values)
        self._tags, self._steps, self._values = [], [], []
        return buffered

    def write(self, buffered: tuple) -> None:
        tags, steps, values = buffered
        self._write(tf.constant(tags), tf.constant(steps, tf.int64), tf.constant(values, tf.float32))

    def flush(self) -> None:
        buffered = self.take()
        if buffered is not None:
            self.write(buffered)

    def close(self) -> None:
        self.flush()
        self.writer.close()


def describe_nonfinite_op(error: Exception, model: keras.Model) -> str | None:
    """One line naming the first op and Keras layer that produced inf/NaN under tf.debugging.enable_check_numerics,
    or None when the error is not a numerics check's."""
    message = str(error)
    if "Detected Infinity or NaN" not in message:
        return None
    op_type = re.search(r'graph op "([^"]+)"', message) or re.search(r'eagerly-executing op "([^"]+)"', message)
    node = re.search(r"\{\{node ([^}]+?)(?:/CheckNumericsV2)?\}\}", message)
    kind = re.search(r"Tensor had ([^\n]+?) values", message)
    op_name = node.group(1) if node else "unknown"
    layer = layer_of_op(op_name, model)
    return (f"precision.check_numerics: the first {kind.group(1) if kind else 'inf/NaN'} value came from op "
            f"'{op_name}' ({op_type.group(1) if op_type else 'unknown type'}) in "
            f"{'the gradient of ' if op_name.startswith('gradient_tape/') else ''}layer "
            f"'{layer or 'unknown'}'; compute that layer in float32 (precision.float32_layers: [{layer or '...'}]), "
            "normalize its inputs, or train under precision.policy mixed_bfloat16")


def layer_of_op(op_name: str, model: keras.Model) -> str | None:
    """The model's layer an op belongs to, from its name scope: 'functional_1/boom_1/mul' → 'boom'.

    Graph name scopes are made unique with a _N suffix, so a scope matches a layer name exactly or without it;
    the innermost match wins (a nested model's layer rather than the model)."""
    names = {layer.name for layer in model._flatten_layers(include_self=False)}
    found = None
    for part in op_name.split("/"):
        if part in names:
            found = part
        elif re.sub(r"_\d+$", "", part) in names:
            found = re.sub(r"_\d+$", "", part)
    return found


def write_history(run_dir: Path, history: list[dict]) -> None:
    artifacts.write_json_atomic(run_dir / HISTORY_FILE, history)
    if history:
        plot_history(history, run_dir / HISTORY_PLOT)


def plot_history(history: list[dict], path: Path) -> None:
    """Every training metric (with its validation curve) and the loss scale per epoch, written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    keys = [k for k in history[-1] if k not in NON_METRIC_KEYS and not k.startswith("val_")]
    keys += ["loss_scale"] if "loss_scale" in history[-1] else []
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot(epochs, [h.get(key) for h in history], marker="o", label="train" if key != "loss_scale" else key)
        if f"val_{key}" in history[-1]:
            ax.plot(epochs, [h.get(f"val_{key}") for h in history], marker="o", label="validation")
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
        ax.set_title(key.replace("_", " "))
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with artifacts.atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
