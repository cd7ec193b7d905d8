"""Loss-scale health: warnings when dynamic loss scaling struggles, and the summary for metrics.json."""

import dataclasses
import json
import logging

import keras
import pytest
import tensorflow as tf

from pipeline import data, precision
from pipeline.train import checkpoints, loops
from pipeline.config import load_config
from pipeline.train.recorder import RunRecorder, TrainingError
from pipeline.artifacts import METRICS_FILE
from pipeline.train import build_compiled_model


def _run(datasets: data.Datasets, tmp_path, *overrides) -> RunRecorder:
    """train()'s machinery (model, optimizer, recorder, fit) on the given rows, with normalize off."""
    cfg = load_config(None, ["model.hidden_units=[16]", "model.normalize=false", "train.optimizer=sgd",
                             "train.learning_rate=0.01", "train.epochs=1", "train.batch_size=8",
                             f"train.runs_dir={tmp_path}", *overrides])
    policy = precision.apply_policy(cfg.precision)
    keras.utils.set_random_seed(cfg.seed)
    model = build_compiled_model(cfg, datasets, policy)
    plan = loops.Plan(datasets, cfg.train.batch_size, cfg.data.shuffle_buffer, cfg.seed, cfg.train.epochs, verbose=0)
    state = checkpoints.TrainingState(config=cfg.to_dict())
    recorder = RunRecorder(tmp_path, checkpoints.Checkpointer(tmp_path, model, 1), state, cfg.train, policy,
                           plan.steps_per_epoch)
    try:
        loops.run(cfg.train.loop, model, plan, [recorder], 0, 0, tf.distribute.get_strategy())
    finally:
        recorder.close()
    return recorder


def _rows(n: int, scale: float = 1.0) -> data.Datasets:
    cfg = load_config(None)
    rows = data.load_datasets(cfg.data, seed=cfg.seed)
    return dataclasses.replace(rows, train_x=rows.train_x[:n] * scale, train_y=rows.train_y[:n],
                               val_x=rows.val_x[:32], val_y=rows.val_y[:32])


def test_overflow_prone_inputs_warn_once_with_cause_and_fix(tmp_path, caplog):
    # Raw digits × 100 reach float16 unnormalized; with the scale doubling after every finite step it keeps
    # climbing into overflow, so about every other step after the warm-up is skipped.
    with caplog.at_level(logging.WARNING, logger="pipeline.train.recorder"):
        recorder = _run(_rows(960, 100.0), tmp_path, "precision.dynamic_growth_steps=1")
    health = recorder.loss_scale_health()
    assert health["skipped_steps"] > 0 and health["skipped_share"] > 0.05
    assert health["final"] >= 1 and health["min"] <= health["final"]
    assert any("precision.max_skipped_share" in warning for warning in health["warnings"])
    shares = [r.getMessage() for r in caplog.records if "max_skipped_share" in r.getMessage()]
    assert len(shares) == 1  # once per condition, not once per step
    assert "model.normalize" in shares[0] and "mixed_bfloat16" in shares[0]


def test_a_falling_scale_warns_before_training_stops(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.train.recorder"), pytest.raises(TrainingError, match="collapsed"):
        _run(_rows(256, 3e4), tmp_path, "precision.initial_scale=1024", "train.max_nonfinite_steps=1000")
    low = [r.getMessage() for r in caplog.records if "fell to" in r.getMessage()]
    assert len(low) == 1 and "below 32" in low[0]


def test_a_normal_run_has_no_warnings(trained_run):
    metrics = json.loads((trained_run.run_dir / METRICS_FILE).read_text())
    health = metrics["loss_scale_health"]
    assert health["warnings"] == [] and health["final"] >= 1024
