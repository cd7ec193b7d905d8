"""CSV files (a file or a glob of shards), each with a header row naming the columns.

The label column and the feature columns are picked by name (data.label, data.feature_columns; default: every
column but the label); every file's header must hold them. Lines are decoded a batch at a time in the graph
(tf.io.decode_csv, every field counted, the used ones required and numeric); blank lines are skipped. With
data.vocab_size and one feature column, its cells hold whitespace-separated token ids ('13 8 2 5').
Fields are split at commas: a quoted field holding a comma is not supported.
"""

from __future__ import annotations

import csv as csv_module
import math

import tensorflow as tf

from pipeline.config import DataConfig
from pipeline.errors import DataError


class CsvFormat:
    noun = "line"  # "data.path: train.csv line 7" (line numbers count the header as line 1)
    column_noun = "column"
    per_record = False
    first_index = 2  # a file's first record is its line 2

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.header: list[str] | None = None
        self.features: list[str] = []
        self.tokens = False

    def check_head(self, path: str, key: str) -> None:
        """The header names the label and the feature columns, and every file has the first file's header."""
        header = _header(path, key)
        if self.header is not None:
            if header != self.header:
                raise DataError(f"{key}: {path}: its header ({', '.join(header)}) differs from the first file's "
                                f"({', '.join(self.header)}); every file of a source needs the same columns")
            return
        config = self.config
        duplicates = sorted({name for name in header if header.count(name) > 1})
        if duplicates:
            raise DataError(f"{key}: {path}: the header names column {duplicates[0]!r} more than once")
        if config.label not in header:
            raise DataError(f"{key}: {path}: no label column {config.label!r} (data.label); "
                            f"the header has: {', '.join(header)}")
        features = config.feature_columns or [name for name in header if name != config.label]
        missing = [name for name in features if name not in header]
        if missing:
            raise DataError(f"{key}: {path}: no column {missing[0]!r} (data.feature_columns); "
                            f"the header has: {', '.join(header)}")
        if not features:
            raise DataError(f"{key}: {path}: no feature columns besides the label {config.label!r}")
        self.header, self.features = header, features
        self.tokens = config.vocab_size is not None and len(features) == 1

    @property
    def row_shape(self) -> tuple:
        return (None,) if self.tokens else (len(self.features),)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return () if self.tokens else tuple(self.features)

    image_shape = None

    def records(self, path: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TextLineDataset(path).skip(1)

    def skip(self, line: tf.Tensor) -> tf.Tensor:
        """Blank lines are not records."""
        return tf.equal(tf.strings.length(tf.strings.strip(line)), 0)

    def decode(self, lines: tf.Tensor):
        """A batch of lines → (features float32 [n, width] (token ids: ragged), labels [n])."""
        used = set(self.features) | {self.config.label}
        text = {self.features[0]} if self.tokens else set()
        defaults = [tf.constant([""]) if name in text else  # an empty cell: an empty sequence
                    tf.constant([], tf.float32) if name in used else tf.constant([""]) for name in self.header]
        fields = dict(zip(self.header, tf.io.decode_csv(lines, defaults)))
        label = fields[self.config.label]
        if self.config.task == "classification":
            label = tf.cast(label, tf.int64)  # checked to be an integer class id by the statistics pass
        if self.tokens:
            ids = tf.strings.to_number(tf.strings.split(fields[self.features[0]]), tf.float32)
            return ids, label
        return tf.stack([fields[name] for name in self.features], axis=1), label

    def diagnose(self, line: bytes) -> tuple[str | None, str] | None:
        """(column, why) the line is not a record of this file, or None when it is."""
        [row] = list(csv_module.reader([line.decode("utf-8", errors="replace")]))
        if len(row) != len(self.header):
            return None, f"{len(row)} fields, but the header has {len(self.header)}"
        for name in [*self.features, self.config.label]:
            cell = row[self.header.index(name)]
            if self.tokens and name == self.features[0]:
                if not all(_is_number(part) for part in cell.split()):
                    return name, f"expected token ids separated by spaces, got {cell!r}"
            elif not cell.strip():
                return name, "the value is missing"
            elif not _is_number(cell):
                return name, f"non-numeric value {cell!r}"
            elif not math.isfinite(float(cell)):
                return name, f"{cell!r} is not a finite number"
        return None

    def damaged_file(self, path: str, key: str) -> DataError:
        return DataError(f"{key}: {path}: TensorFlow cannot read it as a text file")


def _header(path: str, key: str) -> list[str]:
    """The first line's column names (a file's records start on its line 2)."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        first = next(csv_module.reader(f), None)
    if first is None:
        raise DataError(f"{key}: {path} is empty; expected a header row naming the columns, then one row per example")
    header = [cell.strip() for cell in first]
    if not any(header):
        raise DataError(f"{key}: {path}: the first line is blank; csv files start with a header row naming the columns")
    if all(_is_number(cell) for cell in header):
        raise DataError(f"{key}: {path}: the first line is not a header (it holds only numbers); "
                        "csv files need a header row naming the columns")
    return header


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
