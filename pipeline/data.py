"""Loads an experiment's rows into tf.data pipelines, from the source the config names.

Sources: digits and diabetes (scikit-learn, embedded), synthetic (generated from a seed), pointer (the
generated sequence task of sequences.py), npz (Keras-format image files), csv (a header row naming the
columns) and tfrecord (tf.Example files read through a feature spec). With data.vocab_size the rows
of npz, csv and tfrecord are token-id sequences instead of features (sequences.py pads and checks them). Every source is read and checked completely before training starts:
a missing file, a missing column or feature, a shape that does not fit, or a label that is not a
valid class id is a one-line DataError naming the file and the column or feature.

Features stay raw (preprocessing lives inside the model, so serving takes the same raw rows).
The split is deterministic given the seed, so every command of a run sees the same validation rows.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import fnmatch
import logging
import math
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline import sequences
from pipeline.config import DataConfig
from pipeline.errors import DataError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What the model is trained on and serves: the input, the task and the meaning of the labels."""

    input_name: str
    input_shape: tuple[int, ...]  # one row, without the batch dimension
    num_classes: int  # classification: the number of classes; regression: 0
    label_names: tuple[str, ...]  # classification: one name per class id; regression: ()
    task: str = "classification"  # or "regression"
    image_shape: tuple[int, ...] | None = None  # the rows as [height, width, channels] images, when they are images
    target_mean: float = 0.0  # regression: mean and standard deviation of the training targets
    target_std: float = 1.0
    vocab_size: int | None = None  # token sequences: the rows are float32 ids 0..vocab_size-1 (0: padding)
    categorical: tuple[int, ...] = ()  # positions in a flat row of category ids (data.categorical_columns)
    feature_names: tuple[str, ...] = ()  # one per position in a flat row, where the source names them (csv, tfrecord)

    @property
    def tokens(self) -> bool:
        return self.vocab_size is not None

    def feature_name(self, position: int) -> str:
        """'merchant_3' (csv), 'amount[2]' (tfrecord), or 'feature 7'."""
        return self.feature_names[position] if position < len(self.feature_names) else f"feature {position}"

    @property
    def num_outputs(self) -> int:
        """The width of the model's output: one score per class, or one regression target."""
        return self.num_classes if self.task == "classification" else 1


@dataclasses.dataclass(frozen=True)
class Datasets:
    train_x: np.ndarray  # float32 [n, *spec.input_shape]
    train_y: np.ndarray  # classification: int64 class ids; regression: float32 targets
    val_x: np.ndarray
    val_y: np.ndarray
    spec: DataSpec
    cache: bool = False  # data.cache

    def train_dataset(self, batch_size: int, shuffle_buffer: int, seed: int) -> tf.data.Dataset:
        """Shuffled (deterministically from seed, reshuffled each epoch), batched, prefetched."""
        ds = self._rows(self.train_x, self.train_y)
        ds = ds.shuffle(min(shuffle_buffer, len(self.train_x)), seed=seed, reshuffle_each_iteration=True)
        return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)

    def val_dataset(self, batch_size: int) -> tf.data.Dataset:
        return self._rows(self.val_x, self.val_y).batch(batch_size).prefetch(tf.data.AUTOTUNE)

    def _rows(self, x: np.ndarray, y: np.ndarray) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.cache() if self.cache else ds


@dataclasses.dataclass
class _Rows:
    """One file's (or embedded set's) rows before checks: features in their natural shape, raw labels."""

    x: np.ndarray  # token sequences from csv or tfrecord: an object array of 1-D id arrays of any length
    y: np.ndarray
    where: Callable[[int], str]  # row index -> "data.path: data/train.csv line 7, column 'label'"
    name: str  # "data.path: data/train.csv", "digits"
    image_shape: tuple[int, ...] | None = None  # the natural image shape of a row, if it has one
    feature_names: tuple[str, ...] = ()  # one per value of a flattened row, where the source names them
    row: Callable[[int], str] | None = None  # row index -> "data.path: data/train.csv line 7"


