"""Parquet files → TFRecord shards of tf.Example, once (`python -m pipeline convert`), for the tfrecord source.

Training never reads Parquet itself: tensorflow-io (TF's Parquet reader) is unmaintained for TF 2.18+, and a
Python generator over pyarrow cannot run on a tf.data service and holds the GIL while it feeds the model. Converted
once, the rows are read by the streamed tfrecord source (shards.py): graph ops only, sharded by file, on a tf.data
service too. The numbers behind the decision: docs/architecture.md ("Parquet: converted once to TFRecord shards").

    DIR/part-00000.tfrecord ...   the rows in the input files' sorted order, a new shard every --shard_mb
    DIR/data.yaml                 the `data:` section that trains on them (source, path, label, task, feature_spec)

Columns → features: integer → int64_list, floating → float_list (float32), lists of numbers of one length
(fixed_size_list, or list columns whose every row has the same length; lists of lists: a shape of several
dimensions) → one feature of that shape. Anything else (strings, booleans, nulls, ragged lists) is a DataError
naming the file and column. Every file's schema and recorded null counts are checked before a row is read; a
null or ragged list found while converting stops it, and the staging directory goes (pipeline/artifacts.py):
DIR is whole, or what it was before.

The files are read a batch of rows at a time (pyarrow's iter_batches, row group by row group), never whole, and
each batch is encoded by numpy in the tf.Example wire format (_encode), not through a protobuf message per row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import tensorflow as tf
import yaml

from pipeline import artifacts
from pipeline.score.engine import PROGRESS_INTERVAL_S
from pipeline.errors import DataError
from pipeline.score.shards import expand_files

log = logging.getLogger(__name__)

DATA_YAML = "data.yaml"
SHARD_PATTERN = "part-*.tfrecord"
BATCH_BYTES = 16 * 2**20  # values per batch read and encoded at once (rows: this over a row's size)
TFRECORD_FRAMING = 16  # a record's length (8 bytes) and two checksums (4 + 4) around its data
MB = 10**6


@dataclasses.dataclass
class Column:
    """A Parquet column as a tf.Example feature: int64 or float32 values of one shape (None: not seen yet)."""

    name: str
    dtype: str  # "int64" | "float32"
    shape: list[int | None]  # [] for a scalar; a list column's length comes from its first row

    def spec(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What convert wrote: for the terminal (print_conversion) and for callers."""

    output: str
    files: int
    rows: int
    shards: int
    input_bytes: int
    output_bytes: int
    seconds: float
    data: dict[str, Any]  # the `data:` section, as DIR/data.yaml holds it


def convert(inputs: list[str], output: str | Path, *, label: str = "label", drop: tuple[str, ...] = (),
            shard_mb: float = 128, overwrite: bool = False) -> Conversion:
    """Converts the Parquet files matching inputs into TFRecord shards under output, published whole.

    Raises:
        DataError: no file matches, a file that is not Parquet, a column that is not numbers of one shape, a
            null, no label column, an output that exists without overwrite (nothing is written).
    """
    started, output = time.perf_counter(), Path(output)
    if output.exists() and not overwrite:
        raise DataError(f"--output: {output} already exists; pass --overwrite to replace it (it is replaced only "
                        "once the new shards are complete)")
    if not shard_mb > 0:
        raise DataError(f"--shard_mb: expected a size > 0, got {shard_mb}")
    files = expand_files(inputs)
    features, target = plan(files, label, drop)
    with artifacts.atomic_dir(output, replace=overwrite) as staging:
        shards = _ShardWriter(staging, int(shard_mb * MB))
        rows = _convert_files(files, features, target, shards)
        if rows == 0:
            raise DataError(f"--input: {', '.join(files)}: no rows to convert")
        data = data_section(output, features, target)
        artifacts.write_text_atomic(staging / DATA_YAML, data_yaml(data))
    return Conversion(str(output), len(files), rows, len(shards.paths), sum(Path(f).stat().st_size for f in files),
                      shards.total, time.perf_counter() - started, data)


