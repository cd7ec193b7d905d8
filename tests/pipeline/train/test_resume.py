"""Crash-safe checkpoints: SIGKILL a real training process, resume it, get the uninterrupted run back;
refuse incompatible resumes; --fresh; checkpoints that load across precision policies."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from pipeline import cli, models, precision
from pipeline.train import checkpoints
from pipeline.config import load_config
from pipeline.train import TrainingError, build_compiled_model, train
from pipeline.train.history import TIMING_KEYS

REPO_ROOT = Path(__file__).resolve().parents[3]


def _wait_for_mid_epoch_checkpoint(run_dir, process, step: int, timeout_s: float = 240.0) -> None:
    """Polls until checkpoint `step` is published (an atomic rename: it is complete once visible)."""
    wanted = run_dir / checkpoints.CHECKPOINTS_DIR / f"ckpt-{step:09d}"
    deadline = time.monotonic() + timeout_s
    while not wanted.is_dir():
        assert process.poll() is None, f"training ended (rc {process.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout_s} s"
        time.sleep(0.01)


def _without_timing(history: list[dict]) -> list[dict]:
    """Epoch timings differ between runs; everything else must not."""
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


@pytest.mark.subprocess  # trains in a child process and SIGKILLs it
def test_a_sigkilled_run_resumes_and_finishes_like_an_uninterrupted_one(trained_run, tiny_config_path, tmp_path, caplog):
    # trained_run is the uninterrupted run of the same config; checkpoint_every_steps does not change results.
    overrides = [f"train.runs_dir={tmp_path}", "train.checkpoint_every_steps=4"]
    cfg = load_config(tiny_config_path, overrides)
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "train", str(tiny_config_path), *(f"--set={o}" for o in overrides)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_mid_epoch_checkpoint(cfg.run_dir, process, step=16)  # 12 batches/epoch: epoch 2, batch 4
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        stderr = process.communicate(timeout=60)[1]
    assert process.returncode == -signal.SIGKILL, stderr[-2000:]
    assert not (cfg.run_dir / "metrics.json").exists()
    killed_at = checkpoints.read_state(checkpoints.latest_checkpoint(cfg.run_dir))
    assert killed_at.global_step < 36, "killed before the last epoch ended"

    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        resumed = train(cfg)  # what `make train` runs again
    assert f"resuming from {cfg.run_dir / 'checkpoints'}" in caplog.text
    # Same weights bit for bit (CPU), same metrics, and the same history, the interrupted epoch included.
    assert resumed.metrics["weights_sha1"] == trained_run.metrics["weights_sha1"]
    assert resumed.metrics["val_accuracy"] == trained_run.metrics["val_accuracy"]
    assert resumed.metrics["val_loss"] == trained_run.metrics["val_loss"]
    history = json.loads((cfg.run_dir / "history.json").read_text())
    assert _without_timing(history) == _without_timing(json.loads((trained_run.run_dir / "history.json").read_text()))
    assert all(h["seconds"] > 0 and h["examples_per_second"] > 0 for h in history)
    assert not list(cfg.run_dir.rglob(".tmp-*"))


@pytest.mark.subprocess  # trains in a child process and SIGKILLs it
def test_a_run_killed_in_the_middle_of_an_accumulated_update_resumes_to_the_same_weights(tiny_config_path, tmp_path):
    """Three batches per update under dynamic loss scaling, killed after batch 16 (one batch into an update): the
    checkpoint holds that batch's unscaled gradients, so the resumed run applies the same updates."""
    overrides = ["train.gradient_accumulation_steps=3", "train.checkpoint_every_steps=4",
                 "train.learning_rate_schedule=cosine", "train.warmup_steps=2", "train.global_clipnorm=1.0"]
    straight = train(load_config(tiny_config_path, [f"train.runs_dir={tmp_path / 'straight'}", *overrides]))
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path / 'killed'}", *overrides])
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "train", str(tiny_config_path),
         *(f"--set={o}" for o in [f"train.runs_dir={tmp_path / 'killed'}", *overrides])],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_mid_epoch_checkpoint(cfg.run_dir, process, step=16)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        stderr = process.communicate(timeout=60)[1]
    assert process.returncode == -signal.SIGKILL, stderr[-2000:]
    for later in checkpoints.list_checkpoints(cfg.run_dir)[checkpoints.list_checkpoints(cfg.run_dir).index(
            cfg.run_dir / "checkpoints" / "ckpt-000000016") + 1:]:
        shutil.rmtree(later)  # as if the kill had come right after step 16, one batch into an update
    assert not (cfg.run_dir / "metrics.json").exists()
    resumed = train(cfg)
    assert resumed.metrics["weights_sha1"] == straight.metrics["weights_sha1"]
    assert int(resumed.model.optimizer.iterations.numpy()) == 36 // 3


