"""A run's length: train.steps_per_epoch and train.max_steps over one stream of passes (pipeline/train/length.py)."""

import shutil

import numpy as np
import pytest

from pipeline import data
from pipeline.config import load_config
from pipeline.train import checkpoints, loops, train
from pipeline.train.length import RunLength, describe, run_length

# The tiny config: 12 batches per pass (tests/conftest.py).
SHORT_EPOCHS = ["train.steps_per_epoch=5", "train.max_steps=17", "train.learning_rate_schedule=cosine",
                "train.checkpoint_every_steps=4", "train.keep_checkpoints=20"]


def test_an_epoch_is_one_pass_unless_steps_per_epoch_says_otherwise(tiny_config):
    default = run_length(tiny_config.train, tiny_config.train.batch_size * 16 - 3)  # the last batch short
    assert default == RunLength(pass_steps=16, steps_per_epoch=16, total_steps=16 * tiny_config.train.epochs)
    assert [default.position(epoch, 0) for epoch in range(3)] == [(0, 0), (1, 0), (2, 0)]

    cut = run_length(load_config(None, ["train.steps_per_epoch=5", "train.max_steps=17"]).train, 12 * 64)
    assert (cut.pass_steps, cut.epochs, cut.passes) == (12, 4, 17 / 12)
    assert [cut.steps_in_epoch(e) for e in range(5)] == [5, 5, 5, 2, 0]
    assert cut.position(2, 3) == (1, 1)  # batch 13 of the stream: the second batch of the second pass
    assert describe(cut, 64) == "17 steps (4 epochs of 5, the last of 2, batch 64; 1.42 passes over the training rows)"
    # max_steps replaces epochs whatever train.epochs says
    assert run_length(load_config(None, ["train.epochs=1", "train.max_steps=30"]).train, 64).total_steps == 30


@pytest.mark.parametrize("start_epoch, start_step, spans", [
    (0, 0, [(0, 3, 0, 5), (3, 4, 0, 2)]),  # three whole epochs, then the one max_steps cuts short
    (1, 3, [(1, 2, 3, 2), (2, 3, 0, 5), (3, 4, 0, 2)]),  # resumed mid-epoch: that epoch's rest first
    (3, 1, [(3, 4, 1, 1)]),  # resumed inside the short last epoch
])
def test_fit_trains_each_run_of_equal_epochs_in_one_call(start_epoch, start_step, spans):
    assert loops.fit_spans(RunLength(12, 5, 17), start_epoch, start_step) == spans


def _stream(plan: loops.Plan, epoch: int, step: int) -> np.ndarray:
    return np.concatenate([x for x, _ in plan.train_batches(epoch, step).as_numpy_iterator()])


def test_epochs_read_on_through_passes_each_shuffled_by_its_own_seed(tiny_config_path):
    cfg = load_config(tiny_config_path, SHORT_EPOCHS)
    datasets = data.load_datasets(cfg.data, cfg.seed)
    plan = loops.plan_for(cfg, datasets)
    passes = [np.concatenate([x for x, _ in datasets.train_dataset(cfg.train.batch_size, cfg.data.shuffle_buffer,
                                                                   seed=cfg.seed * loops._PASS_SEEDS + p)
                              .as_numpy_iterator()]) for p in (0, 1)]
    assert not np.array_equal(passes[0], passes[1])
    rows = 17 * cfg.train.batch_size - (12 * cfg.train.batch_size - datasets.train_examples)  # pass 0's last is short
    whole = _stream(plan, 0, 0)
    np.testing.assert_array_equal(whole, np.concatenate(passes)[:rows])
    # a resume at (epoch 1, batch 3) and at (epoch 3, batch 1) reads on from batch 8 and 16 of the same stream
    np.testing.assert_array_equal(_stream(plan, 1, 3), whole[8 * cfg.train.batch_size:])
    np.testing.assert_array_equal(_stream(plan, 3, 1), np.concatenate(passes)[datasets.train_examples
                                                                              + 4 * cfg.train.batch_size:rows])
    assert len(list(plan.val_batches())) > 2
    assert len(list(loops.plan_for(load_config(tiny_config_path, ["train.validation_steps=2"]), datasets)
                    .val_batches())) == 2


def test_max_steps_ends_the_run_and_a_resume_anywhere_gives_the_same_weights(tiny_config_path, tmp_path):
    straight = train(load_config(tiny_config_path, [f"train.runs_dir={tmp_path / 'straight'}", *SHORT_EPOCHS,
                                                    "train.validation_steps=2"]))
    assert (straight.metrics["steps"], straight.metrics["epochs"]) == (17, 4)
    assert int(straight.model.optimizer.iterations.numpy()) == 17
    assert [entry["epoch"] for entry in _history(straight.run_dir)] == [1, 2, 3, 4]
    for kill_after in (8, 16):  # mid-epoch in the first pass; inside the short last epoch, in the second pass
        runs = tmp_path / f"killed-{kill_after}"
        shutil.copytree(tmp_path / "straight", runs)
        cfg = load_config(tiny_config_path, [f"train.runs_dir={runs}", *SHORT_EPOCHS, "train.validation_steps=2"])
        listed = checkpoints.list_checkpoints(cfg.run_dir)
        for later in listed[listed.index(cfg.run_dir / "checkpoints" / f"ckpt-{kill_after:09d}") + 1:]:
            shutil.rmtree(later)
        for marker in ("metrics.json", "model.keras"):
            (cfg.run_dir / marker).unlink()
        resumed = train(cfg)
        assert resumed.metrics["weights_sha1"] == straight.metrics["weights_sha1"], kill_after
        assert resumed.metrics["val_loss"] == straight.metrics["val_loss"], kill_after


def _history(run_dir):
    import json

    return json.loads((run_dir / "history.json").read_text())