def plan(files: list[str], label: str, drop: tuple[str, ...] = ()) -> tuple[list[Column], Column]:
    """The features and the label, from every file's schema and metadata, before a row is read: the files must
    agree, and each column must be numbers (a file's recorded nulls are found here too)."""
    features: list[Column] | None = None
    for path in files:
        parquet = _open(path)
        schema, metadata = parquet.schema_arrow, parquet.metadata
        found = [_column(path, field) for field in schema if field.name not in drop]
        if features is not None:
            _same_columns(path, found, features, files[0])
        features = features or found
        _recorded_nulls(path, metadata, {column.name for column in found})
    by_name = {column.name: column for column in features}
    if label not in by_name:
        raise DataError(f"--label: {files[0]} has no column {label!r} (columns: {', '.join(by_name) or 'none'})")
    target = by_name[label]
    if target.shape:
        raise DataError(f"--label: {files[0]}: column {label!r} holds lists; the label is one integer (a class id) "
                        "or one floating value (a regression target) per row")
    return [column for column in features if column.name != label], target


def _open(path: str) -> pq.ParquetFile:
    """pre_buffer off: pyarrow's default reads every row group of the file ahead (the whole file in memory); without
    it iter_batches holds about one row group."""
    try:
        return pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"--input: {path} is not a Parquet file ({str(error).splitlines()[0]})") from None


def _column(path: str, field: pa.Field) -> Column:
    """The feature a column converts to, or a DataError saying why it cannot."""
    kind, shape = field.type, []
    while pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        shape.append(kind.list_size if pa.types.is_fixed_size_list(kind) else None)
        kind = kind.value_type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return Column(field.name, "int64" if pa.types.is_integer(kind) else "float32", shape)
    hint = "; cast it to an integer column" if pa.types.is_boolean(kind) else ""
    raise DataError(f"{path}: column {field.name!r} is {field.type}: only integer, floating and fixed-length list "
                    f"columns of numbers convert{hint} (or leave it out: --drop {field.name})")


def _same_columns(path: str, found: list[Column], expected: list[Column], first: str) -> None:
    """A later file has the first file's columns, in any order, of the same kinds and (known) lengths."""
    by_name = {column.name: column for column in found}
    for column in expected:
        other = by_name.pop(column.name, None)
        if other is None:
            raise DataError(f"{path}: no column {column.name!r}, which {first} has (every file needs the same columns)")
        same_shape = len(other.shape) == len(column.shape) and all(
            a is None or b is None or a == b for a, b in zip(other.shape, column.shape))
        if other.dtype != column.dtype or not same_shape:
            raise DataError(f"{path}: column {column.name!r} is {other.dtype} {other.shape} but in {first} "
                            f"{column.dtype} {column.shape} (None: a list of any length)")
        column.shape = [a if a is not None else b for a, b in zip(column.shape, other.shape)]
    if by_name:
        name = next(iter(by_name))
        raise DataError(f"{path}: column {name!r} is not in {first} (every file needs the same columns; or leave it "
                        f"out: --drop {name})")


def _recorded_nulls(path: str, metadata: pq.FileMetaData, names: set[str]) -> None:
    """Nulls the file's statistics record for a plain column: found before any row is read (a list's nulls, or a
    file without statistics, are found as its rows are read)."""
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for i in range(row_group.num_columns):
            chunk = row_group.column(i)
            stats = chunk.statistics
            if chunk.path_in_schema in names and stats is not None and stats.has_null_count and stats.null_count:
                nulls = stats.null_count
                raise _null_error(path, chunk.path_in_schema,
                                  f"has {nulls:,} null value{'s' if nulls != 1 else ''} (row group {group})")


def _null_error(path: str, name: str, what: str) -> DataError:
    return DataError(f"{path}: column {name!r} {what}; a tf.Example feature needs a value in every row (fill or "
                     "drop those rows first)")


