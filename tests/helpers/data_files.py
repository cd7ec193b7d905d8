"""Writers of the files users train from (csv, TFRecord shards, image folders), and load() for a config's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline.config import load_config
from pipeline.data import load_datasets

REPO = Path(__file__).resolve().parents[2]
SPEC = "data.feature_spec={pixels: {shape: [4]}, age: {}}"
TRANSACTIONS_SPEC = "data.feature_spec={merchant: {dtype: int64, shape: [16]}, amount: {shape: [16]}}"


def load(*overrides, seed=0, recorded=None):
    return load_datasets(load_config(None, list(overrides)).data, seed=seed, recorded=recorded)


def all_rows(source) -> tuple[np.ndarray, np.ndarray]:
    """Every row of a split, in its stored order."""
    return source.rows()


def write_csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


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


def write_tfrecord(path: Path, records) -> Path:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def good_records(n, start=0):
    """pixels (4 floats), age (= the row's id) and label (id % 3)."""
    rng = np.random.default_rng(start)
    return [example(pixels=rng.random(4).astype(np.float32), age=np.array([float(i)]), label=np.array([i % 3]))
            for i in range(start, start + n)]


def transaction_records(n, seed=0):
    """A user's transactions as tf.Examples: 16 merchant ids and 16 amounts per row (issue 23)."""
    rng = np.random.default_rng(seed)
    return [example(merchant=rng.integers(0, 50, 16), amount=rng.lognormal(9.5, 1.6, 16).astype(np.float32),
                    label=np.array([i % 2])) for i in range(n)]


def id_shards(directory: Path, shards: int, rows_per_shard: int, width: int = 8) -> str:
    """TFRecord shards whose rows carry their own id (feature 'id', and x[0] == id): which rows a reader saw."""
    rng = np.random.default_rng(0)
    for s in range(shards):
        write_tfrecord(directory / f"train-{s:05d}.tfrecord",
                       [example(x=np.concatenate([[float(i)], rng.random(width - 1)]).astype(np.float32),
                                label=np.array([i % 2]))
                        for i in range(s * rows_per_shard, (s + 1) * rows_per_shard)])
    return str(directory / "train-*.tfrecord")


ID_SPEC = "data.feature_spec={x: {shape: [8]}}"


def digits_as_images(folder: Path, extension: str = "png", per_class: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as 8x8 greyscale image files in one folder per class ('0' .. '9'), the way a user's
    photos arrive; returns the pixels written (uint8, [n, 8, 8, 1]) and their labels, in file order."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
    written, labels = [], []
    for label in range(10):
        rows = np.flatnonzero(digits.target == label)[:per_class]
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        for i in rows:
            encode = tf.io.encode_png if extension == "png" else lambda image: tf.io.encode_jpeg(image, quality=95)
            (folder / str(label) / f"{i:04d}.{extension}").write_bytes(encode(pixels[i]).numpy())
            written.append(pixels[i])
            labels.append(label)
    return np.asarray(written), np.asarray(labels)