def load_datasets(config: DataConfig, seed: int) -> Datasets:
    """Reads and checks the configured source, then splits off (or reads) the validation rows.

    Raises:
        DataError: one line naming the file and the column or feature that is wrong.
    """
    train = _read(config, config.path, "data.path", seed)
    val = _read(config, config.validation_path, "data.validation_path", seed) if config.validation_path else None
    vocab_size = _vocab_size(config)
    if vocab_size is not None:
        _pad_sequences([train] + ([val] if val is not None else []), config, vocab_size)
    if val is not None and val.x.shape[1:] != train.x.shape[1:]:
        raise DataError(f"data.validation_path: {config.validation_path}: rows have shape {list(val.x.shape[1:])} "
                        f"but the training rows ({config.path}) have {list(train.x.shape[1:])}")
    parts = [train] + ([val] if val is not None else [])
    if config.task == "classification":
        num_classes = _check_class_ids(parts, config)
        label_names = tuple(config.label_names or (str(i) for i in range(num_classes)))
        ys = [part.y.astype(np.int64) for part in parts]
    else:
        num_classes, label_names = 0, ()
        for part in parts:
            _check_finite(part.y, part.where)
        ys = [part.y.astype(np.float32).reshape(len(part.y)) for part in parts]

    image_shape = tuple(config.image_shape) if config.image_shape else train.image_shape
    image_shape = None if vocab_size is not None else image_shape
    input_shape = tuple(config.image_shape) if config.image_shape else (math.prod(train.x.shape[1:]),)
    if math.prod(input_shape) != math.prod(train.x.shape[1:]):
        raise DataError(f"data.image_shape: {list(input_shape)} holds {math.prod(input_shape)} values but the rows "
                        f"({train.name}) have {math.prod(train.x.shape[1:])} "
                        f"(shape {list(train.x.shape[1:])})")
    categorical = _categorical_positions(config, train, math.prod(input_shape))
    for part in parts:
        _check_category_ids(part, categorical, config)
    xs = [part.x.reshape(len(part.x), *input_shape).astype(np.float32) for part in parts]

    if val is not None:
        (train_x, val_x), (train_y, val_y) = xs, ys
    else:
        order = np.random.default_rng(seed).permutation(len(xs[0]))
        n_val = max(1, int(round(len(order) * config.validation_split)))
        if n_val >= len(order):
            raise DataError(f"{train.name}: {len(order)} rows are too few to hold out "
                            f"data.validation_split {config.validation_split:g} and still train")
        val_rows, train_rows = order[:n_val], order[n_val:]
        train_x, val_x, train_y, val_y = xs[0][train_rows], xs[0][val_rows], ys[0][train_rows], ys[0][val_rows]
    spec = DataSpec(
        input_name=config.input_name,
        input_shape=input_shape,
        num_classes=num_classes,
        label_names=label_names,
        task=config.task,
        image_shape=image_shape,
        vocab_size=vocab_size,
        categorical=categorical,
        feature_names=train.feature_names,
        **(_target_stats(train_y) if config.task == "regression" else {}),
    )
    return Datasets(train_x, train_y, val_x, val_y, spec, cache=config.cache)


def _vocab_size(config: DataConfig) -> int | None:
    if config.source == "pointer":
        return sequences.pointer_vocab_size(config.sequence_length)
    return config.vocab_size


def _pad_sequences(parts: list[_Rows], config: DataConfig, vocab_size: int) -> None:
    """Token sequences: every part's rows checked and padded, in place, to data.sequence_length (default: the
    longest sequence of any part), as float32 ids."""
    ragged = [[row if part.x.dtype == object else sequences.without_trailing_padding(row) for row in part.x]
              for part in parts]
    length = config.sequence_length or max(max((len(row) for row in rows), default=1) for rows in ragged)
    for part, rows in zip(parts, ragged):
        part.x = sequences.pad(rows, length, vocab_size, part.where, part.name)
        part.image_shape = None


def _categorical_positions(config: DataConfig, train: _Rows, width: int) -> tuple[int, ...]:
    """The flat-row positions data.categorical_columns names: csv columns and tfrecord features by name or
    pattern ('merchant_*'; a tfrecord feature with several values names all of them), else by position."""
    positions: list[int] = []
    for column in config.categorical_columns:
        if isinstance(column, int):
            if column >= width:
                raise DataError(f"data.categorical_columns: position {column} is outside the rows of {train.name}, "
                                f"which have {width} features (positions 0..{width - 1})")
            found = [column]
        else:
            found = [i for i, name in enumerate(train.feature_names)
                     if fnmatch.fnmatchcase(name, column) or fnmatch.fnmatchcase(name.partition("[")[0], column)]
        if not found:
            known = list(dict.fromkeys(name.partition("[")[0] for name in train.feature_names))
            raise DataError(f"data.categorical_columns: {column!r} names no feature of {train.name}; its features are: "
                            f"{', '.join(known)}")
        positions += found
    return tuple(sorted(set(positions)))


