"""Figure 1: the pipeline's `train` path vs a bare Keras model.fit on the same model, data and policy.

Both sides get the same EpochTimer (bench.timing) and report steady-state examples/s: the median
epoch after the first, an epoch lasting from its start to the next one's, so the pipeline's
per-step bookkeeping (loss-scale checks, TensorBoard scalars) and per-epoch work (checkpoint,
history.json) are inside it, as is the validation pass both sides run. The sides alternate, so
drift on a shared machine hits both alike.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from bench import timing
from bench.workloads import Sizes, training_overrides

TITLE = "Training overhead: pipeline train vs bare Keras fit"
TARGET = "pipeline costs <= 3%"
COLUMNS = ["side", "policy", "examples_per_second", "ratio_to_bare", "overhead_pct", "target_met"]


def run(sizes: Sizes, work_dir: Path) -> dict:
    import keras

    from pipeline.config import load_config
    from pipeline.train import train

    cfg = load_config(None, training_overrides(sizes, work_dir))
    pipeline_eps, bare_eps, policy = [], [], None
    try:
        for repeat in range(sizes.train_repeats):
            timing.progress(f"training: repeat {repeat + 1}/{sizes.train_repeats}: pipeline train")
            with _timed_pipeline() as timer:
                result = train(cfg, fresh=True)
            policy = result.policy.name
            pipeline_eps.append(timing.steady_examples_per_second(timer.epoch_seconds(), result.datasets.train_examples))
            timing.progress(f"training: repeat {repeat + 1}/{sizes.train_repeats}: bare model.fit "
                            f"(pipeline: {pipeline_eps[-1]:.0f} examples/s)")
            bare_eps.append(_bare_fit(cfg))
            timing.progress(f"training: bare model.fit {bare_eps[-1]:.0f} examples/s")
    finally:
        keras.config.set_dtype_policy("float32")
    pipeline, bare = timing.median(pipeline_eps), timing.median(bare_eps)
    overhead = (bare / pipeline - 1) * 100  # extra time per example, in percent of the bare time
    rows = [
        {"side": "bare keras fit", "policy": policy, "examples_per_second": bare, "ratio_to_bare": 1.0,
         "overhead_pct": 0.0, "target_met": None},
        {"side": "pipeline train", "policy": policy, "examples_per_second": pipeline, "ratio_to_bare": pipeline / bare,
         "overhead_pct": overhead, "target_met": overhead <= 3.0},
    ]
    return {"rows": rows, "samples": {"pipeline": pipeline_eps, "bare": bare_eps},
            "setup": {"train_rows": result.datasets.train_examples, "features": sizes.train_features,
                      "hidden_units": list(sizes.train_hidden), "batch_size": sizes.train_batch,
                      "epochs": sizes.train_epochs, "repeats": sizes.train_repeats}}


@contextlib.contextmanager
def _timed_pipeline() -> Iterator:
    """Adds an EpochTimer to the callbacks pipeline.train hands its loop (train() takes no callbacks).

    Only the callback list changes; the loop, recorder and checkpoints are the pipeline's own.
    """
    from pipeline.train import loops

    timer, original = timing.epoch_timer(), loops.run

    def run_with_timer(loop, model, plan, callbacks, *args, **kwargs):
        return original(loop, model, plan, [*callbacks, timer], *args, **kwargs)

    loops.run = run_with_timer
    try:
        yield timer
    finally:
        loops.run = original


def _bare_fit(cfg) -> float:
    """What a user would write by hand: the same compiled model and tf.data rows, then model.fit."""
    import keras

    from pipeline import data, precision
    from pipeline.train import build_compiled_model

    policy = precision.apply_policy(cfg.precision)
    keras.utils.set_random_seed(cfg.seed)
    datasets = data.load_datasets(cfg.data, seed=cfg.seed)
    model = build_compiled_model(cfg, datasets, policy)
    timer = timing.epoch_timer()
    model.fit(datasets.train_dataset(cfg.train.batch_size, cfg.data.shuffle_buffer, cfg.seed),
              validation_data=datasets.val_dataset(cfg.train.batch_size), epochs=cfg.train.epochs,
              callbacks=[timer], shuffle=False, verbose=0)  # the dataset shuffles itself
    return timing.steady_examples_per_second(timer.epoch_seconds(), datasets.train_examples)


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    ax.bar([r["side"] for r in rows], [r["examples_per_second"] for r in rows], color=["#999999", "#1f77b4"])
    ax.set_ylabel("examples/s (steady state)")
    judged = rows[1]["target_met"] is not None  # None: a smoke run, too small to judge (result_files.judge)
    headline = f"{rows[1]['overhead_pct']:+.1f}% (target <= 3%)" if judged else "target <= 3% not judged"
    ax.set_title(f"1. training overhead: {headline}", fontsize=9)
