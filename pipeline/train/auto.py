"""precision.policy auto where the CPU's flags do not decide (precision.measurement_decides): a few train steps of the
experiment's model under each candidate (precision.TRAIN_CANDIDATES), timed before training starts;
precision.pick_measured takes the faster (docs/precision.md#auto).

The candidates' models are thrown away, and Keras' layer names and random seeds are reset afterwards, so the run's
own model is built, named and initialised exactly as without the measurement.
"""

from __future__ import annotations

import logging
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from pipeline import data, precision
from pipeline.config import Config
from pipeline.train import distribute

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # the first traces (and with train.jit_compile compiles) the step
# Timed steps per candidate, interleaved: at least MIN_STEPS, more while the budget lasts (a small model's steps take
# a few ms, and a median of 5 of them moved by 30% from run to run on 2 shared cores).
MIN_STEPS, MAX_STEPS = 5, 50
BUDGET_S = 1.0


def measurer(cfg: Config, datasets: data.Datasets, strategy: tf.distribute.Strategy,
             build: Callable[[precision.PolicyInfo], keras.Model]
             ) -> Callable[[tuple[str, ...]], precision.Measured] | None:
    """What precision.apply_policy calls to time the candidates; None where measuring cannot be trusted: workers of a
    multi_worker run would each measure and could choose differently, so the flags decide there.

    build(policy) returns the compiled model under the current global policy (train.run.build_compiled_model)."""
    if cfg.precision.policy != "auto":
        return None
    workers = distribute.workers(strategy)
    if workers > 1:
        log.info("precision.policy auto: not measured: %d workers would each measure and could choose differently; "
                 "the CPU's flags decide", workers)
        return None
    return lambda candidates: measure(cfg, datasets, strategy, build, candidates)


def measure(cfg: Config, datasets: data.Datasets, strategy: tf.distribute.Strategy,
            build: Callable[[precision.PolicyInfo], keras.Model], candidates: tuple[str, ...]) -> precision.Measured:
    """Train steps per second of each candidate on one batch of train.batch_size training rows (the build's sample
    rows, already in memory), Keras' train step (train_on_batch) in the strategy's scope."""
    batch = cfg.train.batch_size
    x, y = _batch(datasets, batch)
    steps = {}
    try:
        for policy in candidates:
            keras.backend.clear_session(free_memory=False)  # each build names its layers as the run's own build will
            with precision.policy_scope(policy), strategy.scope():
                model = build(precision.describe_policy(policy))
            steps[policy] = _stepper(model, x, y)
        seconds = precision.median_seconds(steps, warmup=WARMUP_STEPS, min_rounds=MIN_STEPS, max_rounds=MAX_STEPS,
                                       budget_s=BUDGET_S)
    finally:
        keras.backend.clear_session(free_memory=False)  # also resets the global policy: apply_policy sets it next
        keras.utils.set_random_seed(cfg.seed)
    rates = {policy: {batch: precision.measured_rate(seconds[policy], 1)} for policy in candidates}
    method = (f"Keras train steps (train_on_batch) of the experiment's model on {batch} training rows "
              f"(train.batch_size): {WARMUP_STEPS} warm-up steps, then the median of {MIN_STEPS} to {MAX_STEPS} "
              f"interleaved steps each within {BUDGET_S:g} s")
    return precision.Measured("steps/s", rates, method)


def _batch(datasets: data.Datasets, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """rows training rows from the build's sample (repeated when it holds fewer), labels as the loss expects them."""
    index = np.arange(rows) % len(datasets.sample_x)
    labels = datasets.sample_y[index]
    return datasets.sample_x[index], labels.astype(np.float32 if datasets.spec.task == "regression" else np.int64)


def _stepper(model: keras.Model, x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    def step() -> None:
        model.train_on_batch(x, y)  # returns the loss as numpy: the step has finished

    return step
