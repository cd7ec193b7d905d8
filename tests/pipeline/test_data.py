"""Data sources (digits, diabetes, synthetic, npz, csv, tfrecord), the tf.data pipelines, and the
one-line DataError each kind of bad input gets before training starts."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from pipeline.config import load_config
from pipeline.data import DataError, load_datasets

REPO = Path(__file__).resolve().parents[2]


def load(*overrides, seed=0):
    return load_datasets(load_config(None, list(overrides)).data, seed=seed)


def test_digits_split_is_deterministic_disjoint_and_raw():
    cfg = load_config(None)
    a, b = load_datasets(cfg.data, seed=1), load_datasets(cfg.data, seed=1)
    np.testing.assert_array_equal(a.val_x, b.val_x)
    assert a.train_x.dtype == np.float32 and a.train_y.dtype == np.int64
    assert len(a.train_x) + len(a.val_x) == 1797
    assert len(a.val_x) == round(1797 * cfg.data.validation_split)
    assert a.train_x.max() == 16.0  # raw pixel counts: scaling lives in the model
    assert a.spec.input_shape == (64,) and a.spec.num_classes == 10 and a.spec.task == "classification"
    assert a.spec.image_shape == (8, 8, 1) and a.spec.num_outputs == 10
    train_rows = {row.tobytes() for row in a.train_x}
    assert sum(row.tobytes() in train_rows for row in a.val_x) < len(a.val_x) // 10  # digits has a few duplicate images
    other = load_datasets(cfg.data, seed=2)
    assert not np.array_equal(a.val_x, other.val_x)


def test_image_shape_feeds_rows_as_images_and_must_hold_the_same_values():
    ds = load("data.image_shape=[8, 8, 1]")
    assert ds.train_x.shape[1:] == (8, 8, 1) and ds.spec.input_shape == (8, 8, 1)
    with pytest.raises(DataError, match=r"data\.image_shape: \[8, 4, 1\] holds 32 values but the rows \(digits\) have 64"):
        load("data.image_shape=[8, 4, 1]")


def test_diabetes_is_an_embedded_regression_set():
    ds = load("data.source=diabetes")
    spec = ds.spec
    assert (spec.task, spec.num_classes, spec.num_outputs, spec.label_names, spec.input_shape) == (
        "regression", 0, 1, (), (10,))
    assert len(ds.train_x) + len(ds.val_x) == 442
    assert ds.train_y.dtype == np.float32 and ds.train_y.shape == (len(ds.train_x),)
    assert spec.target_mean == pytest.approx(ds.train_y.mean(), rel=1e-5) and spec.target_std > 10


def test_synthetic_rows_follow_the_config_and_the_seed():
    ds = load("data.source=synthetic", "data.num_examples=200", "data.feature_shape=[4, 4, 1]", "data.num_classes=3")
    assert ds.train_x.shape == (160, 16) and ds.spec.image_shape == (4, 4, 1) and ds.spec.num_classes == 3
    assert set(np.unique(ds.train_y)) == {0, 1, 2}
    again = load("data.source=synthetic", "data.num_examples=200", "data.feature_shape=[4, 4, 1]", "data.num_classes=3")
    np.testing.assert_array_equal(ds.train_x, again.train_x)
    regression = load("data.source=synthetic", "data.task=regression", "data.num_examples=100")
    assert regression.spec.task == "regression" and regression.train_y.dtype == np.float32
    # data.seed fixes the rows whatever the experiment seed (the split still follows the experiment seed)
    a = load("data.source=synthetic", "data.seed=7", seed=1)
    b = load("data.source=synthetic", "data.seed=7", seed=2)
    assert sorted(map(bytes, np.concatenate([a.train_x, a.val_x]))) == sorted(map(bytes, np.concatenate([b.train_x, b.val_x])))


def test_tf_data_pipelines_batch_shuffle_deterministically_and_cache(tmp_path):
    ds = load("data.source=synthetic", "data.num_examples=100", "data.cache=true")
    assert ds.cache
    first = [y.numpy() for _, y in ds.train_dataset(batch_size=16, shuffle_buffer=1000, seed=3)]
    again = [y.numpy() for _, y in ds.train_dataset(batch_size=16, shuffle_buffer=1000, seed=3)]
    assert [len(b) for b in first] == [16] * 5
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(np.concatenate(first), ds.train_y), "shuffled"
    assert sum(len(y) for _, y in ds.val_dataset(batch_size=7)) == 20


# npz


def write_npz(path, x_train, y_train, **more):
    np.savez(path, x_train=x_train, y_train=y_train, **more)
    return path


def test_npz_images_are_flattened_and_pooled(tmp_path):
    rng = np.random.default_rng(0)
    path = write_npz(tmp_path / "mini.npz", rng.integers(0, 255, (40, 4, 4), dtype=np.uint8), rng.integers(0, 3, 40),
                     x_test=rng.integers(0, 255, (10, 4, 4), dtype=np.uint8), y_test=rng.integers(0, 3, 10))
    ds = load("data.source=npz", f"data.path={path}")
    assert ds.train_x.shape[1:] == (16,) and len(ds.train_x) + len(ds.val_x) == 50
    assert ds.spec.num_classes == 3 and ds.spec.image_shape == (4, 4, 1)


def test_npz_validation_file_replaces_the_split(tmp_path):
    rng = np.random.default_rng(0)
    train = write_npz(tmp_path / "train.npz", rng.random((30, 6)), rng.integers(0, 2, 30))
    val = write_npz(tmp_path / "val.npz", rng.random((8, 6)), rng.integers(0, 2, 8))
    ds = load("data.source=npz", f"data.path={train}", f"data.validation_path={val}")
    assert (len(ds.train_x), len(ds.val_x)) == (30, 8)
    wrong = write_npz(tmp_path / "wrong.npz", rng.random((8, 5)), rng.integers(0, 2, 8))
    with pytest.raises(DataError, match=r"data\.validation_path: .*wrong\.npz: rows have shape \[5\] but the training rows .* have \[6\]"):
        load("data.source=npz", f"data.path={train}", f"data.validation_path={wrong}")


def test_missing_npz_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError, match=r"data\.path: .*mnist\.npz not found.*never downloads.*put the Keras-format file"):
        load("data.source=npz", f"data.path={tmp_path}/mnist.npz")


def test_npz_without_the_keras_keys_names_them(tmp_path):
    path = tmp_path / "odd.npz"
    np.savez(path, images=np.zeros((2, 2)))
    with pytest.raises(DataError, match=r"lacks x_train, y_train \(has images\)"):
        load("data.source=npz", f"data.path={path}")


@pytest.mark.parametrize("labels, overrides, message", [
    ([0, 1, -1, 0, 1, 0], [], r"bad\.npz: y_train\[2\]: label -1 is negative"),
    ([0, 1, 2, 0, 1, 0], ["data.num_classes=2"], r"bad\.npz: y_train\[2\]: label 2 is not below data\.num_classes 2"),
    ([0, 1, 0.5, 0, 1, 0], [], r"bad\.npz: y_train\[2\]: label 0\.5 is not an integer class id; use data\.task: regression"),
    ([0, 0, 0, 0, 0, 0], [], r"data\.path: .*bad\.npz: every label is 0; classification needs at least 2 classes"),
])
def test_npz_labels_must_be_class_ids(tmp_path, labels, overrides, message):
    path = write_npz(tmp_path / "bad.npz", np.zeros((6, 3)), np.array(labels))
    with pytest.raises(DataError, match=message) as info:
        load("data.source=npz", f"data.path={path}", *overrides)
    assert len(str(info.value).splitlines()) == 1


def test_npz_mismatched_rows_and_labels(tmp_path):
    path = write_npz(tmp_path / "short.npz", np.zeros((6, 3)), np.zeros(5, np.int64))
    with pytest.raises(DataError, match=r"short\.npz: x_train has 6 rows but y_train has shape \[5\]"):
        load("data.source=npz", f"data.path={path}")


# csv


def write_csv(path, text):
    path.write_text(text)
    return path


GOOD_CSV = "a,b,c,label\n1,2,3,0\n4,5,6,1\n7,8,9,2\n1,1,1,0\n2,2,2,1\n"


def test_csv_reads_named_columns_and_a_validation_file(tmp_path):
    train = write_csv(tmp_path / "train.csv", GOOD_CSV)
    val = write_csv(tmp_path / "val.csv", "label,c,a,b\n1,3,1,2\n")  # column order does not matter
    ds = load("data.source=csv", f"data.path={train}", f"data.validation_path={val}", "data.feature_columns=[c, a]")
    assert ds.train_x.shape == (5, 2) and ds.spec.num_classes == 3
    np.testing.assert_array_equal(ds.train_x[0], [3, 1])
    np.testing.assert_array_equal(ds.val_x, [[3, 1]])
    np.testing.assert_array_equal(ds.train_y, [0, 1, 2, 0, 1])
    named = load("data.source=csv", f"data.path={train}", "data.label_names=[cat, dog, fish]")
    assert named.spec.label_names == ("cat", "dog", "fish")


def test_csv_regression_targets(tmp_path):
    path = write_csv(tmp_path / "prices.csv", "size,price\n" + "".join(f"{i},{i * 2.5}\n" for i in range(10)))
    ds = load("data.source=csv", f"data.path={path}", "data.label=price", "data.task=regression")
    assert ds.spec.task == "regression" and ds.train_y.dtype == np.float32 and ds.train_x.shape[1:] == (1,)


@pytest.mark.parametrize("text, overrides, message", [
    (None, [], r"data\.path: .*missing\.csv not found"),
    ("1,2,3,0\n4,5,6,1\n", [], r"the first line is not a header"),
    ("a,b,c,target\n1,2,3,0\n", [], r"no label column 'label' \(data\.label\); the header has: a, b, c, target"),
    (GOOD_CSV, ["data.feature_columns=[a, d]"], r"no column 'd' \(data\.feature_columns\); the header has: a, b, c, label"),
    ("a,b,c,label\n1,2,3,0\n4,x,6,1\n", [], r"bad\.csv line 3, column 'b': non-numeric value 'x'"),
    ("a,b,c,label\n1,2,3,0\n4,,6,1\n", [], r"bad\.csv line 3, column 'b': non-numeric value ''"),
    ("a,b,c,label\n1,2,3,cat\n", [], r"bad\.csv line 2, column 'label': non-numeric value 'cat'"),
    ("a,b,c,label\n1,2,3,0\n4,5,6\n", [], r"bad\.csv line 3: 3 fields, but the header has 4"),
    ("a,b,c,label\n1,2,3,0\n4,5,6,-1\n", [], r"bad\.csv line 3, column 'label': label -1 is negative"),
    ("a,b,c,label\n1,2,3,0\n4,5,6,10\n", ["data.num_classes=10"], r"bad\.csv line 3, column 'label': label 10 is not below data\.num_classes 10"),
    ("a,b,c,label\n1,2,3,0\n4,5,nan,1\n", [], r"bad\.csv line 3, column 'c': 'nan' is not a finite number"),
    ("a,b,c,label\n", [], r"bad\.csv: no data rows after the header"),
    ("", [], r"bad\.csv is empty; expected a header row"),
    (GOOD_CSV, ["data.label_names=[x, y]"], r"data\.label_names: 2 names, but the labels have 3 classes"),
])
def test_bad_csv_gets_one_line_naming_file_and_column(tmp_path, text, overrides, message):
    path = tmp_path / ("missing.csv" if text is None else "bad.csv")
    if text is not None:
        write_csv(path, text)
    with pytest.raises(DataError, match=message) as info:
        load("data.source=csv", f"data.path={path}", *overrides)
    assert len(str(info.value).splitlines()) == 1


# tfrecord


def example(**features) -> bytes:
    feature = {}
    for name, value in features.items():
        value = np.ravel(value)
        if value.dtype.kind == "f":
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=value))
        elif value.dtype.kind in "iu":
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=value))
        else:
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode() for v in value]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_tfrecord(path, records):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def good_records(n, start=0):
    rng = np.random.default_rng(start)
    return [example(pixels=rng.random(4).astype(np.float32), age=np.array([float(i)]), label=np.array([i % 3]))
            for i in range(start, start + n)]


SPEC = "data.feature_spec={pixels: {shape: [4]}, age: {}}"


def test_tfrecord_parses_the_feature_spec_across_shards(tmp_path):
    write_tfrecord(tmp_path / "train-0.tfrecord", good_records(12))
    write_tfrecord(tmp_path / "train-1.tfrecord", good_records(8, start=12))
    val = write_tfrecord(tmp_path / "val.tfrecord", good_records(5, start=100))
    ds = load("data.source=tfrecord", f"data.path={tmp_path}/train-*.tfrecord", f"data.validation_path={val}", SPEC)
    assert ds.train_x.shape == (20, 5) and ds.val_x.shape == (5, 5)  # pixels (4) then age (1)
    np.testing.assert_array_equal(ds.train_x[:, 4], np.arange(20))
    np.testing.assert_array_equal(ds.train_y, np.arange(20) % 3)
    assert ds.spec.num_classes == 3


@pytest.mark.parametrize("records, overrides, message", [
    (None, [], r"data\.path: .*nothing-\*\.tfrecord not found \(no file matches\)"),
    ([example(pixels=np.ones(4, np.float32), label=np.array([0]))], [],
     r"bad\.tfrecord record 0: no feature 'age' \(has label, pixels\)"),
    (good_records(2) + [example(pixels=np.ones(3, np.float32), age=np.array([1.0]), label=np.array([0]))], [],
     r"bad\.tfrecord record 2, feature 'pixels': holds float_list of 3 values; expected float_list of 4 values \(shape \[4\]\)"),
    ([example(pixels=np.ones(4, np.int64), age=np.array([1.0]), label=np.array([0]))], [],
     r"record 0, feature 'pixels': holds int64_list of 4 values; expected float_list"),
    ([example(pixels=np.ones(4, np.float32), age=np.array([1.0]), label=np.array([0.5]))], [],
     r"record 0, feature 'label': holds float_list of 1 value; expected int64_list .*data\.task: regression"),
    ([example(pixels=np.ones(4, np.float32), age=np.array([1.0]), label=np.array(["cat"]))], [],
     r"record 0, feature 'label': holds bytes_list of 1 value; expected int64_list"),
    (good_records(3) + [example(pixels=np.ones(4, np.float32), age=np.array([1.0]), label=np.array([-2]))], [],
     r"bad\.tfrecord record 3, feature 'label': label -2 is negative"),
    (good_records(6), ["data.num_classes=2"], r"bad\.tfrecord record 2, feature 'label': label 2 is not below data\.num_classes 2"),
    (good_records(2) + [example(pixels=np.array([1, np.nan, 1, 1], np.float32), age=np.array([1.0]), label=np.array([0]))],
     [], r"bad\.tfrecord record 2, feature 'pixels': a value is NaN or infinite"),
    ([b"not an example"], [], r"bad\.tfrecord record 0: not a serialized tf\.train\.Example"),
])
def test_bad_tfrecord_gets_one_line_naming_file_and_feature(tmp_path, records, overrides, message):
    path = f"{tmp_path}/nothing-*.tfrecord" if records is None else write_tfrecord(tmp_path / "bad.tfrecord", records)
    with pytest.raises(DataError, match=message) as info:
        load("data.source=tfrecord", f"data.path={path}", SPEC, *overrides)
    assert len(str(info.value).splitlines()) == 1


def test_a_file_that_is_not_a_tfrecord(tmp_path):
    path = tmp_path / "junk.tfrecord"
    path.write_bytes(b"this is a text file, not TFRecord framing")
    with pytest.raises(DataError, match=r"junk\.tfrecord is not an uncompressed TFRecord file \(or is damaged\): "
                                        r"the header of record 0 \(byte 0\) fails its checksum$"):
        load("data.source=tfrecord", f"data.path={path}", SPEC)


def transaction_records(n, seed=0):
    """A user's transactions as tf.Examples: 16 merchant ids and 16 amounts per row (issue 23)."""
    rng = np.random.default_rng(seed)
    return [example(merchant=rng.integers(0, 50, 16), amount=rng.lognormal(9.5, 1.6, 16).astype(np.float32),
                    label=np.array([i % 2])) for i in range(n)]