def _check_category_ids(part: _Rows, categorical: tuple[int, ...], config: DataConfig) -> None:
    """A category column holds ids: integers >= 0 (an Embedding indexes by them)."""
    if not categorical:
        return
    values = part.x.reshape(len(part.x), -1)[:, categorical]
    bad = (values != np.round(values)) | (values < 0)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        row = part.row(i) if part.row else f"{part.name} row {i}"
        column = part.feature_names[categorical[j]] if part.feature_names else f"position {categorical[j]}"
        raise DataError(f"{row}, column {column!r}: {_value(values[i, j])} is not a category id (an integer >= 0), "
                        "but data.categorical_columns lists it")


def _target_stats(y: np.ndarray) -> dict[str, float]:
    """Mean and standard deviation of the training targets: the regression head's output scaling."""
    return {"target_mean": float(y.mean()), "target_std": float(y.std()) or 1.0}


def _read(config: DataConfig, path: str | None, key: str, seed: int) -> _Rows:
    if config.source == "digits":
        return _read_digits()
    if config.source == "diabetes":
        return _read_diabetes()
    if config.source == "synthetic":
        return _make_synthetic(config, seed if config.seed is None else config.seed)
    if config.source == "pointer":
        x, y = sequences.pointer_task(config.num_examples, config.sequence_length,
                                      seed if config.seed is None else config.seed)
        return _Rows(x, y, lambda i: f"pointer row {i}", "pointer")
    if config.source == "npz":
        return _read_npz(path, key)
    if config.source == "csv":
        return _read_csv(path, key, config)
    return _read_tfrecord(path, key, config)


def _check_class_ids(parts: list[_Rows], config: DataConfig) -> int:
    """Labels must be integer class ids 0..num_classes-1; returns num_classes (declared, or largest id + 1)."""
    declared = config.num_classes
    for part in parts:
        y = part.y.reshape(-1)
        if y.dtype.kind not in "iuf" or len(y) != len(part.x):
            raise DataError(f"{part.name}: expected one numeric class id per row, got {y.dtype} values "
                            f"({len(y)} labels for {len(part.x)} rows)")
        _check_finite(y, part.where)
        problems = [(y != np.round(y), "is not an integer class id; use data.task: regression for real-valued targets"),
                    (y < 0, "is negative; class ids are 0, 1, ...")]
        if declared is not None:
            problems.append((y >= declared, f"is not below data.num_classes {declared}"))
        for bad, reason in problems:
            if bad.any():
                i = int(np.argmax(bad))
                raise DataError(f"{part.where(i)}: label {_value(y[i])} {reason}")
    num_classes = declared or int(max(part.y.max() for part in parts)) + 1
    if num_classes < 2:
        raise DataError(f"{parts[0].name}: every label is 0; classification needs at least 2 classes")
    if config.label_names is not None and len(config.label_names) != num_classes:
        raise DataError(f"data.label_names: {len(config.label_names)} names, but the labels have {num_classes} classes "
                        f"(0..{num_classes - 1}); set data.num_classes or give one name per class")
    return num_classes


def _check_finite(values: np.ndarray, where: Callable[[int], str], what: str = "label") -> None:
    finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    if not finite.all():
        i = int(np.argmin(finite))
        raise DataError(f"{where(i)}: {what} is NaN or infinite")


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{float(v):g}"


