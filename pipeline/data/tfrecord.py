"""tf.Example records in TFRecord files (a glob of shards), parsed with data.feature_spec.

The features are flattened and concatenated in the spec's order; the label is data.label (an int64 class id, or a
float target for regression). With data.vocab_size the one feature is a list of token ids of any length.
Records are parsed in batches (tf.io.parse_example is ~7x faster than one record at a time); a record that does
not fit the spec is named by diagnose, which reads it alone.
"""

from __future__ import annotations

import math
import os

import tensorflow as tf

from pipeline.config import DataConfig
from pipeline.errors import DataError

_LIST_KIND = {tf.float32: "float_list", tf.int64: "int64_list"}


class TFRecordFormat:
    noun = "record"  # "data.path: train-0.tfrecord record 7"
    column_noun = "feature"
    per_record = False  # decoded a batch at a time

    def __init__(self, config: DataConfig) -> None:
        self.label = config.label
        self.tokens = config.vocab_size is not None
        self.feature_names_in_spec = list(config.feature_spec)
        label_dtype = tf.int64 if config.task == "classification" else tf.float32
        if self.tokens:  # one int64 feature, a list of any length per record
            self.parse_spec = {name: tf.io.VarLenFeature(tf.int64) for name in config.feature_spec}
        else:
            self.parse_spec = {name: tf.io.FixedLenFeature(feature.shape, tf.dtypes.as_dtype(feature.dtype))
                               for name, feature in config.feature_spec.items()}
        self.parse_spec[config.label] = tf.io.FixedLenFeature([], label_dtype)
        shapes = [tuple(feature.shape) for feature in config.feature_spec.values()]
        self.row_shape = (None,) if self.tokens else (sum(math.prod(shape) for shape in shapes),)
        self.image_shape = None
        if not self.tokens and len(shapes) == 1:
            shape = shapes[0]
            self.image_shape = shape if len(shape) == 3 else (*shape, 1) if len(shape) == 2 else None
        self.feature_names = () if self.tokens else tuple(
            name if math.prod(feature.shape) == 1 else f"{name}[{i}]"
            for name, feature in config.feature_spec.items() for i in range(math.prod(feature.shape)))

    def check_head(self, path: str, key: str) -> None:
        """The file is a non-empty TFRecord whose first record fits the spec."""
        if os.path.getsize(path) == 0:
            raise DataError(f"{key}: {path} is empty (0 bytes): no records")
        try:
            first = next(iter(tf.data.TFRecordDataset(path).take(1)), None)
        except (tf.errors.DataLossError, tf.errors.OutOfRangeError):
            first = None
        if first is None:  # the header alone is damaged
            count_tfrecords(path, key)
            raise DataError(f"{key}: {path}: no complete record")
        problem = self.diagnose(first.numpy())
        if problem is not None:
            column, reason = problem
            raise DataError(f"{key}: {path} record 0{f', feature {column!r}' if column else ''}: {reason}")

    def records(self, path: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TFRecordDataset(path)

    def decode(self, records: tf.Tensor):
        """A batch of serialized tf.Examples → (features float32 [n, width] (token ids: ragged), labels [n])."""
        parsed = tf.io.parse_example(records, self.parse_spec)
        label = parsed.pop(self.label)
        if self.tokens:
            [ids] = parsed.values()
            return tf.cast(tf.RaggedTensor.from_sparse(ids), tf.float32), label
        n = tf.shape(records)[0]
        parts = [tf.reshape(tf.cast(parsed[name], tf.float32), [n, -1]) for name in self.feature_names_in_spec]
        return tf.concat(parts, axis=1), label

    def diagnose(self, serialized: bytes) -> tuple[str | None, str] | None:
        """(feature, why) the record does not fit the spec, or None when it does."""
        try:
            example = tf.train.Example.FromString(serialized)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            return None, "not a serialized tf.train.Example"
        features = example.features.feature
        for name, feature_spec in self.parse_spec.items():
            any_length = isinstance(feature_spec, tf.io.VarLenFeature)  # token ids
            size = None if any_length else math.prod(feature_spec.shape)
            expected = (f"{_LIST_KIND[feature_spec.dtype]} of token ids (any length)" if any_length else
                        f"{_LIST_KIND[feature_spec.dtype]} of {size} value{'s' if size != 1 else ''} "
                        f"(shape {list(feature_spec.shape)})")
            if name not in features:
                return None, f"no feature {name!r} (has {', '.join(sorted(features)) or 'none'}); expected {expected}"
            kind = features[name].WhichOneof("kind")
            count = len(getattr(features[name], kind).value) if kind else 0
            if kind != _LIST_KIND[feature_spec.dtype] or (size is not None and count != size):
                hint = ""
                if name == self.label and kind != _LIST_KIND[feature_spec.dtype]:
                    hint = ("; classification labels are int64 class ids (set data.task: regression for real-valued "
                            "targets)" if feature_spec.dtype == tf.int64 else "; regression targets are float_list values")
                held = f"{kind} of {count} value{'s' if count != 1 else ''}" if kind else "no values"
                return name, f"holds {held}; expected {expected}{hint}"
        return None

    def damaged_file(self, path: str, key: str) -> DataError:
        """The error for a file TensorFlow's reader stopped in (a truncated or corrupt TFRecord)."""
        try:
            count_tfrecords(path, key)
        except DataError as error:
            return error
        return DataError(f"{key}: {path}: TensorFlow cannot read it as an uncompressed TFRecord file")


# A TFRecord is records of: length (uint64, little-endian), its masked CRC (4 bytes), the data, the data's CRC
# (4 bytes). https://www.tensorflow.org/tutorials/load_data/tfrecord#tfrecords_format_details
_TFRECORD_HEADER, _TFRECORD_FOOTER = 12, 4


def count_tfrecords(file: str, key: str) -> int:
    """The complete records in a TFRecord file, from its framing alone (headers only, no data is read).

    A cut inside a record (a half-copied file), an empty file or a file that is not a TFRecord is one DataError
    naming the file and the records it holds. A cut exactly between two records leaves a valid, shorter file that
    no reader can tell apart (train logs the records read per file).
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
