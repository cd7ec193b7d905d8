"""A real (tiny) mixed_float16 training run, the run directory it leaves, and the non-finite guard."""

import dataclasses
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline import cli, data, models, precision
from pipeline.train import checkpoints, guard, loops, recorder
from pipeline.config import ConfigError, load_config
from pipeline.train import TrainingError, build_compiled_model, train


def test_trains_under_mixed_float16_with_a_loss_scale_optimizer(trained_run):
    model = trained_run.model
    assert trained_run.policy.name == "mixed_float16"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert {layer.compute_dtype for layer in dense} == {"float16"}
    assert {v.dtype for v in model.trainable_weights} == {"float32"}
    probabilities = keras.ops.convert_to_numpy(model(trained_run.datasets.val.x[:8]))
    assert probabilities.dtype == np.float32


def test_accuracy_is_clearly_above_chance(trained_run):
    assert trained_run.metrics["val_accuracy"] > 0.6  # 10 classes: chance is 0.1


def test_run_directory_holds_config_history_checkpoints_logs_and_metrics(trained_run, tiny_config):
    run_dir = trained_run.run_dir
    assert run_dir == tiny_config.run_dir
    for name in ("config.yaml", "model.keras", "metrics.json", "history.json", "history.png"):
        assert (run_dir / name).is_file(), name
    for kind in ("train", "validation"):
        assert any((run_dir / "logs" / kind).glob("events.out.tfevents.*")), kind
    history = json.loads((run_dir / "history.json").read_text())
    assert [h["epoch"] for h in history] == list(range(1, tiny_config.train.epochs + 1))
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "loss_scale", "skipped_steps"} <= set(history[0])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val_accuracy"] == trained_run.metrics["val_accuracy"] == history[-1]["val_accuracy"]
    assert {"val_loss", "train_loss", "train_accuracy", "skipped_steps", "final_loss_scale", "weights_sha1"} <= set(metrics)
    latest = checkpoints.latest_checkpoint(run_dir)
    state = checkpoints.read_state(latest)
    assert (state.epoch, state.step_in_epoch) == (tiny_config.train.epochs, 0)
    assert state.history == history
    assert not list(run_dir.rglob(".tmp-*")), "no temporaries left behind"


def test_loss_scale_and_skipped_steps_are_logged_per_step_to_tensorboard(trained_run):
    steps: dict[str, list[int]] = {}
    for events in (trained_run.run_dir / "logs" / "train").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
                assert value.metadata.plugin_data.plugin_name == "scalars"  # what tf.summary.scalar writes
    tags = {"batch_loss_scale", "batch_skipped_steps", "epoch_loss_scale", "epoch_skipped_steps", "epoch_loss"}
    assert tags <= set(steps)
    # Buffered and written in batches, but every step is there, once.
    every_step = list(range(1, trained_run.metrics["steps"] + 1))
    assert sorted(steps["batch_loss_scale"]) == sorted(steps["batch_skipped_steps"]) == every_step


def test_saved_model_file_reloads_with_its_per_layer_policies(trained_run):
    reloaded = keras.saving.load_model(trained_run.run_dir / "model.keras", compile=False)
    assert reloaded.get_layer("dense_1").compute_dtype == "float16"
    assert reloaded.get_layer("probabilities").compute_dtype == "float32"
    x = trained_run.datasets.val.x[:16]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(reloaded(x)),
                                  keras.ops.convert_to_numpy(trained_run.model(x)))


def _nan_after(clean_batches: int):
    """load_datasets whose training batches turn NaN after the first `clean_batches`."""
    real_load = data.load_datasets
    served = tf.Variable(0, dtype=tf.int64)

    class NaNAfter(data.Datasets):
        def train_dataset(self, batch_size, shuffle_buffer, seed, **kwargs):
            def poison(x, y):
                return tf.where(served.assign_add(1) > clean_batches, x * np.nan, x), y

            return super().train_dataset(batch_size, shuffle_buffer, seed, **kwargs).map(poison)

    def load(config, seed, **kwargs):
        rows = real_load(config, seed, **kwargs)
        return NaNAfter(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)})

    return load


