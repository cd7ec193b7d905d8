"""Image inputs for `pipeline score`: each row an encoded JPEG or PNG, sent as bytes to the version's predict_images.

Nothing here decodes an image: the bytes go to the version's predict_images signature, which checks each header
against the limits pipeline.json records and decodes in the graph with the training pipeline's decode_image
(pipeline/data/encoded_images.py), so a scored image is what a client sending the file would be answered.
Three inputs hold images:

    a folder       every non-hidden file in it and below it (class sub-folders as training reads them, or a flat
                   folder of files), sorted by path, in tasks of IMAGES_PER_TASK files; a row is named by its file
    image files    the IMAGE_SUFFIXES files a glob matches, likewise
    .tfrecord      tf.Examples holding one encoded image in the bytes feature `image/encoded` (TF Model Garden's
                   image data, the classify_images contract); a row is named by its file and record index

A row predict_images refuses (a file that is not an image, a header declaring too many pixels, a body that does
not decode) is a bad row of a kind named by the header check's own reasons (refusal_kinds), never fatal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.errors import DataError
from pipeline.score.shards import RAW_LIMIT, BadRow, tfrecords

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")  # image files named by a glob (in a folder every file is an image)
IMAGES_PER_TASK = 1024  # image files per task and predictions part
NOT_DECODABLE = "not_decodable"  # the header passed the checks, the decode did not


@dataclasses.dataclass
class Batch:
    """Up to batch_size image rows: their bytes (an object array, predict_images' input), where each came from
    (file, record) and the rows that could not even be read."""

    values: np.ndarray
    sources: list[str]
    rows: np.ndarray  # int64: the record index in a TFRecord file, 0 for an image file
    bad: list[BadRow]


def list_folder(folder: str) -> list[str]:
    """Every non-hidden file below folder (hidden folders skipped, as training skips them), sorted by path.

    Raises:
        DataError: the folder holds no file.
    """
    found = []
    for parent, directories, names in os.walk(folder):
        directories[:] = [d for d in directories if not d.startswith(".")]
        found += [os.path.join(parent, name) for name in names if not name.startswith(".")]
    if not found:
        raise DataError(f"--input: {folder} is a folder without files; score reads a folder as images (one per "
                        "file, in class sub-folders or not)")
    return sorted(found)


def in_tasks(files: list[str]) -> list[tuple[str, ...]]:
    return [tuple(files[i:i + IMAGES_PER_TASK]) for i in range(0, len(files), IMAGES_PER_TASK)]


def holds_image(record: bytes) -> bool:
    """Whether a TFRecord's record is a tf.Example with an `image/encoded` feature (of any kind)."""
    from google.protobuf.message import DecodeError
    from tensorflow.core.example import example_pb2

    from pipeline.export.signatures import IMAGE_FEATURE

    try:
        return IMAGE_FEATURE in example_pb2.Example.FromString(record).features.feature
    except DecodeError:
        return False


def check_first_record(path: str, record: bytes) -> None:
    """Raises DataError when a TFRecord file's first record holds `image/encoded` but not one encoded image."""
    _, problem = _example_image(record)
    if problem is not None:
        raise DataError(f"{path} record 0: {problem.message}; every record of a shard of images must hold "
                        f"{_feature_text()}")


def file_batches(files: tuple[str, ...], batch_size: int) -> Iterator[Batch]:
    """Image files read batch_size at a time (so a task holds one batch of files in memory), unreadable ones
    set aside."""
    for start in range(0, len(files), batch_size):
        values, sources, bad = [], [], []
        for path in files[start:start + batch_size]:
            try:
                values.append(Path(path).read_bytes())
            except OSError as error:
                bad.append(BadRow(0, "unreadable", f"cannot be read: {error.strerror or error}", source=path))
                continue
            sources.append(path)
        yield Batch(_objects(values), sources, np.zeros(len(values), np.int64), bad)


def record_batches(path: str, batch_size: int) -> Iterator[Batch]:
    """A TFRecord file's images batch_size records at a time, records without one image set aside."""
    values, rows, bad = [], [], []
    for number, record in enumerate(tfrecords(path)):
        image, problem = _example_image(record)
        if problem is not None:
            bad.append(dataclasses.replace(problem, row=number))
            continue
        values.append(image)
        rows.append(number)
        if len(values) == batch_size:
            yield Batch(_objects(values), [path] * len(values), np.asarray(rows, np.int64), bad)
            values, rows, bad = [], [], []
    yield Batch(_objects(values), [path] * len(values), np.asarray(rows, np.int64), bad)


def refusal_kinds(images: np.ndarray, min_side: int, max_pixels: int) -> list[str]:
    """Why predict_images refused each of these images, by its own header check (encoded_images.refusals, with
    the limits pipeline.json records): empty, not_an_image, damaged_header, too_small, too_large; not_decodable
    for an image whose header passed (a truncated or corrupt body)."""
    import tensorflow as tf

    from pipeline.data import encoded_images

    if not len(images):
        return []
    reasons, _, _ = encoded_images.refusals(tf.constant(list(images), tf.string), min_side, max_pixels)
    return [encoded_images.REFUSAL_NAMES.get(int(reason), NOT_DECODABLE) for reason in reasons.numpy()]


def raw(image: bytes) -> str:
    """A refused image's first bytes in hex, for the bad-rows file (its header shows what it is)."""
    return image[:RAW_LIMIT // 2].hex()


def _example_image(record: bytes) -> tuple[bytes | None, BadRow | None]:
    """One tf.Example's encoded image, or why it has none."""
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError
    from tensorflow.core.example import example_pb2

    from pipeline.export.signatures import IMAGE_FEATURE

    try:
        example = example_pb2.Example.FromString(record)
    except DecodeError:
        return None, BadRow(0, "not_an_example", "not a serialized tf.train.Example", record[:RAW_LIMIT // 2].hex())
    features = example.features.feature
    if IMAGE_FEATURE not in features:
        shown = ", ".join(sorted(features)[:12]) or "none"
        return None, BadRow(0, "missing_feature", f"no feature {IMAGE_FEATURE!r} (has {shown})",
                            text_format.MessageToString(example, as_one_line=True)[:RAW_LIMIT])
    feature = features[IMAGE_FEATURE]
    kind = feature.WhichOneof("kind")
    if kind != "bytes_list" or len(feature.bytes_list.value) != 1:
        held = getattr(feature, kind).value if kind else ()
        what = f"{kind} of {len(held)} values" if kind else "no values"
        return None, BadRow(0, "wrong_shape", f"feature {IMAGE_FEATURE!r} holds {what}; expected {_feature_text()}",
                            raw(record))
    return feature.bytes_list.value[0], None


def _feature_text() -> str:
    from pipeline.data.encoded_images import SERVED_ENCODINGS
    from pipeline.export.signatures import IMAGE_FEATURE

    return f"one encoded {SERVED_ENCODINGS} image as the bytes feature {IMAGE_FEATURE!r}"


def _objects(values: list[bytes]) -> np.ndarray:
    """bytes as an object array: a fixed-width bytes array would drop an image's trailing NUL bytes."""
    array = np.empty(len(values), object)
    array[:] = values
    return array
