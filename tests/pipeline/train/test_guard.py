"""The training guard: its stop rules fed step by step, and the loss-scale health (warnings when dynamic loss
scaling struggles, and the summary for metrics.json) in real runs."""

import json
import logging

import keras
import pytest
import tensorflow as tf

from pipeline import data, precision
from pipeline.train import checkpoints, loops
from pipeline.config import load_config
from pipeline.errors import TrainingError
from pipeline.train.guard import WEIGHTS_CHECK_EVERY, TrainingGuard
from pipeline.train.recorder import RunRecorder
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
    plan = loops.plan_for(cfg, datasets)
    state = checkpoints.TrainingState(config=cfg.to_dict())
    recorder = RunRecorder(tmp_path, checkpoints.Checkpointer(tmp_path, model, 1), state, cfg.train, policy,
                           plan.length)
    try:
        loops.run(cfg.train.loop, model, plan, [recorder], 0, 0, tf.distribute.get_strategy())
    finally:
        recorder.close()
    return recorder


def _rows(n: int, scale: float = 1.0) -> data.Datasets:
    cfg = load_config(None)
    rows = data.load_datasets(cfg.data, seed=cfg.seed)
    return data.in_memory(rows.spec, rows.train.x[:n] * scale, rows.train.y[:n], rows.val.x[:32], rows.val.y[:32])


def test_overflow_prone_inputs_warn_once_with_cause_and_fix(tmp_path, caplog):
    # Raw digits × 100 reach float16 unnormalized; with the scale doubling after every finite step it keeps
    # climbing into overflow, so about every other step after the warm-up is skipped.
    with caplog.at_level(logging.WARNING, logger="pipeline.train.guard"):
        recorder = _run(_rows(960, 100.0), tmp_path, "precision.dynamic_growth_steps=1")
    health = recorder.loss_scale_health()
    assert health["skipped_steps"] > 0 and health["skipped_share"] > 0.05
    assert health["final"] >= 1 and health["min"] <= health["final"]
    assert any("precision.max_skipped_share" in warning for warning in health["warnings"])
    shares = [r.getMessage() for r in caplog.records if "max_skipped_share" in r.getMessage()]
    assert len(shares) == 1  # once per condition, not once per step
    assert "model.normalize" in shares[0] and "mixed_bfloat16" in shares[0]


def test_a_falling_scale_warns_before_training_stops(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.train.guard"), pytest.raises(TrainingError, match="collapsed"):
        _run(_rows(256, 3e4), tmp_path, "precision.initial_scale=1024", "train.max_nonfinite_steps=1000")
    low = [r.getMessage() for r in caplog.records if "fell to" in r.getMessage()]
    assert len(low) == 1 and "below 32" in low[0]


def test_a_normal_run_has_no_warnings(trained_run):
    metrics = json.loads((trained_run.run_dir / METRICS_FILE).read_text())
    health = metrics["loss_scale_health"]
    assert health["warnings"] == [] and health["final"] >= 1024


def _guard(loss_scale: str, initial_scale: float | None, *overrides, checkpoint=None) -> TrainingGuard:
    cfg = load_config(None, list(overrides))
    policy = precision.PolicyInfo(name="mixed_float16" if loss_scale != "none" else "float32",
                                  compute_dtype="float16" if loss_scale != "none" else "float32",
                                  variable_dtype="float32", loss_scale=loss_scale, initial_scale=initial_scale)
    return TrainingGuard(checkpoints.TrainingState(config=cfg.to_dict()), cfg.train, policy, steps_per_epoch=100,
                         published_checkpoint=lambda: checkpoint)


def _step(guard: TrainingGuard, scale, skipped: bool, loss: float, weights_finite=lambda: True,
          check_weights: bool = False) -> None:
    """What the recorder does for one step: count it, then hand it to the guard."""
    guard.state.global_step += 1
    guard.state.step_in_epoch += 1
    guard.state.skipped_steps += skipped
    guard.after_step(scale, skipped, loss, weights_finite, check_weights)


def test_guard_stops_on_a_collapsed_scale_with_the_whole_message():
    guard = _guard("dynamic", 4.0)
    _step(guard, 4.0, False, 0.5)
    _step(guard, 2.0, True, float("nan"))
    _step(guard, 1.0, True, float("nan"))
    with pytest.raises(TrainingError) as stopped:
        _step(guard, 0.5, True, float("nan"))
    assert str(stopped.value) == (
        "training stopped at step 4 (epoch 1, batch 4 of 100): the dynamic loss scale collapsed to 0.5 (below 1) "
        "after 3 skipped steps, 3 of them in a row; last finite loss 0.5 at step 1; loss scale now 0.5; no "
        "checkpoint was written yet. Check the data for NaN/inf values, lower train.learning_rate, or train under "
        "precision.policy mixed_bfloat16 or float32")
    assert guard.may_checkpoint()  # skipped updates leave the weights alone


def test_guard_stops_on_a_streak_and_names_the_published_checkpoint(tmp_path):
    kept = tmp_path / "checkpoints" / "ckpt-000000002"
    guard = _guard("dynamic", 32768.0, "train.max_nonfinite_steps=2", checkpoint=kept)
    _step(guard, 32768.0, False, 0.25)
    _step(guard, 16384.0, True, float("inf"))
    with pytest.raises(TrainingError) as stopped:
        _step(guard, 8192.0, True, float("inf"))
    assert str(stopped.value) == (
        "training stopped at step 3 (epoch 1, batch 3 of 100): 2 consecutive steps with a non-finite loss or "
        "gradients (train.max_nonfinite_steps is 2); last finite loss 0.25 at step 1; loss scale now 8192; the last "
        f"good checkpoint is kept: {kept} (re-running resumes from it). Check the data for NaN/inf values, lower "
        "train.learning_rate, or train under precision.policy mixed_bfloat16 or float32")


def test_guard_without_loss_scaling_checks_the_weights_on_its_schedule_and_never_checkpoints_a_nonfinite_loss():
    guard = _guard("none", None)
    checked = []

    def weights_finite():
        checked.append(guard.state.global_step)
        return True

    for _ in range(2 * WEIGHTS_CHECK_EVERY):
        _step(guard, None, False, 0.5, weights_finite)
    _step(guard, None, False, 0.5, weights_finite, check_weights=True)  # a checkpoint or an epoch end is due
    _step(guard, None, False, float("nan"), weights_finite)  # its update may already be in the weights
    assert checked == [WEIGHTS_CHECK_EVERY, 2 * WEIGHTS_CHECK_EVERY, 2 * WEIGHTS_CHECK_EVERY + 1,
                       2 * WEIGHTS_CHECK_EVERY + 2]
    assert not guard.may_checkpoint()
    with pytest.raises(TrainingError, match=r"^training stopped at step 43 \(epoch 1, batch 43 of 100\): the weights "
                                            r"became non-finite \(an update with inf/NaN gradients was applied at step "
                                            r"43 or later; the running loss is nan\); last finite loss 0.5 at step 41; "
                                            r"loss scale now none; no checkpoint was written yet\."):
        _step(guard, None, False, float("nan"), lambda: False)
    assert guard.loss_scale_health(None) == {"final": None, "min": None, "skipped_steps": 0, "skipped_share": 0.0,
                                             "warnings": []}
