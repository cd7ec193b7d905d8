"""Input shards for `pipeline score`: which files, what a row is, and each file's rows with its bad rows set aside.

A row is what the version's serving_default input takes: `Layout` reads it from the signature (one float32
input, [batch, *shape]) and pipeline.json's data config. Three formats of rows, by file suffix:

    .csv        a header row; the features are data.feature_columns when the model was trained on csv, else
                every column but the label (data.label) and the --keep columns, in the header's order
    .npz        the array named after the input (e.g. `features`), or `x`, or the file's only array:
                [rows, *shape] or [rows, width]
    .tfrecord   tf.Example records: data.feature_spec's features when the model was trained on tfrecords
    .tfrecords  (flattened, concatenated), else one float_list feature named after the input holding the
                row's values: the export's Classify contract (serving/client/grpc_client.py float_examples)

A version that takes images (pipeline.json has a predict_images signature) also reads images, sent to it as
bytes (pipeline/score/images.py): a folder, image files (.jpg, .jpeg, .png) named by a glob, and tfrecord files
whose first record holds `image/encoded`.

`tasks.check_head` reads each shard's header (csv), array shape (npz) or first record (tfrecord) before the job
starts, so a shard of the wrong shape is a one-line DataError and nothing is scored. Within a shard, a row
that cannot be read (a short line, a word where a number goes, a NaN, a record without the feature) is a
BadRow, counted by kind and written aside; it never stops the job.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import DataError

SUFFIXES = {".csv": "csv", ".npz": "npz", ".tfrecord": "tfrecord", ".tfrecords": "tfrecord"}
RAW_LIMIT = 2000  # characters of a bad row's raw text kept in the bad-rows file


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one row of input is for this version: its input, its shape, and where its values come from."""

    input_name: str
    shape: tuple[int, ...]  # one row, without the batch dimension
    columns: tuple[str, ...] | None = None  # csv: the feature columns (None: all but label and keep)
    label: str | None = None  # csv: a column that is never a feature (data.label)
    keep: tuple[str, ...] = ()  # csv: columns copied to the predictions
    feature_spec: tuple[tuple[str, int], ...] | None = None  # tfrecord: (feature, values) in order
    images: tuple[int, int] | None = None  # predict_images' (min_image_side, max_image_pixels); None: takes no images

    @property
    def width(self) -> int:
        return math.prod(self.shape)

    @property
    def tfrecord_features(self) -> tuple[tuple[str, int], ...]:
        return self.feature_spec or ((self.input_name, self.width),)


@dataclasses.dataclass(frozen=True)
class Input:
    """One task's input: a file of rows, or a group of image files."""

    path: str  # the file; for image files, the folder or pattern that named them
    format: str  # csv, npz, tfrecord; images (files), image_records (a tfrecord of images: tasks.check_head decides)
    files: tuple[str, ...] = ()  # images: this task's files


IMAGE_FORMATS = ("images", "image_records")


@dataclasses.dataclass(frozen=True)
class BadRow:
    row: int  # 0-based data row (csv: non-blank lines after the header) or record index in its file
    kind: str  # field_count, not_a_number, not_finite, not_an_example, missing_feature, wrong_shape, model_rejected;
    # images: unreadable, empty, not_an_image, damaged_header, too_small, too_large, not_decodable
    message: str
    raw: str = ""
    source: str = ""  # the image file, where a task reads many (else the task's input)


@dataclasses.dataclass
class Rows:
    """One shard's readable rows (float32 [n, *shape]), their row numbers, kept columns and bad rows."""

    x: np.ndarray
    rows: np.ndarray  # int64 [n]: each readable row's number in the file
    bad: list[BadRow]
    kept: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def expand_files(patterns: list[str], flag: str = "--input") -> list[str]:
    """The files matching the patterns (globs, `**` included), sorted and without repeats.

    Raises:
        DataError: a pattern that matches no file.
    """
    files: list[str] = []
    for pattern in patterns:
        found = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not found:
            raise DataError(f"{flag}: {pattern}: no file matches; this pipeline never downloads data")
        files += [path for path in found if path not in files]
    return files


def file_format(path: str) -> str:
    return SUFFIXES[Path(path).suffix.lower()]


def check_rows_head(item: Input, layout: Layout, first: bytes | None = None) -> None:
    """Raises DataError (one line) when a shard of rows cannot be rows of this model: missing columns, an npz
    without a fitting array, a first tf.Example (`first`, read by the caller) without the feature or of the wrong
    shape."""
    from pipeline.export.signatures import IMAGE_FEATURE

    path = item.path
    if item.format == "csv":
        _csv_columns(path, _csv_header(path), layout)
    elif item.format == "npz":
        _npz_rows(path, layout, load=False)
    elif item.format == "tfrecord" and first is not None:
        _, problem = _example_row(first, layout)
        if problem is not None and problem.kind != "not_finite":
            raise DataError(f"{path} record 0: {problem.message}; every record of a shard must hold "
                            f"{_feature_text(layout)}" + (f" (or, for images, an encoded image as the bytes "
                                                          f"feature {IMAGE_FEATURE!r})" if layout.images else ""))


