"""Input-bound is visible: each epoch's share of step time spent waiting for batches, in history.json and
TensorBoard, and a log line with the knob to turn when it is large."""

import json
import time

import pytest
import tensorflow as tf

from pipeline import data
from pipeline.config import load_config
from pipeline.train import train

pytestmark = pytest.mark.timeout(300)


def _slow_input(monkeypatch, seconds_per_batch: float) -> None:
    """load_datasets whose training batches each take seconds_per_batch to make (a test-only py_function)."""
    real_load = data.load_datasets

    class Slow(data.Datasets):
        def train_dataset(self, *args, **kwargs):
            def wait(x):
                time.sleep(seconds_per_batch)
                return x

            return super().train_dataset(*args, **kwargs).map(
                lambda x, y: (tf.ensure_shape(tf.py_function(wait, [x], tf.float32), x.shape), y))

    def load(config, seed, **kwargs):
        rows = real_load(config, seed, **kwargs)
        return Slow(rows.spec, rows.statistics, rows.train, rows.val)

    monkeypatch.setattr(data, "load_datasets", load)


def test_an_input_bound_epoch_is_measured_and_says_which_knob_to_turn(monkeypatch, tmp_path, caplog):
    _slow_input(monkeypatch, 0.1)
    cfg = load_config(None, [f"train.runs_dir={tmp_path}", "train.epochs=2", "model.hidden_units=[8]",
                             "train.batch_size=128"])
    with caplog.at_level("WARNING", logger="pipeline.train.recorder"):
        train(cfg)
    history = json.loads((cfg.run_dir / "history.json").read_text())
    assert all(entry["input_wait"] > 0 for entry in history)
    # A tiny model waits for 100 ms batches. The first epoch also traces the step, which a loaded machine stretches
    # (0.15 of it waiting beside another test process, 0.5-0.7 alone), so the steady state is judged.
    assert history[-1]["input_wait"] > 0.3
    [line, *_] = [m for m in caplog.messages if "is input-bound" in m]
    assert "data.cache: true" in line and "docs/data.md#input-bound" in line


def test_a_fast_input_is_not_input_bound(tmp_path, caplog):
    cfg = load_config(None, [f"train.runs_dir={tmp_path}", "train.epochs=2", "model.hidden_units=[256, 256]",
                             "train.batch_size=256", "data.cache=true"])
    with caplog.at_level("WARNING", logger="pipeline.train.recorder"):
        train(cfg)
    history = json.loads((cfg.run_dir / "history.json").read_text())
    assert 0 <= history[-1]["input_wait"] < 0.5  # in-memory batches, prefetched: the steps rarely wait