def data_section(output: Path, features: list[Column], target: Column) -> dict[str, Any]:
    """The `data:` config that trains on the shards: checked by the config's own validation before it is shown."""
    from pipeline.config import validate_config

    data = {"source": "tfrecord", "path": str(output / SHARD_PATTERN), "label": target.name,
            "task": "classification" if target.dtype == "int64" else "regression",
            "feature_spec": {column.name: column.spec() for column in features}}
    validate_config({"data": data}, f"{output / DATA_YAML}")
    return {"data": data}


def _convert_files(files: list[str], features: list[Column], target: Column, shards: _ShardWriter) -> int:
    """Every file's rows into the shards, a batch at a time; returns the rows written."""
    columns = [*features, target]
    total = sum(_open(path).metadata.num_rows for path in files)
    progress = _Progress(total, shards)
    for path in files:
        parquet, first_row = _open(path), 0
        batch_rows = _batch_rows(columns)
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=[c.name for c in columns]):
            if batch.num_rows:
                values = [_rows(path, column, batch.column(column.name), first_row) for column in columns]
                shards.write(*_encode([(c.name, c.dtype, v) for c, v in zip(columns, values)]))
            first_row += batch.num_rows
            progress(batch.num_rows)
    shards.close()
    progress.done()
    return progress.rows


