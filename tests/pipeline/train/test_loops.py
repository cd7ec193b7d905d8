"""The two training loops: same results, loss scaling by hand in the custom step, accumulation, XLA."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline import data, precision
from pipeline.train import checkpoints, loops
from pipeline.config import load_config
from pipeline.train.recorder import RunRecorder
from pipeline.train import build_compiled_model, train


def test_custom_loop_matches_fit_on_the_same_config_and_seed(trained_run, tiny_config_path, tmp_path):
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path / 'runs'}", "train.loop=custom"])
    custom = train(cfg)
    fit_history = checkpoints.read_state(checkpoints.latest_checkpoint(trained_run.run_dir)).history
    custom_history = checkpoints.read_state(checkpoints.latest_checkpoint(custom.run_dir)).history
    assert [set(h) for h in custom_history] == [set(h) for h in fit_history]  # same metrics, same logs
    assert custom.metrics["val_accuracy"] == pytest.approx(trained_run.metrics["val_accuracy"], abs=0.02)
    for key in ("loss", "val_loss", "accuracy"):
        np.testing.assert_allclose([h[key] for h in custom_history], [h[key] for h in fit_history], rtol=0.02)
    # Same ops in the same order: on CPU the two loops agree bit for bit (GPU kernels need not).
    assert custom.metrics["weights_sha1"] == trained_run.metrics["weights_sha1"]
    assert custom.metrics["loop"] == "custom" and trained_run.metrics["loop"] == "fit"


def _rows(n: int, value: float | None = None):
    """n digits training rows (all set to `value` when given) and some validation rows."""
    cfg = load_config(None)
    rows = data.load_datasets(cfg.data, seed=cfg.seed)
    x = rows.train.x[:n] if value is None else np.full((n, *rows.spec.input_shape), value, np.float32)
    return data.in_memory(rows.spec, x, rows.train.y[:n], rows.val.x[:64], rows.val.y[:64])


def _run(loop: str, datasets: data.Datasets, tmp_path, *overrides):
    """One epoch of train()'s machinery (model, optimizer, recorder, loop) on the given rows, with
    normalize off so that raw values reach the float16 layers."""
    cfg = load_config(None, ["model.hidden_units=[16]", "model.normalize=false", "train.optimizer=sgd",
                             "train.learning_rate=0.1", "train.epochs=1", f"train.runs_dir={tmp_path}", *overrides])
    policy = precision.apply_policy(cfg.precision)
    keras.utils.set_random_seed(cfg.seed)
    model = build_compiled_model(cfg, datasets, policy)
    initial = [w.copy() for w in model.get_weights()]
    plan = loops.plan_for(cfg, datasets)
    run_dir = tmp_path / loop
    recorder = RunRecorder(run_dir, checkpoints.Checkpointer(run_dir, model, 1), checkpoints.TrainingState(),
                           cfg.train, policy, plan.length)
    loops.run(loop, model, plan, [recorder], 0, 0, tf.distribute.get_strategy())
    recorder.close()
    return model, initial, recorder


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_an_overflowing_step_is_skipped_and_halves_the_scale(loop, tmp_path):
    # 3e4 in float16 Dense layers overflows (float16 max 65504): the gradients are inf/NaN.
    model, initial, recorder = _run(loop, _rows(8, 3e4), tmp_path, "train.batch_size=8", "precision.initial_scale=1024")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    for before, after in zip(initial, model.get_weights()):
        np.testing.assert_array_equal(before, after)  # the update was skipped
    assert int(optimizer.iterations.numpy()) == 0
    assert float(optimizer.dynamic_scale.numpy()) == 512.0
    assert recorder.state.skipped_steps == 1  # seen from outside the step, the same way in both loops
    assert recorder.state.history[0]["skipped_steps"] == 1 and recorder.state.history[0]["loss_scale"] == 512.0


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_gradient_accumulation_averages_batches_under_loss_scaling(loop, tmp_path):
    rows, scale = _rows(64), "precision.initial_scale=256"  # low enough that raw digits never overflow
    accumulated, initial, recorder = _run(loop, rows, tmp_path / "acc", scale, "train.batch_size=32",
                                          "train.gradient_accumulation_steps=2")
    one_batch, initial_again, _ = _run(loop, rows, tmp_path / "one", scale, "train.batch_size=64")
    assert recorder.state.skipped_steps == 0
    for a, b in zip(initial, initial_again):
        np.testing.assert_array_equal(a, b)
    optimizer = accumulated.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert optimizer.accumulation_steps == 2  # AccumulatingLossScaleOptimizer (pipeline/train/accumulation.py)
    assert int(optimizer.iterations.numpy()) == 1  # two batches, one update
    assert int(optimizer.step_counter.numpy()) == 2  # the scale counts finite batches towards growth
    assert any(not np.array_equal(w, w0) for w, w0 in zip(accumulated.get_weights(), initial))
    # Two halves averaged = one batch of both, up to float16 rounding of the per-batch gradients.
    for a, b in zip(accumulated.get_weights(), one_batch.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)


def test_jit_compile_trains_both_loops_with_xla(tmp_path):
    rows = _rows(64)  # 2 full batches: one XLA compilation per step function
    trained = {}
    for loop in ("fit", "custom"):
        model, initial, recorder = _run(loop, rows, tmp_path / loop, "train.jit_compile=true", "train.batch_size=32",
                                        "precision.initial_scale=256")
        assert model.jit_compile is True  # XLA works on CPU; not under op determinism (docs/keras3-mixed-precision.md §8)
        assert np.isfinite(recorder.state.history[0]["loss"]) and recorder.state.skipped_steps == 0
        trained[loop] = model.get_weights()
    for a, b in zip(trained["fit"], trained["custom"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
