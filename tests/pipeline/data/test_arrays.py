"""The sources held in memory (digits, diabetes, synthetic, npz): their rows, split, tf.data pipelines, and the
one-line DataError each kind of bad input gets before training starts."""

import numpy as np
import pytest

from data_files import load
from pipeline.config import load_config
from pipeline.data import DataError, load_datasets


def test_digits_split_is_deterministic_disjoint_and_raw():
    cfg = load_config(None)
    a, b = load_datasets(cfg.data, seed=1), load_datasets(cfg.data, seed=1)
    np.testing.assert_array_equal(a.val.x, b.val.x)
    assert a.train.x.dtype == np.float32 and a.train.y.dtype == np.int64
    assert len(a.train.x) + len(a.val.x) == 1797
    assert len(a.val.x) == round(1797 * cfg.data.validation_split)
    assert a.train.x.max() == 16.0  # raw pixel counts: scaling lives in the model
    assert a.spec.input_shape == (64,) and a.spec.num_classes == 10 and a.spec.task == "classification"
    assert a.spec.image_shape == (8, 8, 1) and a.spec.num_outputs == 10
    train_rows = {row.tobytes() for row in a.train.x}
    assert sum(row.tobytes() in train_rows for row in a.val.x) < len(a.val.x) // 10  # digits has a few duplicate images
    other = load_datasets(cfg.data, seed=2)
    assert not np.array_equal(a.val.x, other.val.x)


def test_image_shape_feeds_rows_as_images_and_must_hold_the_same_values():
    ds = load("data.image_shape=[8, 8, 1]")
    assert ds.train.x.shape[1:] == (8, 8, 1) and ds.spec.input_shape == (8, 8, 1)
    with pytest.raises(DataError, match=r"data\.image_shape: \[8, 4, 1\] holds 32 values but the rows \(digits\) have 64"):
        load("data.image_shape=[8, 4, 1]")


def test_diabetes_is_an_embedded_regression_set():
    ds = load("data.source=diabetes")
    spec = ds.spec
    assert (spec.task, spec.num_classes, spec.num_outputs, spec.label_names, spec.input_shape) == (
        "regression", 0, 1, (), (10,))
    assert len(ds.train.x) + len(ds.val.x) == 442
    assert ds.train.y.dtype == np.float32 and ds.train.y.shape == (len(ds.train.x),)
    assert spec.target_mean == pytest.approx(ds.train.y.mean(), rel=1e-5) and spec.target_std > 10


def test_synthetic_rows_follow_the_config_and_the_seed():
    ds = load("data.source=synthetic", "data.num_examples=200", "data.feature_shape=[4, 4, 1]", "data.num_classes=3")
    assert ds.train.x.shape == (160, 16) and ds.spec.image_shape == (4, 4, 1) and ds.spec.num_classes == 3
    assert set(np.unique(ds.train.y)) == {0, 1, 2}
    again = load("data.source=synthetic", "data.num_examples=200", "data.feature_shape=[4, 4, 1]", "data.num_classes=3")
    np.testing.assert_array_equal(ds.train.x, again.train.x)
    regression = load("data.source=synthetic", "data.task=regression", "data.num_examples=100")
    assert regression.spec.task == "regression" and regression.train.y.dtype == np.float32
    # data.seed fixes the rows whatever the experiment seed (the split still follows the experiment seed)
    a = load("data.source=synthetic", "data.seed=7", seed=1)
    b = load("data.source=synthetic", "data.seed=7", seed=2)
    assert sorted(map(bytes, np.concatenate([a.train.x, a.val.x]))) == sorted(map(bytes, np.concatenate([b.train.x, b.val.x])))


def test_tf_data_pipelines_batch_shuffle_deterministically_and_cache(tmp_path):
    ds = load("data.source=synthetic", "data.num_examples=100", "data.cache=true")
    assert ds.train.cache and ds.val.cache
    first = [y.numpy() for _, y in ds.train_dataset(batch_size=16, shuffle_buffer=1000, seed=3)]
    again = [y.numpy() for _, y in ds.train_dataset(batch_size=16, shuffle_buffer=1000, seed=3)]
    assert [len(b) for b in first] == [16] * 5
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(np.concatenate(first), ds.train.y), "shuffled"
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
    assert ds.train.x.shape[1:] == (16,) and len(ds.train.x) + len(ds.val.x) == 50
    assert ds.spec.num_classes == 3 and ds.spec.image_shape == (4, 4, 1)


def test_npz_validation_file_replaces_the_split(tmp_path):
    rng = np.random.default_rng(0)
    train = write_npz(tmp_path / "train.npz", rng.random((30, 6)), rng.integers(0, 2, 30))
    val = write_npz(tmp_path / "val.npz", rng.random((8, 6)), rng.integers(0, 2, 8))
    ds = load("data.source=npz", f"data.path={train}", f"data.validation_path={val}")
    assert (len(ds.train.x), len(ds.val.x)) == (30, 8)
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


@pytest.mark.parametrize("write, message", [
    (lambda path: np.savez(path, x_train=np.zeros((0, 32)), y_train=np.zeros(0)),
     r"x\.npz: x_train holds 0 rows \(shape \[0, 32\]\); expected at least one example$"),
    (lambda path: path.write_bytes(_npz_bytes()[:len(_npz_bytes()) // 2]),
     r"x\.npz is not a readable \.npz file \(truncated, or not a NumPy archive\): File is not a zip file$"),
    (lambda path: path.write_bytes(b""), r"x\.npz is empty, not a NumPy \.npz archive$"),
    (lambda path: path.write_text("hello\n"),
     r"x\.npz is not a NumPy \.npz archive \(a zip of \.npy arrays\): it starts with b'hell'$"),
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


def test_bad_rows_are_left_out_and_counted_under_max_bad_records(tmp_path):
    labels = np.array([0, 1, -1, 0, 1, 0, 1, 0, 1, 0])
    path = write_npz(tmp_path / "bad.npz", np.arange(30.0).reshape(10, 3), labels)
    ds = load("data.source=npz", f"data.path={path}", "data.max_bad_records=1")
    assert ds.train_examples + ds.val_examples == 9
    [bad] = ds.statistics.bad_records
    assert bad == {"where": f"data.path: {path}: y_train[2]", "reason": "label -1 is negative; class ids are 0, 1, ..."}
    assert 6.0 not in np.concatenate([ds.train.x, ds.val.x])[:, 0]  # row 2 (6, 7, 8) is out
    labels[5] = 7
    write_npz(path, np.arange(30.0).reshape(10, 3), labels)
    with pytest.raises(DataError, match=r"^more than data\.max_bad_records 1 bad records \(2 found\); the first: "
                                        r"data\.path: .*bad\.npz: y_train\[2\]: label -1 is negative"):
        load("data.source=npz", f"data.path={path}", "data.max_bad_records=1", "data.num_classes=2")