def _existing_file(path: str, key: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{key}: {file} not found (no such file); this pipeline never downloads data")
    return file


def _read_digits() -> _Rows:
    from sklearn.datasets import load_digits  # ships inside scikit-learn: no download

    digits = load_digits()
    return _Rows(digits.data, digits.target, lambda i: f"digits row {i}", "digits", image_shape=(8, 8, 1))


def _read_diabetes() -> _Rows:
    """scikit-learn's diabetes regression set: 442 patients, 10 features, disease progression after a year."""
    from sklearn.datasets import load_diabetes  # ships inside scikit-learn: no download

    diabetes = load_diabetes()
    return _Rows(diabetes.data, diabetes.target, lambda i: f"diabetes row {i}", "diabetes")


def _make_synthetic(config: DataConfig, seed: int) -> _Rows:
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
    return _Rows(x.reshape(n, *shape), y, lambda i: f"synthetic row {i}", "synthetic", image_shape=image_shape)


def _read_npz(path: str, key: str) -> _Rows:
    """A Keras-format image dataset (mnist.npz, fashion-mnist): x_train/y_train/x_test/y_test.

    Train and test rows are pooled; the validation split is taken from them like any other source.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"{key}: {file} not found. This pipeline never downloads data: put the Keras-format file "
            f"(e.g. mnist.npz with x_train, y_train, x_test, y_test) at {file}, or point to it with --set {key}=...")
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

    def where(i: int) -> str:
        return f"{file}: y_train[{i}]" if i < n_train else f"{file}: y_test[{i - n_train}]"

    x = np.concatenate([arrays[x_key] for x_key, _ in pairs])
    y = np.concatenate([arrays[y_key].reshape(-1) for _, y_key in pairs])
    _check_finite(x, lambda i: f"{file}: x_train[{i}]" if i < n_train else f"{file}: x_test[{i - n_train}]",
                  "a feature value")
    shape = x.shape[1:]
    image_shape = shape if len(shape) == 3 else (*shape, 1) if len(shape) == 2 else None
    return _Rows(x, y, where, f"{key}: {file}", image_shape=image_shape)


def _read_csv(path: str, key: str, config: DataConfig) -> _Rows:
    """A csv file with a header row; the label column and the feature columns are picked by name."""
    file = _existing_file(path, key)
    with open(file, newline="") as f:
        lines = [(n, row) for n, row in enumerate(csv.reader(f), start=1) if any(cell.strip() for cell in row)]
    if not lines:
        raise DataError(f"{key}: {file} is empty; expected a header row naming the columns, then one row per example")
    header = [cell.strip() for cell in lines[0][1]]
    if all(_is_number(cell) for cell in header):
        raise DataError(f"{key}: {file}: the first line is not a header (it holds only numbers); "
                        "csv files need a header row naming the columns")
    duplicates = sorted({name for name in header if header.count(name) > 1})
    if duplicates:
        raise DataError(f"{key}: {file}: the header names column {duplicates[0]!r} more than once")
    if config.label not in header:
        raise DataError(f"{key}: {file}: no label column {config.label!r} (data.label); "
                        f"the header has: {', '.join(header)}")
    features = config.feature_columns or [name for name in header if name != config.label]
    missing = [name for name in features if name not in header]
    if missing:
        raise DataError(f"{key}: {file}: no column {missing[0]!r} (data.feature_columns); "
                        f"the header has: {', '.join(header)}")
    if not features:
        raise DataError(f"{key}: {file}: no feature columns besides the label {config.label!r}")
    if len(lines) == 1:
        raise DataError(f"{key}: {file}: no data rows after the header")
    if config.vocab_size is not None and len(features) == 1:
        return _read_csv_sequences(file, key, config, header, lines, features[0])
    columns = [*features, config.label]
    index = [header.index(name) for name in columns]
    values = np.empty((len(lines) - 1, len(columns)), np.float64)
    for r, (n, row) in enumerate(lines[1:]):
        if len(row) != len(header):
            raise DataError(f"{key}: {file} line {n}: {len(row)} fields, but the header has {len(header)}")
        for c, i in enumerate(index):
            try:
                values[r, c] = float(row[i])
            except ValueError:
                raise DataError(f"{key}: {file} line {n}, column {columns[c]!r}: non-numeric value {row[i]!r}") from None
            if not math.isfinite(values[r, c]):
                raise DataError(f"{key}: {file} line {n}, column {columns[c]!r}: {row[i]!r} is not a finite number")
    line_numbers = [n for n, _ in lines[1:]]
    return _Rows(values[:, :-1], values[:, -1],
                 lambda i: f"{key}: {file} line {line_numbers[i]}, column {config.label!r}", f"{key}: {file}",
                 feature_names=tuple(features), row=lambda i: f"{key}: {file} line {line_numbers[i]}")


def _read_csv_sequences(file: Path, key: str, config: DataConfig, header: list[str], lines: list,
                        column: str) -> _Rows:
    """Token sequences in csv: one feature column whose cells hold whitespace-separated ids ('13 8 2 5')."""
    ids, labels = [], []
    for n, row in lines[1:]:
        if len(row) != len(header):
            raise DataError(f"{key}: {file} line {n}: {len(row)} fields, but the header has {len(header)}")
        try:
            ids.append(np.asarray(sequences.parse_ids(row[header.index(column)]), np.float64))
        except ValueError:
            raise DataError(f"{key}: {file} line {n}, column {column!r}: expected token ids separated by spaces, "
                            f"got {row[header.index(column)]!r}") from None
        label = row[header.index(config.label)]
        if not _is_number(label):
            raise DataError(f"{key}: {file} line {n}, column {config.label!r}: non-numeric value {label!r}")
        labels.append(float(label))
    line_numbers = [n for n, _ in lines[1:]]
    x = np.empty(len(ids), object)
    x[:] = ids
    return _Rows(x, np.asarray(labels), lambda i: f"{key}: {file} line {line_numbers[i]}", f"{key}: {file}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_tfrecord(pattern: str, key: str, config: DataConfig) -> _Rows:
    """tf.Example records parsed with data.feature_spec; the features are flattened and concatenated in
    the spec's order, the label is data.label (int64 class id, or float for regression)."""
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise DataError(f"{key}: {pattern} not found (no file matches); this pipeline never downloads data")
    label_dtype = tf.int64 if config.task == "classification" else tf.float32
    if config.vocab_size is not None:  # one int64 feature, a list of any length per record
        parse_spec = {name: tf.io.VarLenFeature(tf.int64) for name in config.feature_spec}
    else:
        parse_spec = {name: tf.io.FixedLenFeature(feature.shape, tf.dtypes.as_dtype(feature.dtype))
                      for name, feature in config.feature_spec.items()}
    parse_spec[config.label] = tf.io.FixedLenFeature([], label_dtype)
    xs, ys, sources = [], [], []
    for file in files:
        expected = count_tfrecords(file, key)
        parsed = _parse_tfrecord_file(file, key, parse_spec, config.label)
        n = len(parsed[config.label])
        if n != expected:  # TensorFlow stops early without a word at a damaged record
            raise DataError(f"{key}: {file}: read {n} records of the {expected} the file holds; it is damaged")
        if config.vocab_size is not None:
            [name] = config.feature_spec
            xs.append(parsed[name])
            ys.append(parsed[config.label])
            sources += [(file, i) for i in range(n)]
            continue
        for name in config.feature_spec:
            _check_finite(parsed[name], lambda i, f=file: f"{key}: {f} record {i}, feature {name!r}", "a value")
        xs.append(np.concatenate([parsed[name].reshape(n, -1).astype(np.float32) for name in config.feature_spec], axis=1))
        ys.append(parsed[config.label])
        sources += [(file, i) for i in range(n)]
    if not sources:
        raise DataError(f"{key}: {pattern}: no records")
    counts = collections.Counter(file for file, _ in sources)
    log.info("%s: %d records%s", key, len(sources), "" if len(files) == 1 else f" from {len(files)} files"
             + (f" ({', '.join(f'{Path(f).name}: {counts[f]}' for f in files)})" if len(files) <= 8 else ""))

    def where(i: int) -> str:
        file, record = sources[i]
        return f"{key}: {file} record {record}, feature {config.label!r}"

    if config.vocab_size is not None:
        x = np.empty(len(sources), object)
        x[:] = [row for part in xs for row in part]
        return _Rows(x, np.concatenate(ys), lambda i: f"{key}: {sources[i][0]} record {sources[i][1]}", f"{key}: {pattern}")
    image_shape = None
    if len(config.feature_spec) == 1:
        [shape] = [tuple(feature.shape) for feature in config.feature_spec.values()]
        image_shape = shape if len(shape) == 3 else (*shape, 1) if len(shape) == 2 else None
    names = tuple(name if math.prod(feature.shape) == 1 else f"{name}[{i}]"
                  for name, feature in config.feature_spec.items() for i in range(math.prod(feature.shape)))
    return _Rows(np.concatenate(xs), np.concatenate(ys), where, f"{key}: {pattern}", image_shape=image_shape,
                 feature_names=names, row=lambda i: f"{key}: {sources[i][0]} record {sources[i][1]}")


# A TFRecord is records of: length (uint64, little-endian), its masked CRC (4 bytes), the data, the data's CRC
# (4 bytes). https://www.tensorflow.org/tutorials/load_data/tfrecord#tfrecords_format_details
_TFRECORD_HEADER, _TFRECORD_FOOTER = 12, 4


def count_tfrecords(file: str, key: str) -> int:
    """The complete records in a TFRecord file, from its framing alone (headers only, no data is read).

    TensorFlow reads a file cut off inside a record (a half-copied file) as the records before the cut,
    silently; this walks the length headers to the end, so a cut, an empty file or a file that is not a
    TFRecord is one DataError naming the file and the records it holds. A cut exactly between two records
    leaves a valid, shorter file that no reader can tell apart (train logs the records read per file).
    """
    size, count, offset = os.path.getsize(file), 0, 0
    if size == 0:
        raise DataError(f"{key}: {file} is empty (0 bytes): no records")
    with open(file, "rb") as f:
        while offset < size:
            header = f.read(_TFRECORD_HEADER)
            if len(header) == _TFRECORD_HEADER and _masked_crc32c(header[:8]) != int.from_bytes(header[8:], "little"):
                raise DataError(f"{key}: {file} is not an uncompressed TFRecord file (or is damaged): the header of record {count} "
                                f"(byte {offset}) fails its checksum")
            length = int.from_bytes(header[:8], "little") if len(header) == _TFRECORD_HEADER else None
            end = offset + _TFRECORD_HEADER + (length or 0) + _TFRECORD_FOOTER
            if length is None or end > size:
                needs = f"record {count} needs {end - offset}" if length is not None else "a record header needs 12"
                raise DataError(f"{key}: {file} is truncated: {count} complete records, then {size - offset} bytes "
                                f"where {needs}; copy the file again")
            f.seek(end)
            offset, count = end, count + 1
    return count


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset ("masked") so that a CRC of CRCs stays distinctive."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _parse_tfrecord_file(file: str, key: str, parse_spec: dict, label: str) -> dict[str, np.ndarray]:
    """All records of one file, parsed; a record that does not fit the spec is diagnosed by name."""
    records = tf.data.TFRecordDataset(file)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in parse_spec}
    start = 0
    try:
        for batch in records.batch(4096):
            try:
                parsed = tf.io.parse_example(batch, parse_spec)
            except tf.errors.InvalidArgumentError as e:
                raise DataError(_diagnose_records(file, key, batch.numpy(), start, parse_spec, label, e)) from None
            for name, tensor in parsed.items():
                parts[name].append(_ragged_rows(tensor) if isinstance(tensor, tf.SparseTensor) else tensor.numpy())
            start += len(batch)
    except tf.errors.DataLossError:
        raise DataError(f"{key}: {file}: not a TFRecord file (or truncated/compressed) after {start} records") from None
    return {name: [row for rows in arrays for row in rows] if isinstance(parse_spec[name], tf.io.VarLenFeature)
            else np.concatenate(arrays) if arrays else np.zeros((0, *parse_spec[name].shape))
            for name, arrays in parts.items()}