def read(path: str, layout: Layout) -> Rows:
    """Every row of one shard, its bad rows set aside (tasks.check_head has passed)."""
    fmt = file_format(path)
    if fmt == "csv":
        return _read_csv(path, layout)
    if fmt == "npz":
        return _finite(_npz_rows(path, layout, load=True), layout)
    return _read_tfrecord(path, layout)


# csv


def _csv_header(path: str) -> list[str]:
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if any(cell.strip() for cell in row):
                return [cell.strip() for cell in row]
    raise DataError(f"{path} is empty; expected a header row naming the columns, then one row per example")


def _csv_columns(path: str, header: list[str], layout: Layout) -> list[str]:
    missing = [name for name in (*layout.keep, *(layout.columns or ())) if name not in header]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r}; the header has: {', '.join(header)}")
    features = list(layout.columns or [name for name in header if name != layout.label and name not in layout.keep])
    if len(features) != layout.width:
        raise DataError(f"{path}: {len(features)} feature columns ({_names(features)}) but the model's input "
                        f"'{layout.input_name}' takes {layout.width} values per row (shape {list(layout.shape)}); "
                        "drop the other columns or name them with --keep")
    return features


def _read_csv(path: str, layout: Layout) -> Rows:
    """pyarrow's reader when every line parses; Python's csv module, line by line, when one does not."""
    header = _csv_header(path)
    features = _csv_columns(path, header, layout)
    fast = _read_csv_arrow(path, features, layout)
    return fast if fast is not None else _read_csv_lines(path, header, features, layout)


def _read_csv_arrow(path: str, features: list[str], layout: Layout) -> Rows | None:
    import pyarrow as pa
    from pyarrow import csv as pa_csv

    types = {name: pa.float64() for name in features} | {name: pa.string() for name in layout.keep}
    try:
        table = pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(
            column_types=types, include_columns=[*features, *layout.keep], strings_can_be_null=False))
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # a short line or a word where a number goes: the slow path finds which
    if any(table.column(name).null_count for name in features):
        return None  # an empty cell
    x = np.stack([table.column(name).to_numpy() for name in features], axis=1) if features else np.zeros((0, 0))
    kept = {name: table.column(name).to_pylist() for name in layout.keep}
    return _finite(Rows(x.reshape(len(x), *layout.shape).astype(np.float32), np.arange(len(x)), [], kept), layout)


def _read_csv_lines(path: str, header: list[str], features: list[str], layout: Layout) -> Rows:
    index = [header.index(name) for name in features]
    keep_index = [header.index(name) for name in layout.keep]
    values, rows, bad = [], [], []
    kept: dict[str, list[str]] = {name: [] for name in layout.keep}
    with open(path, newline="") as f:
        lines = (row for row in csv.reader(f) if any(cell.strip() for cell in row))
        next(lines)  # the header
        for number, row in enumerate(lines):
            raw = ",".join(row)[:RAW_LIMIT]
            if len(row) != len(header):
                bad.append(BadRow(number, "field_count", f"{len(row)} fields, the header has {len(header)}", raw))
                continue
            try:
                values.append([float(row[i]) for i in index])
            except ValueError:
                cell = next(i for i in index if not _is_float(row[i]))
                bad.append(BadRow(number, "not_a_number", f"column {header[cell]!r}: {row[cell][:80]!r} is not a number",
                                  raw))
                continue
            rows.append(number)
            for name, i in zip(layout.keep, keep_index):
                kept[name].append(row[i])
    x = np.asarray(values, np.float32).reshape(len(values), *layout.shape)
    return _finite(Rows(x, np.asarray(rows, np.int64), bad, kept), layout)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# npz


def _npz_rows(path: str, layout: Layout, load: bool) -> Rows:
    from pipeline.data.arrays import not_an_npz  # lazily: that module loads TensorFlow

    not_npz = not_an_npz(path)
    if not_npz:
        raise DataError(f"{path} {not_npz}")
    try:
        with np.load(path) as npz:
            names = [layout.input_name, "x"] if len(npz.files) > 1 else npz.files
            key = next((name for name in names if name in npz.files), None)
            if key is None:
                raise DataError(f"{path}: no array named {layout.input_name!r} or 'x' (has {_names(npz.files)})")
            array = npz[key] if load else None
            shape = array.shape if load else _npz_shape(npz, key)
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not a readable .npz file: {str(error).splitlines()[0]}") from None
    if len(shape) < 1 or math.prod(shape[1:]) != layout.width or (len(shape) > 2 and tuple(shape[1:]) != layout.shape):
        raise DataError(f"{path}: array {key!r} has shape {list(shape)}; the model's input '{layout.input_name}' "
                        f"takes rows of shape {list(layout.shape)} ([rows, {', '.join(map(str, layout.shape))}] "
                        f"or [rows, {layout.width}])")
    if not load:
        return Rows(np.zeros((0, *layout.shape), np.float32), np.zeros(0, np.int64), [])
    if array.dtype.kind not in "iuf":
        raise DataError(f"{path}: array {key!r} holds {array.dtype} values; expected numbers")
    return Rows(array.reshape(len(array), *layout.shape).astype(np.float32, copy=False), np.arange(len(array)), [])