def test_resume_refuses_a_checkpoint_from_other_settings_and_fresh_starts_over(trained_run, tiny_config_path, caplog):
    changed = load_config(tiny_config_path, ["model.hidden_units=[8]"])
    assert changed.run_dir == trained_run.run_dir
    with pytest.raises(TrainingError, match=r"was trained with different model settings; resuming needs the same "
                                            r"ones; train a new run beside it \(--set experiment=NEW_NAME\), or "
                                            r"delete it and start over \(--fresh"):
        train(changed)
    assert (trained_run.run_dir / "metrics.json").is_file(), "a refused resume leaves the finished run alone"
    assert cli._parser().parse_args(["train", "x.yaml", "--fresh"]).fresh


def test_fresh_discards_the_runs_checkpoints_and_outputs(tiny_config_path, tmp_path, caplog):
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}", "train.epochs=1"])
    train(cfg)
    (cfg.run_dir / "logs" / "stale").write_text("x")
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        again = train(cfg, fresh=True)
    assert "--fresh: cleared" in caplog.text and "resuming" not in caplog.text
    assert any(r.name == "pipeline.train.run" and r.getMessage().startswith("precision: ")
               for r in caplog.records), "the start of a run says what this machine computes natively"
    assert not (cfg.run_dir / "logs" / "stale").exists()
    assert [p.name for p in checkpoints.list_checkpoints(cfg.run_dir)] == ["ckpt-000000012"]
    assert again.metrics["steps"] == 12


def test_fresh_refuses_a_run_directory_that_resolves_outside_runs_dir(tiny_config_path, tmp_path):
    outside = tmp_path / "elsewhere"
    (outside / "logs").mkdir(parents=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "exp").symlink_to(outside)
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path / 'runs'}", "experiment=exp", "train.epochs=1"])
    with pytest.raises(TrainingError, match=r"--fresh: refusing to clear .*exp: it resolves to .*elsewhere, which is "
                                            r"not inside train\.runs_dir"):
        train(cfg, fresh=True)
    assert sorted(p.name for p in outside.iterdir()) == ["logs"]


def _save_state(checkpointer, step: int, epoch: int) -> None:
    checkpointer.save(checkpoints.TrainingState(global_step=step, epoch=epoch))


def test_a_second_checkpoint_of_the_same_step_replaces_the_first_only_once_it_is_complete(trained_run, tmp_path,
                                                                                             monkeypatch):
    checkpointer = checkpoints.Checkpointer(tmp_path, trained_run.model, keep=1)
    _save_state(checkpointer, step=7, epoch=0)
    real_rename = os.rename

    def failing_rename(src, dst):  # the new checkpoint cannot take the name (e.g. the disk is full)
        if Path(src).name.startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="No space left"):
        _save_state(checkpointer, step=7, epoch=1)
    monkeypatch.undo()
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["ckpt-000000007"]
    assert checkpoints.read_state(checkpoints.latest_checkpoint(tmp_path)).epoch == 0, "the old one is kept"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt-000000007"]

    _save_state(checkpointer, step=7, epoch=1)
    assert checkpoints.read_state(checkpoints.latest_checkpoint(tmp_path)).epoch == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt-000000007"]