@pytest.mark.parametrize("policy, kept_step, reason", [
    # Dynamic loss scaling skips the NaN steps: the weights stay good and are still checkpointed.
    ("mixed_float16", 6, "step 8 (epoch 1, batch 8 of 12): 3 consecutive steps with a non-finite loss or gradients"),
    # Without it the first NaN step is applied: training stops there, before its checkpoint.
    ("float32", 4, "step 6 (epoch 1, batch 6 of 12): the weights became non-finite"),
])
def test_nonfinite_guard_stops_with_one_message_and_keeps_the_last_good_checkpoint(
        policy, kept_step, reason, tiny_config_path, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "load_datasets", _nan_after(clean_batches=5))
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}", f"precision.policy={policy}",
                                         "train.max_nonfinite_steps=3", "train.checkpoint_every_steps=2"])
    with pytest.raises(TrainingError) as stopped:
        train(cfg)
    message = str(stopped.value)
    assert "\n" not in message
    assert f"training stopped at {reason}" in message
    assert "loss scale now" in message and "learning_rate" in message
    kept = checkpoints.latest_checkpoint(cfg.run_dir)
    assert kept.name == f"ckpt-{kept_step:09d}" and f"the last good checkpoint is kept: {kept}" in message
    assert not (cfg.run_dir / "metrics.json").exists() and not (cfg.run_dir / "model.keras").exists()
    precision.apply_policy(cfg.precision)
    rows = data.load_datasets(cfg.data, cfg.seed)
    model = models.build_model(cfg.model, rows.spec, rows.statistics)
    checkpoints.load_weights_into(model, cfg.run_dir)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_cli_exits_1_with_the_guard_message(tiny_config_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "load_datasets", _nan_after(clean_batches=2))
    code = cli.main(["train", str(tiny_config_path), "--set", f"train.runs_dir={tmp_path}",
                     "--set", "train.max_nonfinite_steps=2"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: training stopped at step 4 (epoch 1, batch 4 of 12): 2 consecutive steps")


def test_a_collapsing_loss_scale_stops_training(tiny_config_path, tmp_path, monkeypatch):
    # An initial scale of 4 reaches 0.5 after three skipped steps, well before 20 in a row.
    monkeypatch.setattr(data, "load_datasets", _nan_after(clean_batches=1))
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}", "precision.initial_scale=4"])
    with pytest.raises(TrainingError, match=r"step 4 .*the dynamic loss scale collapsed to 0.5 \(below 1\)"):
        train(cfg)


@pytest.mark.parametrize("override, message", [
    ("train.loop=scan", r"train\.loop: expected one of 'fit' or 'custom', got 'scan'"),
    ("train.gradient_accumulation_steps=0", r"train\.gradient_accumulation_steps: expected a positive integer, got 0"),
    ("train.checkpoint_every_steps=-1", r"train\.checkpoint_every_steps: expected a number >= 0, got -1"),
    ("train.jit_compile=maybe", r"train\.jit_compile"),
    ("train.distribution.strategy=tpu", r"train\.distribution\.strategy: expected one of 'default', 'mirrored' "
                                        r"or 'multi_worker', got 'tpu'"),
    ("train.distribution.stratgy=mirrored", r"train\.distribution\.stratgy: unknown key; did you mean 'strategy'\?"),
])
def test_bad_train_settings_are_one_line_each(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_settings_keras_cannot_combine_are_refused_before_any_work():
    with pytest.raises(ConfigError, match=r"train\.distribution: strategy 'multi_worker' needs train\.loop 'custom'"):
        load_config(None, ["train.distribution.strategy=multi_worker"])
    with pytest.raises(ConfigError, match=r"train\.distribution: strategy 'mirrored' cannot be combined with "
                                          r"train\.gradient_accumulation_steps 2"):
        load_config(None, ["train.distribution.strategy=mirrored", "train.gradient_accumulation_steps=2"])
    cfg = load_config(None, ["train.jit_compile=true", "train.loop=custom", "train.distribution.strategy=multi_worker"])
    assert (cfg.train.jit_compile, cfg.train.distribution.strategy) == (True, "multi_worker")


def test_weights_poisoned_under_a_finite_loss_stop_training_within_the_check_interval(tiny_config_path, tmp_path):
    # The weights are checked every guard.WEIGHTS_CHECK_EVERY steps (and before checkpoints), not after each one.
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}", "precision.policy=float32", "train.epochs=1",
                                         "train.batch_size=16", "train.checkpoint_every_steps=0"])
    policy = precision.apply_policy(cfg.precision)
    rows = data.load_datasets(cfg.data, cfg.seed)
    model = build_compiled_model(cfg, rows, policy)
    plan = loops.plan_for(cfg, rows)
    assert plan.steps_per_epoch > guard.WEIGHTS_CHECK_EVERY + 3  # the epoch end does not check first
    run = recorder.RunRecorder(cfg.run_dir, checkpoints.Checkpointer(cfg.run_dir, model, 1),
                               checkpoints.TrainingState(config=cfg.to_dict()), cfg.train, policy, plan.length)
    bias = next(v for v in model.trainable_variables if v.path.endswith("bias"))

    class Poison(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:  # after step 3; on CPU ReLU maps NaN to 0, so the loss can stay finite
                bias.assign(np.where(np.arange(bias.shape[0]) == 0, np.nan, keras.ops.convert_to_numpy(bias)))

    try:
        with pytest.raises(TrainingError, match=r"the weights became non-finite \(an update with inf/NaN gradients "
                                                r"was applied at step \d+ or later") as stopped:
            loops.run("fit", model, plan, [Poison(), run], 0, 0, tf.distribute.get_strategy())
    finally:
        run.close()
    assert 3 < run.state.global_step <= guard.WEIGHTS_CHECK_EVERY, str(stopped.value)


def test_training_refuses_to_start_under_onednn_frozen_weights(tiny_config_path, tmp_path, monkeypatch, capsys):
    """serving/frozen_weights.py: oneDNN would keep computing with packed copies of the weights training changes;
    the switch is the server's, so a training process that inherited it stops before any work, one line, exit 1."""
    monkeypatch.setenv("TF_ONEDNN_ASSUME_FROZEN_WEIGHTS", "true")
    code = cli.main(["train", str(tiny_config_path), "--set", f"train.runs_dir={tmp_path}"])
    assert code == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 is set: oneDNN would keep computing with")
    assert list(tmp_path.iterdir()) == []
