"""The small sources, held in memory as arrays: digits and diabetes (scikit-learn, embedded), synthetic (generated
from a seed), pointer (the generated sequence task of sequences.py) and npz (a Keras-format file such as
mnist.npz). They split by a seeded permutation, as they always have; the files that do not fit in memory are
streamed instead (shards.py).
"""

from __future__ import annotations

import dataclasses
import math
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline.data import sequences
from pipeline.config import DataConfig
from pipeline.errors import DataError


@dataclasses.dataclass
class Rows:
    """One source's rows before checks: features in their natural shape, raw labels."""

    x: np.ndarray
    y: np.ndarray
    where: Callable[[int, str | None], str]  # (row index, column) -> "data.path: mnist.npz: y_train[7]"
    name: str  # "data.path: mnist.npz", "digits"
    image_shape: tuple[int, ...] | None = None  # the natural image shape of a row, if it has one


class ArraySource:
    """One split's rows in memory: tf.data pipelines over them, and the rows themselves."""

    def __init__(self, x: np.ndarray, y: np.ndarray, cache: bool = False) -> None:
        self.x, self.y, self.cache = x, y, cache
        self._rows: tf.data.Dataset | None = None

    def _dataset_of_rows(self) -> tf.data.Dataset:
        """The rows as one dataset, made once: each epoch's pipeline (built inside the training loop's flat_map)
        captures it, instead of capturing the arrays, which made them constants of every epoch's graph (60,000
        rows of 784 values: 20 s and 4 GB more before the first step)."""
        if self._rows is None:
            with tf.init_scope():  # eagerly, even when first asked for inside a traced function
                self._rows = tf.data.Dataset.from_tensor_slices((self.x, self.y))
                if self.cache:
                    self._rows = self._rows.cache()
        return self._rows

    def __len__(self) -> int:
        return len(self.x)

    def dataset(self, batch_size: int, shuffle_buffer: int | None = None, seed=None, *,
                input_context: tf.distribute.InputContext | None = None, skip: int = 0,
                drop_remainder: bool = False) -> tf.data.Dataset:
        """Batches; shuffled from seed when one is given (training); input_context: this worker's share of the
        rows; skip: rows to leave out at the start (a resumed epoch)."""
        ds = self._dataset_of_rows()
        if input_context and input_context.num_input_pipelines > 1:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if seed is not None:
            ds = ds.shuffle(min(shuffle_buffer, max(len(self.x), 1)), seed=seed, reshuffle_each_iteration=True)
        if skip:
            ds = ds.skip(skip)
        return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)

    def rows(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        return (self.x, self.y) if limit is None else (self.x[:limit], self.y[:limit])


def read(config: DataConfig, path: str | None, key: str, seed: int) -> Rows:
    if config.source == "digits":
        return _read_digits()
    if config.source == "diabetes":
        return _read_diabetes()
    if config.source == "synthetic":
        return _make_synthetic(config, seed if config.seed is None else config.seed)
    if config.source == "pointer":
        x, y = sequences.pointer_task(config.num_examples, config.sequence_length,
                                      seed if config.seed is None else config.seed)
        return Rows(x, y, lambda i, column=None: f"pointer row {i}", "pointer")
    return _read_npz(path, key)


def split(x: np.ndarray, y: np.ndarray, share: float, seed: int, name: str) -> tuple[np.ndarray, ...]:
    """(train_x, train_y, val_x, val_y): a seeded permutation's first round(n * share) rows are validation."""
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = max(1, int(round(len(order) * share)))
    if n_val >= len(order):
        raise DataError(f"{name}: {len(order)} rows are too few to hold out data.validation_split {share:g} and "
                        "still train")
    val_rows, train_rows = order[:n_val], order[n_val:]
    return x[train_rows], y[train_rows], x[val_rows], y[val_rows]


def pad_sequences(parts: list[Rows], config: DataConfig, vocab_size: int) -> None:
    """Token sequences: every part's rows checked and padded, in place, to data.sequence_length (default: the
    longest sequence of any part), as float32 ids."""
    ragged = [[sequences.without_trailing_padding(row) for row in part.x] for part in parts]
    length = config.sequence_length or max(max((len(row) for row in rows), default=1) for rows in ragged)
    for part, rows in zip(parts, ragged):
        part.x = sequences.pad(rows, length, vocab_size, lambda i, p=part: p.where(i, None), part.name)
        part.image_shape = None


def _read_digits() -> Rows:
    from sklearn.datasets import load_digits  # ships inside scikit-learn: no download

    digits = load_digits()
    return Rows(digits.data, digits.target, lambda i, column=None: f"digits row {i}", "digits", image_shape=(8, 8, 1))


def _read_diabetes() -> Rows:
    """scikit-learn's diabetes regression set: 442 patients, 10 features, disease progression after a year."""
    from sklearn.datasets import load_diabetes  # ships inside scikit-learn: no download

    diabetes = load_diabetes()
    return Rows(diabetes.data, diabetes.target, lambda i, column=None: f"diabetes row {i}", "diabetes")


def _make_synthetic(config: DataConfig, seed: int) -> Rows:
    """Learnable random rows: Gaussian clusters around one centre per class, or a noisy linear target."""
    rng = np.random.default_rng(seed)
    n, width = config.num_examples, math.prod(config.feature_shape)
    if config.task == "classification":
        centres = rng.normal(0.0, 1.0, (config.num_classes, width))
        y = rng.integers(0, config.num_classes, n)
        x = centres[y] + rng.normal(0.0, 1.0, (n, width))
    else:
        x = rng.normal(0.0, 1.0, (n, width))
        y = x @ (rng.normal(0.0, 1.0, width) / math.sqrt(width)) + rng.normal(0.0, 0.1, n)
    shape = tuple(config.feature_shape)
    image_shape = shape if len(shape) == 3 else (*shape, 1) if len(shape) == 2 else None
    return Rows(x.reshape(n, *shape), y, lambda i, column=None: f"synthetic row {i}", "synthetic", image_shape=image_shape)


def _read_npz(path: str, key: str) -> Rows:
    """A Keras-format image dataset (mnist.npz, fashion-mnist): x_train/y_train/x_test/y_test.

    Train and test rows are pooled; the validation split is taken from them like any other source.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"{key}: {file} not found. This pipeline never downloads data: put the Keras-format file "
            f"(e.g. mnist.npz with x_train, y_train, x_test, y_test) at {file}, or point to it with --set {key}=...")
    not_npz = not_an_npz(file)
    if not_npz:
        raise DataError(f"{key}: {file} {not_npz}")
    try:
        with np.load(file) as npz:
            missing = [k for k in ("x_train", "y_train") if k not in npz.files]
            if missing:
                raise DataError(f"{key}: {file} lacks {', '.join(missing)} (has {', '.join(npz.files)}); "
                                "expected a Keras-format file with x_train, y_train[, x_test, y_test]")
            pairs = [("x_train", "y_train")] + ([("x_test", "y_test")] if {"x_test", "y_test"} <= set(npz.files) else [])
            arrays = {name: npz[name] for pair in pairs for name in pair}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a truncated archive: BadZipFile or EOFError
        raise DataError(f"{key}: {file} is not a readable .npz file (truncated, or not a NumPy archive): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if len(arrays["x_train"]) == 0:
        raise DataError(f"{key}: {file}: x_train holds 0 rows (shape {list(arrays['x_train'].shape)}); "
                        "expected at least one example")
    for x_key, y_key in pairs:
        x, y = arrays[x_key], arrays[y_key].reshape(len(arrays[y_key]), -1)
        if len(x) != len(y) or y.shape[1] != 1:
            raise DataError(f"{key}: {file}: {x_key} has {len(x)} rows but {y_key} has shape {list(arrays[y_key].shape)}; "
                            "expected one label per row")
        if x.dtype.kind not in "iuf" or y.dtype.kind not in "iuf":
            raise DataError(f"{key}: {file}: {x_key} and {y_key} must be numeric, got {x.dtype} and {y.dtype}")
        if x.shape[1:] != arrays["x_train"].shape[1:]:
            raise DataError(f"{key}: {file}: {x_key} rows have shape {list(x.shape[1:])} but x_train rows have "
                            f"{list(arrays['x_train'].shape[1:])}")
    n_train = len(arrays["x_train"])

    def where(i: int, column: str | None = None) -> str:
        x_or_y = "y" if column == "label" else "x"
        return f"{key}: {file}: {x_or_y}_train[{i}]" if i < n_train else f"{key}: {file}: {x_or_y}_test[{i - n_train}]"

    x = np.concatenate([arrays[x_key] for x_key, _ in pairs])
    y = np.concatenate([arrays[y_key].reshape(-1) for _, y_key in pairs])
    shape = x.shape[1:]
    image_shape = shape if len(shape) == 3 else (*shape, 1) if len(shape) == 2 else None
    return Rows(x, y, where, f"{key}: {file}", image_shape=image_shape)


ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip file's first bytes (an empty archive: its end record)


def not_an_npz(path: str | Path) -> str | None:
    """What is wrong when path is not a NumPy .npz archive (a zip of .npy arrays), judged by its first bytes, or
    None. Checked before np.load, whose error for a text file advises allow_pickle, which does not apply."""
    with open(path, "rb") as file:
        head = file.read(4)
    if not head:
        return "is empty, not a NumPy .npz archive"
    if head not in ZIP_MAGIC:
        return f"is not a NumPy .npz archive (a zip of .npy arrays): it starts with {head!r}"
    return None