def test_a_checkpoint_moved_aside_by_a_killed_process_is_put_back_before_resuming(trained_run, tmp_path):
    # What a SIGKILL between publish_dir's two renames leaves (tests/pipeline/test_artifacts.py kills a real
    # process there): the old checkpoint moved aside, the complete new one still a temporary.
    checkpointer = checkpoints.Checkpointer(tmp_path, trained_run.model, keep=1)
    _save_state(checkpointer, step=7, epoch=0)
    directory, dead = tmp_path / "checkpoints", int(Path("/proc/sys/kernel/pid_max").read_text())  # no pid is
    staged = checkpointer.write(checkpoints.TrainingState(global_step=7, epoch=1))
    staged.tmp.rename(directory / f".tmp-{dead}-ckpt-000000007-x")
    (directory / "ckpt-000000007").rename(directory / f".replaced-{dead}-ckpt-000000007")
    assert checkpoints.latest_checkpoint(tmp_path) is None

    checkpoints.Checkpointer(tmp_path, trained_run.model, keep=1)  # what a resumed run opens first
    assert checkpoints.read_state(checkpoints.latest_checkpoint(tmp_path)).epoch == 0
    assert sorted(p.name for p in directory.iterdir()) == ["ckpt-000000007"]


def _model_under(policy_name: str, trained_run):
    """A model of the trained run's architecture built under another policy."""
    cfg = load_config(None, [f"precision.policy={policy_name}", "model.hidden_units=[32,16]"])
    precision.apply_policy(cfg.precision)
    return models.build_model(cfg.model, trained_run.datasets.spec, trained_run.datasets.statistics)


def test_a_mixed_float16_checkpoint_loads_into_a_float32_model(trained_run):
    model = _model_under("float32", trained_run)
    assert model.get_layer("dense_1").compute_dtype == "float32"
    loaded = checkpoints.load_weights_into(model, trained_run.run_dir)
    assert loaded == checkpoints.latest_checkpoint(trained_run.run_dir)
    for ours, theirs in zip(model.get_weights(), trained_run.model.get_weights()):
        np.testing.assert_array_equal(ours, theirs)  # variables are float32 under both policies
    x = trained_run.datasets.val.x
    float32 = keras.ops.convert_to_numpy(model(x))
    mixed = keras.ops.convert_to_numpy(trained_run.model(x))
    np.testing.assert_allclose(float32, mixed, atol=5e-3)  # float16 rounding only
    assert (float32.argmax(1) == mixed.argmax(1)).mean() > 0.98


def test_a_float32_checkpoint_loads_into_a_mixed_float16_model(trained_run, tmp_path):
    cfg = load_config(None, ["precision.policy=float32", "model.hidden_units=[32,16]"])
    policy = precision.apply_policy(cfg.precision)
    rows = trained_run.datasets
    float32_model = build_compiled_model(cfg, rows, policy)
    float32_model.set_weights(trained_run.model.get_weights())
    checkpoints.Checkpointer(tmp_path, float32_model, keep=1).save(checkpoints.TrainingState(global_step=7))

    model = _model_under("mixed_float16", trained_run)
    assert model.get_layer("dense_1").compute_dtype == "float16"
    assert checkpoints.load_weights_into(model, tmp_path).name == "ckpt-000000007"
    for ours, theirs in zip(model.get_weights(), float32_model.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    probabilities = keras.ops.convert_to_numpy(model(rows.val.x))
    assert probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities, keras.ops.convert_to_numpy(float32_model(rows.val.x)), atol=5e-3)


def test_load_weights_into_names_what_is_missing(tmp_path, trained_run):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoints.load_weights_into(_model_under("float32", trained_run), tmp_path)
