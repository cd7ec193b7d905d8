"""The two training loops, one behaviour: Keras Model.fit, or a tf.function step with explicit loss scaling.

Both train on the same batches (Plan.train_batches), report the same logs to the same callbacks (the
run recorder and the progress bar, through a keras CallbackList), validate on the same rows after every
epoch and can start in the middle of an epoch, so on the same config and seed they give the same
results. The custom loop is what Model.fit does, written out: scale the loss inside the tape, let
LossScaleOptimizer.apply unscale, check and skip, and update the compiled metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import tensorflow as tf

from pipeline import data
from pipeline.config import Config
from pipeline.data import service
from pipeline.errors import TrainingError
from pipeline.train import numerics
from pipeline.train.input_wait import InputClock
from pipeline.train.length import RunLength, run_length

# Pass p over the training rows shuffles with seed * _PASS_SEEDS + p: a fresh, deterministic order per pass that a
# resumed process can reproduce without replaying the passes before it.
_PASS_SEEDS = 1_000_003


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the loops train on: the batches of every epoch, in an order fixed by (seed, pass) (train/length.py)."""

    datasets: data.Datasets
    batch_size: int  # the global batch: split among the replicas of a distributed run
    shuffle_buffer: int
    seed: int
    length: RunLength
    verbose: int  # Keras verbosity: 1 progress bar, 2 one line per epoch, 0 silent
    clock: InputClock | None = None  # stamps each batch, to measure the steps' wait for input
    service: str | None = None  # data.service: training batches from this tf.data service dispatcher
    job_name: str = "training"  # the service's job, shared by every worker of the run
    validation_steps: int | None = None  # the first validation batches only (train.validation_steps)

    @property
    def steps_per_epoch(self) -> int:
        return self.length.steps_per_epoch

    @property
    def epochs(self) -> int:
        return self.length.epochs

    def train_batches(self, first_epoch: int, skip: int = 0,
                      input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """The batches from the `skip`-th of first_epoch to the run's last (records left out before decoding, where
        the source allows). input_context: one worker's part of them (distribute_datasets_from_function); every
        worker takes the same number of batches per pass.

        Datasets.train_dataset runs inside flat_map and so gets its seed as a scalar int64 tensor, which
        tf.data's shuffle accepts; pass p is the first iteration of its own dataset, whatever ran before.
        """
        batch_size = input_context.get_per_replica_batch_size(self.batch_size) if input_context else self.batch_size
        workers = input_context.num_input_pipelines if input_context else 1
        length = self.length
        first_pass, offset = length.position(first_epoch, skip)
        last_pass = (length.total_steps - 1) // length.pass_steps
        remaining = length.total_steps - first_epoch * length.steps_per_epoch - skip

        def pass_batches(pass_index, skipped=0):
            batches = self.datasets.train_dataset(batch_size, self.shuffle_buffer,
                                                  seed=self.seed * _PASS_SEEDS + pass_index,
                                                  input_context=input_context, skip=skipped * batch_size)
            if self.service:  # one job per pass: the service hands out that pass's shards among its workers
                batches = service.distribute(batches, self.service, f"{self.job_name}-pass-{pass_index}")
            if workers > 1:  # shards of unequal size: no worker may run out before the others
                batches = batches.repeat().take(length.pass_steps - skipped)
            return batches

        if self.service:  # Python passes: a job name per pass is a string, not a tensor
            batches = pass_batches(first_pass, offset)
            for pass_index in range(first_pass + 1, last_pass + 1):
                batches = batches.concatenate(pass_batches(pass_index))
        else:
            batches = tf.data.Dataset.range(first_pass, first_pass + 1).flat_map(lambda p: pass_batches(p, offset))
            batches = batches.concatenate(tf.data.Dataset.range(first_pass + 1, last_pass + 1).flat_map(pass_batches))
        batches = batches.take(remaining)  # a last pass that train.max_steps or the epochs cut short
        return self.clock.stamp(batches) if self.clock else batches

    def val_batches(self, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        batch_size = input_context.get_per_replica_batch_size(self.batch_size) if input_context else self.batch_size
        batches = self.datasets.val_dataset(batch_size, input_context=input_context)
        return batches if self.validation_steps is None else batches.take(self.validation_steps)


def plan_for(cfg: Config, datasets: data.Datasets, verbose: int = 0, **options) -> Plan:
    """The experiment's plan: its batch size, shuffling, seed, length and validation batches (options: the rest)."""
    return Plan(datasets, cfg.train.batch_size, cfg.data.shuffle_buffer, cfg.seed,
                run_length(cfg.train, datasets.train_examples), verbose, validation_steps=cfg.train.validation_steps,
                **options)


def run(loop: str, model: keras.Model, plan: Plan, callbacks: list[keras.callbacks.Callback],
        start_epoch: int, start_step: int, strategy: tf.distribute.Strategy) -> None:
    """Trains from (start_epoch, start_step) to the end of plan.epochs with the configured loop.

    Under precision.check_numerics the first inf/NaN op stops training with a TrainingError naming the op and its layer.
    """
    try:
        if loop == "fit":
            fit(model, plan, callbacks, start_epoch, start_step)
        else:
            custom(model, plan, callbacks, start_epoch, start_step, strategy)
    except tf.errors.InvalidArgumentError as error:
        message = numerics.describe_nonfinite_op(error, model)
        if message is None:
            raise
        raise TrainingError(message) from None


def fit(model: keras.Model, plan: Plan, callbacks: list, start_epoch: int, start_step: int) -> None:
    """Model.fit, one call per run of epochs of one length (fit_spans)."""
    for first_epoch, last_epoch, skip, steps in fit_spans(plan.length, start_epoch, start_step):
        model.fit(
            plan.train_batches(first_epoch, skip),
            validation_data=plan.val_batches(),
            initial_epoch=first_epoch,
            epochs=last_epoch,
            steps_per_epoch=steps,
            shuffle=False,  # the batches are already in their (seed, epoch) order
            callbacks=_callback_list(model, callbacks, plan, steps),
        )


def fit_spans(length: RunLength, start_epoch: int, start_step: int) -> list[tuple[int, int, int, int]]:
    """(first epoch, end epoch, batches skipped, steps per epoch) of each Model.fit call, which trains epochs of one
    length from their start: a run resumed mid-epoch first finishes that epoch in a call of its own (its metrics for
    that epoch then cover the remaining batches), and a last epoch that train.max_steps cuts short has its own."""
    spans, epoch = [], start_epoch
    if start_step:
        spans.append((epoch, epoch + 1, start_step, length.steps_in_epoch(epoch) - start_step))
        epoch += 1
    full_epochs = length.total_steps // length.steps_per_epoch
    if epoch < full_epochs:
        spans.append((epoch, full_epochs, 0, length.steps_per_epoch))
        epoch = full_epochs
    if epoch < length.epochs:
        spans.append((epoch, epoch + 1, 0, length.steps_in_epoch(epoch)))
    return spans


def custom(model: keras.Model, plan: Plan, callbacks: list, start_epoch: int, start_step: int,
           strategy: tf.distribute.Strategy) -> None:
    """The same epochs as fit, with a hand-written tf.function train step (see _train_step)."""
    # "auto" was resolved by compile(): XLA where Keras would use it (GPUs), and never under op determinism.
    train_step = _train_step(model, strategy, bool(model.jit_compile))
    test_step = _test_step(model, strategy, bool(model.jit_compile))
    batches = iter(strategy.distribute_datasets_from_function(
        lambda context: plan.train_batches(start_epoch, start_step, context)))
    callback_list = _callback_list(model, callbacks, plan, plan.steps_per_epoch)
    model.stop_training = False
    callback_list.on_train_begin()
    epoch_logs = {}
    for epoch in range(start_epoch, plan.epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        for batch in range(start_step if epoch == start_epoch else 0, plan.length.steps_in_epoch(epoch)):
            callback_list.on_train_batch_begin(batch)
            logs = train_step(next(batches))
            callback_list.on_train_batch_end(batch, logs)
            if model.stop_training:
                break
        epoch_logs = _to_floats(model.get_metrics_result())  # read outside the replicas: summed over all of them
        epoch_logs.update({f"val_{name}": value for name, value in evaluate(model, test_step, plan, strategy).items()})
        callback_list.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callback_list.on_train_end(epoch_logs)


def evaluate(model: keras.Model, test_step: Callable, plan: Plan, strategy: tf.distribute.Strategy) -> dict[str, float]:
    """The compiled loss and metrics over the validation rows (what Model.evaluate returns)."""
    model.reset_metrics()
    for batch in strategy.distribute_datasets_from_function(plan.val_batches):
        test_step(batch)
    return _to_floats(model.get_metrics_result())


def _train_step(model: keras.Model, strategy: tf.distribute.Strategy, jit_compile: bool) -> Callable:
    optimizer = model.optimizer
    loss_tracker = _loss_tracker(model)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
            # Inside the tape, or there is no gradient (docs/keras3-mixed-precision.md §3). Under dynamic scaling this is the
            # LossScaleOptimizer's current scale; a static scale multiplies by loss_scale_factor; else a no-op.
            scaled_loss = optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled_loss, model.trainable_variables)
        # LossScaleOptimizer.apply unscales; on inf/NaN it skips the update and halves the scale, and after
        # dynamic_growth_steps finite steps it doubles it. Never call the inner optimizer directly.
        optimizer.apply(gradients, model.trainable_variables)
        _track_loss(loss_tracker, loss, x)
        return model.compute_metrics(x, y, y_pred)

    @tf.function(jit_compile=jit_compile, reduce_retracing=True)
    def train_step(batch):
        return _reduce(strategy, strategy.run(replica_step, args=batch))

    return train_step


def _test_step(model: keras.Model, strategy: tf.distribute.Strategy, jit_compile: bool) -> Callable:
    loss_tracker = _loss_tracker(model)

    def replica_step(x, y):
        y_pred = model(x, training=False)
        _track_loss(loss_tracker, model.compute_loss(x=x, y=y, y_pred=y_pred, training=False), x)
        return model.compute_metrics(x, y, y_pred)

    @tf.function(jit_compile=jit_compile, reduce_retracing=True)
    def test_step(batch):
        return _reduce(strategy, strategy.run(replica_step, args=batch))

    return test_step


def _loss_tracker(model: keras.Model) -> keras.metrics.Metric:
    """The compiled model's running-mean "loss" metric, the one fit reports."""
    return next(metric for metric in model.metrics if metric.name == "loss")


def _track_loss(tracker: keras.metrics.Metric, loss, x) -> None:
    # compute_loss divides by the number of replicas so that summed gradients average; undo that for the log.
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    tracker.update_state(loss * replicas, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])


def _reduce(strategy: tf.distribute.Strategy, per_replica: dict) -> dict:
    """One value per log across replicas (and workers), so every worker sees and decides on the same numbers.

    The mean of each replica's running metrics, like fit's per-batch logs; epoch logs instead read the
    metrics outside the replicas, where their variables (SyncOnRead, SUM) add up across all of them."""
    return {name: strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None) for name, value in per_replica.items()}


def _callback_list(model: keras.Model, callbacks: list, plan: Plan, steps: int) -> keras.callbacks.CallbackList:
    return keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=plan.verbose != 0,
                                        verbose=plan.verbose, epochs=plan.epochs, steps=steps, model=model)


def _to_floats(logs: dict) -> dict[str, float]:
    return {name: float(value) for name, value in logs.items()}