TRANSACTIONS_SPEC = "data.feature_spec={merchant: {dtype: int64, shape: [16]}, amount: {shape: [16]}}"


@pytest.mark.parametrize("cut, message", [
    (lambda data: data[:len(data) // 2 + 40], r"half\.tfrecord is truncated: 30 complete records, then 40 bytes "
                                              r"where record 30 needs \d+; copy the file again$"),
    (lambda data: data[:5], r"half\.tfrecord is truncated: 0 complete records, then 5 bytes where a record header "
                            r"needs 12; copy the file again$"),
    (lambda data: b"", r"half\.tfrecord is empty \(0 bytes\): no records$"),
])
def test_a_truncated_or_empty_tfrecord_is_one_line_with_the_records_it_holds(tmp_path, cut, message):
    # TensorFlow reads a file cut inside a record as the records before the cut, without a word (issue 23:
    # a half-copied file trained on 30 of 60 records).
    full = write_tfrecord(tmp_path / "full.tfrecord", transaction_records(60))
    assert len(full.read_bytes()) % 60 == 0  # equal records: half the bytes is exactly 30 of them
    (tmp_path / "half.tfrecord").write_bytes(cut(full.read_bytes()))
    with pytest.raises(DataError, match=message) as info:
        load("data.source=tfrecord", f"data.path={tmp_path / 'half.tfrecord'}", TRANSACTIONS_SPEC)
    assert len(str(info.value).splitlines()) == 1
    assert load("data.source=tfrecord", f"data.path={full}", TRANSACTIONS_SPEC).train_x.shape == (48, 32)


def test_the_records_read_from_each_file_are_logged(tmp_path, caplog):
    write_tfrecord(tmp_path / "a.tfrecord", transaction_records(60))
    write_tfrecord(tmp_path / "b.tfrecord", transaction_records(30, seed=1))
    with caplog.at_level("INFO", logger="pipeline.data"):
        load("data.source=tfrecord", f"data.path={tmp_path}/*.tfrecord", TRANSACTIONS_SPEC)
    assert "data.path: 90 records from 2 files (a.tfrecord: 60, b.tfrecord: 30)" in caplog.messages


@pytest.mark.parametrize("write, message", [
    (lambda path: np.savez(path, x_train=np.zeros((0, 32)), y_train=np.zeros(0)),
     r"x\.npz: x_train holds 0 rows \(shape \[0, 32\]\); expected at least one example$"),
    (lambda path: path.write_bytes(_npz_bytes()[:len(_npz_bytes()) // 2]),
     r"x\.npz is not a readable \.npz file \(truncated, or not a NumPy archive\): File is not a zip file$"),
    (lambda path: path.write_bytes(b""),
     r"x\.npz is not a readable \.npz file \(truncated, or not a NumPy archive\): "),
])
def test_an_empty_or_truncated_npz_is_one_line(tmp_path, write, message):
    write(tmp_path / "x.npz")
    with pytest.raises(DataError, match=message) as info:
        load("data.source=npz", f"data.path={tmp_path / 'x.npz'}")
    assert len(str(info.value).splitlines()) == 1


def _npz_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    rng = np.random.default_rng(0)
    np.savez(buffer, x_train=rng.lognormal(9.5, 1.6, (100, 32)), y_train=rng.integers(0, 2, 100))
    return buffer.getvalue()


@pytest.mark.parametrize("name, content", [("empty.tfrecord", b""), ("cut.tfrecord", None), ("empty.csv", b"")])
def test_cli_a_damaged_data_file_is_exit_2_and_nothing_written(tmp_path, capsys, name, content):
    from pipeline.cli import main

    path = tmp_path / name
    if content is None:
        full = write_tfrecord(tmp_path / "full.tfrecord", transaction_records(20)).read_bytes()
        content = full[:len(full) - 7]
    path.write_bytes(content)
    source = ["--set", "data.source=csv"] if name.endswith(".csv") else ["--set", "data.source=tfrecord", "--set",
                                                                          TRANSACTIONS_SPEC]
    code = main(["train", str(REPO / "configs/default.yaml"), *source, "--set", f"data.path={path}",
                 "--set", f"train.runs_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: data.path: {path}")
    assert not (tmp_path / "runs").exists()


def test_cli_maps_a_data_error_to_exit_2_before_anything_is_written(tmp_path, capsys):
    from pipeline.cli import main

    bad = write_csv(tmp_path / "bad.csv", "a,label\n1,0\n2,7\n")
    code = main(["train", str(REPO / "configs/default.yaml"), "--set", "data.source=csv", "--set", f"data.path={bad}",
                 "--set", "data.num_classes=3", "--set", f"train.runs_dir={tmp_path / 'runs'}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: data.path: {bad} line 3, column 'label': label 7 is not below data.num_classes 3"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("raw, message", [
    ({"source": "csv"}, r"data\.path: required when data\.source is 'csv'"),
    ({"source": "tfrecord", "path": "x.tfrecord"}, r"data\.feature_spec: required when data\.source is 'tfrecord'"),
    ({"source": "synthetic", "validation_path": "v.csv"}, r"data\.validation_path: not used by data\.source 'synthetic'"),
    ({"source": "diabetes", "task": "classification"}, r"data\.task: data\.source 'diabetes' is a regression dataset"),
    ({"source": "synthetic", "task": "regression", "num_classes": 3}, r"data\.num_classes: only for classification"),
    ({"source": "synthetic", "num_classes": 3, "label_names": ["a", "b"]}, r"data\.label_names: 2 names for data\.num_classes 3"),
    ({"source": "csv", "path": "x.csv", "feature_columns": ["a", "label"]}, r"data\.feature_columns: includes the label column 'label'"),
    ({"source": "tfrecord", "path": "x", "feature_spec": {"a": {"dtype": "string"}}},
     r"data\.feature_spec\.a\.dtype: expected one of 'float32' or 'int64', got 'string'"),
    ({"image_shape": [8, 8]}, r"data\.image_shape: expected \[height, width, channels\], got \[8, 8\]"),
    ({"num_classes": 1}, r"data\.num_classes: expected a number >= 2, got 1"),
])
def test_data_settings_that_do_not_fit_are_config_errors(raw, message):
    from pipeline.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message) as info:
        validate_config({"data": raw})
    assert len(str(info.value).splitlines()) == 1


def test_task_and_synthetic_classes_are_resolved_in_the_config():
    assert load_config(None, ["data.source=diabetes"]).data.task == "regression"
    synthetic = load_config(None, ["data.source=synthetic"]).data
    assert (synthetic.task, synthetic.num_classes) == ("classification", 2)
