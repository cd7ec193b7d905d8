"""`python -m pipeline convert`: Parquet files → TFRecord shards that the tfrecord source reads back exactly, cut
at the shard size, published whole; a column that does not convert is one line naming the file and column."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf
import yaml

from pipeline import cli
from pipeline.config import validate_config
from pipeline.data import load_datasets
from pipeline.data.parquet import DATA_YAML
from pipeline.data.tfrecord import count_tfrecords


def table(ids: np.ndarray) -> pa.Table:
    """Every kind of column that converts, each derived from the row's id (so a row read back names itself)."""
    ids = np.asarray(ids)
    pixels = (ids[:, None] * 10 + np.arange(4)).astype(np.float32) / 8  # exact in float32
    grid = (ids[:, None] + np.arange(6)).astype(np.int16)
    return pa.table({
        "id": pa.array(ids, pa.int32()),
        "weight": pa.array(ids * 0.25 - 3.5, pa.float64()),
        "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 4),
        "window": pa.array([[int(i), int(i) + 1, int(i) + 2] for i in ids], pa.list_(pa.int64())),
        "grid": pa.array([[row[:3], row[3:]] for row in grid.tolist()], pa.list_(pa.list_(pa.int16(), 3), 2)),
        "label": pa.array(ids % 3, pa.int8()),
    })


def expected_row(i: int) -> list[float]:
    """The model's input for row i: the features flattened and concatenated in the Parquet columns' order."""
    return [i, i * 0.25 - 3.5, *((i * 10 + np.arange(4)) / 8), i, i + 1, i + 2, *(i + np.arange(6))]


