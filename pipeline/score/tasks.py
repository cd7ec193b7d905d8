"""What `pipeline score --input` names, as the job's tasks: each file of rows (shards.py) or group of images
(images.py) one Input, its head checked before the job starts, so a shard of the wrong shape is one line and
nothing is scored. Above both readers, so neither imports the other."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from pipeline.errors import DataError
from pipeline.score import images
from pipeline.score.shards import SUFFIXES, Input, Layout, check_rows_head, expand_files, file_format, tfrecords


def expand(patterns: list[str]) -> list[Input]:
    """The inputs --input names, in order: each file of rows a format known by its suffix (else DataError); a
    folder, or the image files a pattern matches, in tasks of images.IMAGES_PER_TASK files."""
    inputs: list[Input] = []
    seen: set[str] = set()
    for pattern in patterns:
        folder = os.path.isdir(pattern)
        found = [path for path in (images.list_folder(pattern) if folder else expand_files([pattern]))
                 if path not in seen]
        seen.update(found)
        pictures = []
        for path in found:
            suffix = Path(path).suffix.lower()
            if folder or suffix in images.IMAGE_SUFFIXES:
                pictures.append(path)
            elif suffix in SUFFIXES:
                inputs.append(Input(path, file_format(path)))
            else:
                raise DataError(f"--input: {path}: unknown format {suffix or '(no suffix)'}; expected "
                                f"{', '.join(SUFFIXES)}, image files ({', '.join(images.IMAGE_SUFFIXES)}) or a folder "
                                "of images")
        inputs += [Input(pattern, "images", files) for files in images.in_tasks(pictures)]
    return inputs


def check_head(item: Input, layout: Layout) -> Input:
    """The input, its format settled (a tfrecord whose first record holds `image/encoded` is image_records for a
    version that takes images). Raises DataError (one line) when the shard cannot be rows of this model: missing
    columns, an npz without a fitting array, a first tf.Example without the feature or of the wrong shape,
    images for a version that takes none."""
    from pipeline.export.signatures import IMAGE_FEATURE  # lazily: that module loads TensorFlow

    path = item.path
    if item.format == "images" and layout.images is None:
        if os.path.isdir(path):
            raise DataError(f"--input: {path} is a folder, which score reads as images, but {_no_images()}; name "
                            f"files of rows by a glob, e.g. '{os.path.join(path, '*.csv')}'")
        raise DataError(f"--input: {path}: image files, but {_no_images()}")
    first = next(iter(tfrecords(path)), None) if item.format == "tfrecord" else None
    if first is not None and images.holds_image(first):
        if layout.images is None:
            raise DataError(f"{path} record 0: an encoded image ({IMAGE_FEATURE!r}), but {_no_images()}")
        images.check_first_record(path, first)
        return dataclasses.replace(item, format="image_records")
    check_rows_head(item, layout, first)
    return item


def _no_images() -> str:
    from pipeline.export.signatures import IMAGES_SIGNATURE

    return (f"this version takes no images: it has no {IMAGES_SIGNATURE} signature (only a model trained on an image "
            "folder, data.source images, has one)")