def _npz_shape(npz: Any, key: str) -> tuple[int, ...]:
    """An array's shape from its .npy header, without reading its data."""
    from numpy.lib import format as npy_format

    with npz.zip.open(f"{key}.npy") as f:
        major, _ = npy_format.read_magic(f)
        read_header = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
        shape, _, _ = read_header(f)
    return tuple(shape)


# tfrecord


def tfrecords(path: str, flag: str = "") -> Iterator[bytes]:
    """The raw records of a TFRecord file (TensorFlow's reader: it checks each record's CRC). A file with bytes
    but no whole record is not a TFRecord file either; the error names the file after `flag` (e.g. "--log: ")."""
    import tensorflow as tf

    count = 0
    try:
        for count, record in enumerate(tf.data.TFRecordDataset(path).as_numpy_iterator(), start=1):
            yield record
    except tf.errors.DataLossError:
        count = -1
    if count == -1 or (count == 0 and os.path.getsize(path) > 0):
        raise DataError(f"{flag}{path}: not a TFRecord file (or truncated or compressed)")


def _read_tfrecord(path: str, layout: Layout) -> Rows:
    values, rows, bad = [], [], []
    for number, record in enumerate(tfrecords(path)):
        row, problem = _example_row(record, layout)
        if problem is not None:
            bad.append(dataclasses.replace(problem, row=number))
        else:
            values.append(row)
            rows.append(number)
    x = np.asarray(values, np.float32).reshape(len(values), *layout.shape)
    return Rows(x, np.asarray(rows, np.int64), bad)


def _example_row(record: bytes, layout: Layout) -> tuple[np.ndarray | None, BadRow | None]:
    """One tf.Example's row values, or why it has none."""
    from google.protobuf.message import DecodeError
    from tensorflow.core.example import example_pb2

    try:
        example = example_pb2.Example.FromString(record)
    except DecodeError:
        return None, BadRow(0, "not_an_example", "not a serialized tf.train.Example", record[:RAW_LIMIT // 2].hex())
    features = example.features.feature
    parts = []
    for name, count in layout.tfrecord_features:
        if name not in features:
            return None, BadRow(0, "missing_feature", f"no feature {name!r} (has {_names(sorted(features))})",
                                _shown(example))
        kind = features[name].WhichOneof("kind")
        held = getattr(features[name], kind).value if kind in ("float_list", "int64_list") else ()
        if len(held) != count:
            what = f"{kind} of {len(held)} values" if kind else "no values"
            return None, BadRow(0, "wrong_shape", f"feature {name!r} holds {what}; expected {count} numbers",
                                _shown(example))
        parts.append(np.asarray(held, np.float32))
    row = np.concatenate(parts)
    if not np.isfinite(row).all():
        return None, BadRow(0, "not_finite", f"a value is NaN or infinite (feature {_first_non_finite(parts, layout)!r})",
                            _shown(example))
    return row, None


def _first_non_finite(parts: list[np.ndarray], layout: Layout) -> str:
    return next(name for (name, _), part in zip(layout.tfrecord_features, parts) if not np.isfinite(part).all())


def _shown(example: Any) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(example, as_one_line=True)[:RAW_LIMIT]


def _feature_text(layout: Layout) -> str:
    return ", ".join(f"feature {name!r} with {count} numbers" for name, count in layout.tfrecord_features)


# common


def _finite(rows: Rows, layout: Layout) -> Rows:
    """Moves rows holding NaN or infinity to the bad rows: the model would answer them with NaN."""
    finite = np.isfinite(rows.x.reshape(len(rows.x), -1)).all(axis=1)
    if finite.all():
        return rows
    bad = [BadRow(int(rows.rows[i]), "not_finite", "a value is NaN or infinite",
                  np.array2string(rows.x[i].reshape(-1), max_line_width=10**6)[:RAW_LIMIT])
           for i in np.flatnonzero(~finite)]
    kept = {name: [v for v, ok in zip(values, finite) if ok] for name, values in rows.kept.items()}
    merged = sorted(rows.bad + bad, key=lambda b: b.row)
    return Rows(rows.x[finite], rows.rows[finite], merged, kept)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:12])
    return (shown + f", ... ({len(names)} in all)") if len(names) > 12 else (shown or "none")