def _ragged_rows(tensor: tf.SparseTensor) -> list[np.ndarray]:
    """A parsed VarLenFeature (one list per record) as one id array per record."""
    return list(tf.RaggedTensor.from_sparse(tensor).numpy())


_LIST_KIND = {tf.float32: "float_list", tf.int64: "int64_list"}


def _diagnose_records(file: str, key: str, records: np.ndarray, start: int, parse_spec: dict, label: str,
                      error: Exception) -> str:
    """Finds the first record and feature that do not fit the spec, and says how."""
    for offset, serialized in enumerate(records):
        where = f"{key}: {file} record {start + offset}"
        try:
            example = tf.train.Example.FromString(serialized)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            return f"{where}: not a serialized tf.train.Example"
        features = example.features.feature
        for name, feature_spec in parse_spec.items():
            any_length = isinstance(feature_spec, tf.io.VarLenFeature)  # token ids
            size = None if any_length else math.prod(feature_spec.shape)
            expected = (f"{_LIST_KIND[feature_spec.dtype]} of token ids (any length)" if any_length else
                        f"{_LIST_KIND[feature_spec.dtype]} of {size} value{'s' if size != 1 else ''} "
                        f"(shape {list(feature_spec.shape)})")
            if name not in features:
                return f"{where}: no feature {name!r} (has {', '.join(sorted(features)) or 'none'}); expected {expected}"
            kind = features[name].WhichOneof("kind")
            count = len(getattr(features[name], kind).value) if kind else 0
            if kind != _LIST_KIND[feature_spec.dtype] or (size is not None and count != size):
                hint = ""
                if name == label and kind != _LIST_KIND[feature_spec.dtype]:
                    hint = ("; classification labels are int64 class ids (set data.task: regression for real-valued "
                            "targets)" if feature_spec.dtype == tf.int64 else "; regression targets are float_list values")
                held = f"{kind} of {count} value{'s' if count != 1 else ''}" if kind else "no values"
                return f"{where}, feature {name!r}: holds {held}; expected {expected}{hint}"
    return f"{key}: {file}: {str(error).splitlines()[0]}"