def _batch_rows(columns: list[Column]) -> int:
    """Rows per batch: about BATCH_BYTES of values (a list column's length read from the schema, else guessed)."""
    values = sum(math.prod(size or 64 for size in column.shape) for column in columns)
    return max(64, min(65536, BATCH_BYTES // (8 * values)))


def _rows(path: str, column: Column, array: pa.Array, first_row: int) -> np.ndarray:
    """The column's values as [rows, values per row] in its dtype; a null, an empty or ragged list, or an
    integer beyond int64 is a DataError naming the file, column and row. Fills in list lengths on first sight."""
    per_row = 1
    for depth in range(len(column.shape)):
        _no_nulls(path, column.name, array, first_row, per_row, inside=depth > 0)
        lengths = pc.list_value_length(array).to_numpy()
        expected = column.shape[depth] if column.shape[depth] is not None else int(lengths[0])
        if expected == 0:
            raise DataError(f"{path}: column {column.name!r} row {first_row}: an empty list; a feature needs a value")
        odd = np.flatnonzero(lengths != expected)
        if odd.size:
            i = int(odd[0])
            raise DataError(f"{path}: column {column.name!r} row {first_row + i // per_row}: a list of {lengths[i]} "
                            f"values where earlier rows hold {expected}; only lists of one length convert (one "
                            "feature of a fixed shape)")
        column.shape[depth] = expected
        per_row *= expected
        array = array.flatten()
    _no_nulls(path, column.name, array, first_row, per_row, inside=bool(column.shape))
    values = array.to_numpy(zero_copy_only=False)
    too_big = values > np.iinfo(np.int64).max if values.dtype == np.uint64 else None
    if too_big is not None and too_big.any():
        i = int(np.argmax(too_big))
        raise DataError(f"{path}: column {column.name!r} row {first_row + i // per_row}: {values[i]} does not fit "
                        "int64_list (int64)")
    return values.astype(np.int64 if column.dtype == "int64" else np.float32, copy=False).reshape(-1, per_row)


def _no_nulls(path: str, name: str, array: pa.Array, first_row: int, per_row: int, inside: bool) -> None:
    """per_row: this level's values per row; inside: the array is a list's values, not the rows themselves."""
    if array.null_count:
        first = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        where = " inside its list" if inside else ""
        raise _null_error(path, name, f"row {first_row + first // per_row} holds a null{where}")


# --- the tf.Example wire format, a batch of rows at a time ---------------------------------------------------------
# Example {features = 1: Features {feature = 1: map entry {key = 1: name, value = 2: Feature {float_list = 2 |
# int64_list = 3: {value = 1: packed floats (4 bytes each) | packed varints}}}}}; each message field is its tag
# byte, its length as a varint, its bytes. A part of the rows is a block [rows, width] of bytes and a mask of the
# bytes each row uses (None: all of them; varints are shorter than the widest in the block).

_VARINT_LIMITS = np.array([1 << (7 * i) for i in range(1, 10)], np.uint64)  # a varint needs 1 + (limits <= x) bytes
_KIND_TAG = {"float32": 0x12, "int64": 0x1A}  # Feature.float_list (field 2), Feature.int64_list (field 3)
_LEN_FIELD_1, _LEN_FIELD_2 = 0x0A, 0x12  # field 1 / field 2, length-delimited

Part = tuple[np.ndarray, "np.ndarray | None"]


def _encode(features: list[tuple[str, str, np.ndarray]]) -> tuple[bytes, np.ndarray]:
    """Serialized tf.Examples of the rows (one buffer, and each record's offsets into it) from the features'
    values [rows, n]: the lengths are worked out inside out, then every byte is copied once (_join)."""
    rows = len(features[0][2])
    parts, features_len = [], np.zeros(rows, np.int64)
    for name, dtype, values in features:
        payload = _payload(dtype, values)
        payload_len = _lengths(payload)
        packed_len = 1 + _varint_size(payload_len) + payload_len
        feature_len = 1 + _varint_size(packed_len) + packed_len
        key = bytes([_LEN_FIELD_1]) + _varint_bytes(len(name.encode())) + name.encode()
        entry_len = len(key) + 1 + _varint_size(feature_len) + feature_len
        features_len += 1 + _varint_size(entry_len) + entry_len
        parts += [_constant(bytes([_LEN_FIELD_1]), rows), _varints(entry_len), _constant(key, rows),
                  _constant(bytes([_LEN_FIELD_2]), rows), _varints(feature_len),
                  _constant(bytes([_KIND_TAG[dtype]]), rows), _varints(packed_len),
                  _constant(bytes([_LEN_FIELD_1]), rows), _varints(payload_len), payload]
    data, lengths = _join([_constant(bytes([_LEN_FIELD_1]), rows), _varints(features_len), *parts])
    return data.tobytes(), np.concatenate([[0], np.cumsum(lengths)])


def _payload(dtype: str, values: np.ndarray) -> Part:
    """Each row's values, packed: float32 little-endian, or int64 varints."""
    if dtype == "float32":
        return values.astype("<f4").view(np.uint8), None
    return _varints(values)


def _lengths(part: Part) -> np.ndarray:
    block, mask = part
    return np.full(len(block), block.shape[1], np.int64) if mask is None else mask.sum(axis=1, dtype=np.int64)


def _varint_size(values: np.ndarray) -> np.ndarray:
    return 1 + np.searchsorted(_VARINT_LIMITS, np.asarray(values).astype(np.int64).view(np.uint64), side="right")


def _varints(values: np.ndarray) -> Part:
    """Protobuf varints of values [rows] or [rows, n], a row's one after another (a negative int64 is its two's
    complement: 10 bytes), padded to the widest in the block."""
    values = np.asarray(values).astype(np.int64).view(np.uint64).reshape(len(values), -1)
    sizes = _varint_size(values)[..., None]
    position = np.arange(int(sizes.max(initial=1)))
    groups = ((values[..., None] >> (7 * position).astype(np.uint64)) & 0x7F).astype(np.uint8)
    groups |= np.where(position < sizes - 1, 0x80, 0).astype(np.uint8)  # more bytes follow
    full = sizes.min(initial=len(position)) == len(position)  # every varint as wide as the widest: no padding
    mask = None if full else np.broadcast_to(position < sizes, groups.shape)
    return groups.reshape(len(values), -1), None if mask is None else mask.reshape(len(values), -1)


def _varint_bytes(value: int) -> bytes:
    block, mask = _varints(np.array([value]))
    return block[0].tobytes() if mask is None else block[mask].tobytes()


def _constant(value: bytes, rows: int) -> Part:
    return np.broadcast_to(np.frombuffer(value, np.uint8), (rows, len(value))), None


def _join(parts: list[Part]) -> tuple[np.ndarray, np.ndarray]:
    """Row by row concatenation of parts → (every row's bytes, one after another; each row's length): one 2-D
    concatenate, then (when a part has padding) the used bytes picked in row order by the concatenated mask."""
    block = np.concatenate([part_block for part_block, _ in parts], axis=1)
    if all(mask is None for _, mask in parts):
        return block.ravel(), np.full(len(block), block.shape[1], np.int64)
    mask = np.concatenate([np.ones(b.shape, bool) if m is None else m for b, m in parts], axis=1)
    return block[mask], mask.sum(axis=1, dtype=np.int64)


class _ShardWriter:
    """Records into DIR/part-00000.tfrecord, ...: a new shard once the next record would take this one past
    shard_bytes (a shard holds at least one record)."""

    def __init__(self, directory: Path, shard_bytes: int) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes
        self.paths: list[Path] = []
        self.writer: tf.io.TFRecordWriter | None = None
        self.used = self.total = 0

    def write(self, data: bytes, offsets: np.ndarray) -> None:
        offsets = offsets.tolist()
        for start, end in zip(offsets, offsets[1:]):
            size = end - start + TFRECORD_FRAMING
            if self.writer is None or (self.used and self.used + size > self.shard_bytes):
                self._next()
            self.writer.write(data[start:end])
            self.used += size
            self.total += size

    def _next(self) -> None:
        self.close()
        self.paths.append(self.directory / f"part-{len(self.paths):05d}.tfrecord")
        self.writer, self.used = tf.io.TFRecordWriter(str(self.paths[-1])), 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class _Progress:
    """A log line every PROGRESS_INTERVAL_S (as score's): rows, rows/s, MB/s written, time left."""

    def __init__(self, total: int, shards: _ShardWriter) -> None:
        self.total, self.shards, self.rows = total, shards, 0
        self.start = self._shown = time.perf_counter()

    def __call__(self, rows: int) -> None:
        self.rows += rows
        now = time.perf_counter()
        if now - self._shown >= PROGRESS_INTERVAL_S:
            self._shown = now
            left = (now - self.start) / max(self.rows, 1) * (self.total - self.rows)
            self._log(now - self.start, f", ~{left:.0f} s left")

    def done(self) -> None:
        self._log(time.perf_counter() - self.start, "")

    def _log(self, elapsed: float, left: str) -> None:
        elapsed = max(elapsed, 1e-9)
        log.info("convert: %s/%s rows, %s rows/s, %.1f MB/s written, %d shards%s", f"{self.rows:,}", f"{self.total:,}",
                 f"{self.rows / elapsed:,.0f}", self.shards.total / MB / elapsed, len(self.shards.paths), left)


def print_conversion(result: Conversion) -> None:
    """The conversion in a comment line, then the `data:` section to paste into an experiment (valid YAML whole)."""
    rate = result.rows / max(result.seconds, 1e-9)
    print(f"# converted {result.rows:,} rows from {result.files} Parquet file{'s' if result.files != 1 else ''} "
          f"({result.input_bytes / MB:,.1f} MB) into {result.shards} shard{'s' if result.shards != 1 else ''} "
          f"({result.output_bytes / MB:,.1f} MB) in {result.seconds:.1f} s: {rate:,.0f} rows/s, "
          f"{result.output_bytes / MB / max(result.seconds, 1e-9):,.1f} MB/s written")
    print(f"# the experiment's data section (also in {Path(result.output) / DATA_YAML}):")
    print(data_yaml(result.data), end="")


class _Dumper(yaml.SafeDumper):
    """Block style, but each feature's {dtype, shape} on one line, as the configs write it."""


_Dumper.add_representer(dict, lambda dumper, value: dumper.represent_mapping(
    "tag:yaml.org,2002:map", value, flow_style=set(value) == {"dtype", "shape"} or None))


def data_yaml(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)
