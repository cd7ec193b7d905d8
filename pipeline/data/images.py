"""Image folders: JPEG or PNG files in one sub-folder per class, decoded lazily, one file at a time.

    data/flowers/            data.path (data.validation_path: another folder with the same class folders)
      daisy/001.jpg ...      class 0 ('daisy': data.label_names default to the folder names, sorted)
      tulip/xyz.png ...      class 1

Each file is decoded, converted to data.image_shape's channels, resized to its height and width, and kept as
float32 pixel values 0..255: scaling lives in the model (its standardisation), so serving takes the same raw
pixels. decode_image is the one function that turns an encoded image into the model's input. Files are read in
groups of IMAGES_PER_SHARD (the shards of this source, shuffled and split among workers like TFRecord files);
hidden files (.DS_Store) are skipped, any other file must be an image.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline.config import DataConfig
from pipeline.data.shards import error_text
from pipeline.errors import DataError

IMAGES_PER_SHARD = 256
ENCODINGS = "JPEG, PNG, GIF or BMP"


def decode_image(contents: tf.Tensor, image_shape: tuple[int, int, int]) -> tf.Tensor:
    """Encoded bytes → float32 [height, width, channels], pixel values 0..255 (bilinear resize, antialiased
    when shrinking; an image already of that size keeps its exact pixels)."""
    height, width, channels = image_shape
    image = tf.io.decode_image(contents, channels=channels, dtype=tf.uint8, expand_animations=False)
    image = tf.cast(image, tf.float32)
    same = tf.logical_and(tf.equal(tf.shape(image)[0], height), tf.equal(tf.shape(image)[1], width))
    image = tf.cond(same, lambda: image,
                    lambda: tf.image.resize(image, [height, width], method="bilinear", antialias=True))
    return tf.ensure_shape(image, [height, width, channels])


def list_images(root: str, key: str) -> tuple[list[str], list[int], list[str]]:
    """(files, class ids, class names): every non-hidden file below each class folder of root, sorted."""
    folder = Path(root)
    if not folder.is_dir():
        raise DataError(f"{key}: {root} is not a folder; data.source 'images' reads a folder with one sub-folder "
                        "of images per class; this pipeline never downloads data")
    classes = sorted(entry.name for entry in folder.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise DataError(f"{key}: {root} holds no class folders; put each class's images in a sub-folder named "
                        "after the class")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(_files(folder / name))
        if not found:
            raise DataError(f"{key}: {folder / name} holds no files; every class folder needs images")
        files += found
        labels += [label] * len(found)
    return files, labels, classes


def _files(folder: Path) -> list[str]:
    found = []
    for parent, directories, names in os.walk(folder):
        directories[:] = [d for d in directories if not d.startswith(".")]
        found += [os.path.join(parent, name) for name in names if not name.startswith(".")]
    return found


class ImageFormat:
    noun = ""  # the image's own file names the record
    column_noun = "file"
    per_record = True  # images of different sizes: decoded one at a time, before batching
    feature_names = ()

    def __init__(self, config: DataConfig) -> None:
        self.image_shape = tuple(config.image_shape)
        self.row_shape = self.image_shape
        self.tokens = False

    def check_head(self, path: str, key: str) -> None:
        """The file decodes as an image."""
        problem = self.diagnose((Path(path).read_bytes(), 0))
        if problem is not None:
            raise DataError(f"{key}: {path}: {problem[1]}")

    def records(self, payload) -> tf.data.Dataset:
        paths, labels = (part if isinstance(part, tf.Tensor) else tf.constant(list(part)) for part in payload)
        return tf.data.Dataset.from_tensor_slices((paths, tf.cast(labels, tf.int64))).map(
            lambda path, label: (tf.io.read_file(path), label))

    def decode(self, contents, label):
        return decode_image(contents, self.image_shape), label

    def diagnose(self, record) -> tuple[str | None, str] | None:
        contents, _ = record
        if not contents:
            return None, "an empty file, not an image"
        try:
            decode_image(tf.constant(contents), self.image_shape).numpy()
        except (tf.errors.InvalidArgumentError, ValueError) as error:
            return None, f"not a decodable {ENCODINGS} image ({error_text(error)})"
        return None

    def damaged_file(self, path: str, key: str) -> DataError:
        return DataError(f"{key}: {path}: cannot be read")


def shard_files(files: list[str], labels: list[int]) -> list[tuple[list[str], list[int]]]:
    """The files in groups of IMAGES_PER_SHARD, classes mixed (a fixed permutation, the same on every machine)."""
    order = np.random.default_rng(0).permutation(len(files))
    return [([files[i] for i in chunk], [labels[i] for i in chunk])
            for chunk in np.array_split(order, max(1, -(-len(files) // IMAGES_PER_SHARD)))]
