"""The statistics pass: float64 numbers equal to numpy's on the same rows, the build's sample rows, and the
statistics recorded in a run directory and reused while the files are unchanged."""

import os

import numpy as np
import pytest

from data_files import ID_SPEC, id_shards, load, write_tfrecord, example
from pipeline.data import statistics
from pipeline.data.statistics import Accumulator, of_rows


def test_streamed_statistics_equal_numpys_on_the_same_rows(tmp_path):
    rng = np.random.default_rng(0)
    rows = (rng.lognormal(3, 2, (3000, 6)) * np.array([1, 10, 100, 1e3, 1e4, 1e5])).astype(np.float32)
    for shard in range(5):  # read by parallel threads, merged in the shards' order
        part = rows[shard * 600:(shard + 1) * 600]
        write_tfrecord(tmp_path / f"t-{shard}.tfrecord",
                       [example(x=row, label=np.array([int(row[0]) % 4])) for row in part])
    ds = load("data.source=tfrecord", f"data.path={tmp_path}/t-*.tfrecord", "data.feature_spec={x: {shape: [6]}}",
              "data.parallel_reads=3")
    train_x, train_y = ds.train.rows()
    stats = ds.statistics
    assert stats.rows == len(train_x) and stats.rows + stats.validation_rows == 3000
    exact = train_x.astype(np.float64)
    np.testing.assert_allclose(stats.mean, exact.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats.variance, exact.var(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(stats.minimum, exact.min(axis=0))
    np.testing.assert_array_equal(stats.maximum, exact.max(axis=0))
    assert list(stats.class_counts) == np.bincount(train_y).tolist()
    assert stats.rows_per_file == {str(tmp_path / f"t-{s}.tfrecord"): 600 for s in range(5)}


def test_per_channel_standardisation_pools_the_positions_of_each_channel():
    images = np.random.default_rng(1).random((50, 4, 4, 3)) * np.array([1.0, 50.0, 2000.0])
    mean, variance, largest = of_rows(images).standardization(channels=3)
    flat = images.reshape(-1, 3)
    np.testing.assert_allclose(mean, flat.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(variance, flat.var(axis=0), rtol=1e-9)
    np.testing.assert_allclose(largest, np.abs(flat).max(axis=0))


def test_merged_accumulators_give_the_numbers_of_one_pass():
    rows = np.random.default_rng(2).normal(1e4, 3.0, (1000, 5))  # a large mean: a naive sum of squares loses it
    one = Accumulator((5,), "regression")
    one.add(rows, rows[:, 0])
    merged = Accumulator((5,), "regression")
    for part in np.array_split(np.arange(1000), 7):
        piece = Accumulator((5,), "regression")
        piece.add(rows[part], rows[part, 0])
        merged.merge(piece)
    a, b = one.result(), merged.result()
    np.testing.assert_allclose(b.variance, rows.var(axis=0), rtol=1e-9)
    np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12)
    assert b.target_mean == pytest.approx(rows[:, 0].mean(), rel=1e-12)
    assert b.target_std == pytest.approx(rows[:, 0].std(), rel=1e-9)


def test_the_sample_holds_the_first_rows_and_each_features_extreme_row():
    rows = np.zeros((10000, 3), np.float32)
    rows[:, 0] = 1.0
    rows[7000, 1], rows[9000, 2] = 5e6, -3e5  # beyond the first SAMPLE_ROWS rows
    stats = of_rows(rows)
    assert len(stats.sample_x) == statistics.SAMPLE_ROWS + 2
    assert {5e6, -3e5} <= set(stats.sample_x[statistics.SAMPLE_ROWS:].ravel().tolist())


def test_token_rows_widen_as_longer_sequences_arrive():
    accumulator = Accumulator((None,), "classification")
    accumulator.add(np.array([[3.0, 4.0], [5.0, 0.0]]), np.array([0, 1]))
    accumulator.add(np.array([[1.0, 2.0, 7.0]]), np.array([1]))
    stats = accumulator.result()
    padded = np.array([[3, 4, 0], [5, 0, 0], [1, 2, 7]], np.float64)
    np.testing.assert_allclose(stats.mean, padded.mean(axis=0))
    np.testing.assert_allclose(stats.variance, padded.var(axis=0))
    np.testing.assert_array_equal(stats.sample_x, padded)


def test_recorded_statistics_are_reused_until_a_file_changes(tmp_path, caplog):
    pattern = id_shards(tmp_path, shards=2, rows_per_shard=50)
    first = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    statistics.save(first.statistics, tmp_path / "run-data")
    with caplog.at_level("INFO", logger="pipeline.data"):
        again = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC, recorded=tmp_path / "run-data")
    assert any("computed before; the files are unchanged" in message for message in caplog.messages)
    np.testing.assert_array_equal(again.statistics.mean, first.statistics.mean)
    np.testing.assert_array_equal(again.sample_x, first.sample_x)
    assert again.statistics.rows_per_file == first.statistics.rows_per_file
    shard = tmp_path / "train-00001.tfrecord"
    write_tfrecord(shard, [example(x=np.full(8, 9.0, np.float32), label=np.array([1]))] * 10)
    os.utime(shard, ns=(1, 1))
    changed = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC, recorded=tmp_path / "run-data")
    assert changed.statistics.rows + changed.statistics.validation_rows == 60  # counted anew
    assert load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC, seed=1,
                recorded=tmp_path / "run-data").statistics.fingerprint != first.statistics.fingerprint


def test_a_declared_sample_decodes_the_first_files_and_counts_the_others(tmp_path):
    pattern = id_shards(tmp_path, shards=6, rows_per_shard=100)
    whole = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    sampled = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC, "data.statistics_rows=150",
                   "data.num_classes=2")
    assert (sampled.train_examples, sampled.val_examples) == (whole.train_examples, whole.val_examples)
    assert sampled.statistics.rows_per_file == whole.statistics.rows_per_file
    stats = sampled.statistics
    assert 150 <= stats.value_rows < 300 and stats.value_rows == sum(stats.class_counts)  # two files of ~80 rows
    first_rows = np.concatenate([ds.train.rows()[0] for ds in [load(
        "data.source=tfrecord", f"data.path={tmp_path}/train-0000{i}.tfrecord", ID_SPEC, "data.validation_split=0.2")
        for i in range(2)]]).astype(np.float64)
    np.testing.assert_allclose(stats.mean, first_rows.mean(axis=0), rtol=1e-6)
    assert stats.maximum[0] == first_rows[:, 0].max() < whole.statistics.maximum[0]  # ids beyond: not decoded
    seen = sorted(int(i) for x, _ in sampled.train_dataset(32, 100, seed=1) for i in x.numpy()[:, 0])
    assert seen == sorted(whole.train.rows()[0][:, 0].astype(int).tolist())  # training reads every file