def convert(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["convert", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_converted_rows_read_back_through_load_datasets_with_the_same_values(tmp_path, capsys):
    pq.write_table(table(np.arange(0, 300)), tmp_path / "rows-0.parquet", row_group_size=64)
    pq.write_table(table(np.arange(300, 420)), tmp_path / "rows-1.parquet", row_group_size=50)
    code, out, _ = convert(capsys, tmp_path / "rows-*.parquet", "--output", tmp_path / "shards")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed == yaml.safe_load((tmp_path / "shards" / DATA_YAML).read_text())
    assert printed["data"] == {
        "source": "tfrecord", "path": f"{tmp_path}/shards/part-*.tfrecord", "label": "label", "task": "classification",
        "feature_spec": {"id": {"dtype": "int64", "shape": []}, "weight": {"dtype": "float32", "shape": []},
                         "pixels": {"dtype": "float32", "shape": [4]}, "window": {"dtype": "int64", "shape": [3]},
                         "grid": {"dtype": "int64", "shape": [2, 3]}}}
    datasets = load_datasets(validate_config(printed).data, seed=0)
    x, y = (np.concatenate(parts) for parts in zip(datasets.train.rows(), datasets.val.rows()))
    order = np.argsort(x[:, 0])
    np.testing.assert_array_equal(x[order], np.asarray([expected_row(i) for i in range(420)], np.float32))
    np.testing.assert_array_equal(y[order], np.arange(420) % 3)


def test_int64_values_and_a_regression_label_survive_exactly(tmp_path, capsys):
    values = np.array([0, 1, 127, 128, 300, 2**40, -1, -(2**63), 2**63 - 1], np.int64)
    target = np.linspace(-2, 2, len(values))
    pairs = pa.array(np.stack([values, values[::-1]], axis=1).tolist())
    pq.write_table(pa.table({"big": values, "pair": pairs, "y": target}), tmp_path / "big.parquet")
    code, out, _ = convert(capsys, tmp_path / "big.parquet", "--output", tmp_path / "shards", "--label", "y")
    assert code == 0 and yaml.safe_load(out)["data"]["task"] == "regression"
    spec = {"big": tf.io.FixedLenFeature([], tf.int64), "pair": tf.io.FixedLenFeature([2], tf.int64),
            "y": tf.io.FixedLenFeature([], tf.float32)}
    records = tf.data.TFRecordDataset(str(tmp_path / "shards" / "part-00000.tfrecord")).batch(100)
    parsed = tf.io.parse_example(next(iter(records)), spec)
    np.testing.assert_array_equal(parsed["big"].numpy(), values)
    np.testing.assert_array_equal(parsed["pair"].numpy(), np.stack([values, values[::-1]], axis=1))
    np.testing.assert_array_equal(parsed["y"].numpy(), target.astype(np.float32))


def test_shards_are_cut_at_the_size(tmp_path, capsys):
    pq.write_table(table(np.arange(1000)), tmp_path / "rows.parquet", row_group_size=128)
    code, out, _ = convert(capsys, tmp_path / "rows.parquet", "--output", tmp_path / "shards", "--shard_mb", "0.02")
    assert code == 0
    shards = sorted((tmp_path / "shards").glob("part-*.tfrecord"))
    sizes = [shard.stat().st_size for shard in shards]
    record = max(sizes) / count_tfrecords(str(shards[0]), "test")  # every record here is about one size
    assert len(shards) >= 5 and all(20_000 - 2 * record < size <= 20_000 for size in sizes[:-1]) and sizes[-1] <= 20_000
    assert [shard.name for shard in shards] == [f"part-{i:05d}.tfrecord" for i in range(len(shards))]
    assert sum(count_tfrecords(str(shard), "test") for shard in shards) == 1000
    assert f"into {len(shards)} shards" in out


@pytest.mark.parametrize("column, statistics, message", [
    (pa.array([f"user-{i}" for i in range(20)]), True,
     r"bad\.parquet: column 'extra' is string: only integer, floating and fixed-length list columns of numbers "
     r"convert \(or leave it out: --drop extra\)$"),
    (pa.array([1.0] * 7 + [None] + [2.0] * 12), True,
     r"bad\.parquet: column 'extra' has 1 null value \(row group 0\); a tf\.Example feature needs a value in "
     r"every row"),
    (pa.array([1.0] * 7 + [None] + [2.0] * 12), False, r"bad\.parquet: column 'extra' row 7 holds a null; "),
    (pa.array([[1, 2]] * 9 + [[1, None]] + [[1, 2]] * 10), True,
     r"bad\.parquet: column 'extra' row 9 holds a null inside its list"),
    (pa.array([[1.5, 2.5]] * 11 + [[1.5]] + [[1.5, 2.5]] * 8), True,
     r"bad\.parquet: column 'extra' row 11: a list of 1 values where earlier rows hold 2; only lists of one "
     r"length convert"),
])
def test_a_column_that_does_not_convert_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, column, statistics,
                                                                                message):
    inputs = tmp_path / "in"
    inputs.mkdir()
    rows = pa.table({"x": np.arange(20.0), "extra": column, "label": np.arange(20) % 2})
    pq.write_table(rows, inputs / "bad.parquet", write_statistics=statistics)
    code, out, err = convert(capsys, inputs / "bad.parquet", "--output", tmp_path / "shards")
    assert code == cli.EXIT_BAD_INPUT and out == ""
    [line] = [text for text in err.splitlines() if text.startswith("error:")]  # other lines are the log's
    assert line.startswith(f"error: {inputs}/bad.parquet: column 'extra'") and re.search(message, line), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in"]  # no shards, no staging directory left


def test_dropped_columns_and_a_missing_label(tmp_path, capsys):
    pq.write_table(pa.table({"x": np.arange(20.0), "name": [str(i) for i in range(20)], "target": np.arange(20) % 2}),
                   tmp_path / "rows.parquet")
    code, _, err = convert(capsys, tmp_path / "rows.parquet", "--output", tmp_path / "shards", "--drop", "name")
    assert code == cli.EXIT_BAD_INPUT
    assert err.strip().endswith(f"error: --label: {tmp_path}/rows.parquet has no column 'label' (columns: x, target)")
    code, out, _ = convert(capsys, tmp_path / "rows.parquet", "--output", tmp_path / "shards", "--drop", "name",
                           "--label", "target")
    assert code == 0 and list(yaml.safe_load(out)["data"]["feature_spec"]) == ["x"]


def test_the_output_is_replaced_only_with_overwrite(tmp_path, capsys):
    pq.write_table(table(np.arange(50)), tmp_path / "rows.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-00000.tfrecord").write_text("the previous conversion")
    code, _, err = convert(capsys, tmp_path / "rows.parquet", "--output", shards)
    assert code == cli.EXIT_BAD_INPUT and "already exists; pass --overwrite to replace it" in err
    assert (shards / "part-00000.tfrecord").read_text() == "the previous conversion"
    code, _, _ = convert(capsys, tmp_path / "rows.parquet", "--output", shards, "--overwrite")
    assert code == 0 and count_tfrecords(str(shards / "part-00000.tfrecord"), "test") == 50
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rows.parquet", "shards"]
