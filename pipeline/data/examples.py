"""Example data in the forms users' data arrives in, written from scikit-learn's digits (no download): a folder of
image files per class (PNG and JPEG, as photographs and scans arrive) and a directory of CSV shards.
`python -m pipeline example-data DIR` writes them, so the streamed sources can be tried end to end on a fresh
machine (configs/digits_images.yaml, configs/digits_csv.yaml).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pipeline import artifacts

log = logging.getLogger(__name__)

IMAGES_DIR, CSV_DIR = "digits-images", "digits-csv"
CSV_SHARDS = 4


def write_examples(root: str | Path) -> tuple[Path, Path]:
    """Writes ROOT/digits-images/<digit>/<index>.png or .jpg (8x8 greyscale, pixel values 0..255; every other
    digit a JPEG of quality 95) and
    ROOT/digits-csv/part-0000N.csv (64 pixel columns and a label); each directory appears whole or not at all."""
    from sklearn.datasets import load_digits  # ships inside scikit-learn: no download

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    root = Path(root)
    images, table = root / IMAGES_DIR, root / CSV_DIR
    with artifacts.atomic_dir(images, replace=True) as tmp:
        _write_images(tmp, pixels, digits.target)
    with artifacts.atomic_dir(table, replace=True) as tmp:
        _write_csv_shards(tmp, pixels.reshape(len(pixels), -1), digits.target)
    log.info("wrote %d digits as PNG and JPEG files in %s and as %d CSV shards in %s", len(pixels), images,
             CSV_SHARDS, table)
    return images, table


def _write_images(folder: Path, pixels: np.ndarray, labels: np.ndarray) -> None:
    import tensorflow as tf

    for i, (image, label) in enumerate(zip(pixels, labels)):
        (folder / str(label)).mkdir(exist_ok=True)
        if i % 2:
            (folder / str(label) / f"{i:04d}.jpg").write_bytes(tf.io.encode_jpeg(image[..., None], quality=95).numpy())
        else:
            (folder / str(label) / f"{i:04d}.png").write_bytes(tf.io.encode_png(image[..., None]).numpy())


def _write_csv_shards(folder: Path, rows: np.ndarray, labels: np.ndarray) -> None:
    header = ",".join([*(f"pixel_{j}" for j in range(rows.shape[1])), "label"]) + "\n"
    for shard, part in enumerate(np.array_split(np.arange(len(rows)), CSV_SHARDS)):
        lines = "".join(",".join(map(str, [*rows[i], labels[i]])) + "\n" for i in part)
        (folder / f"part-{shard:05d}.csv").write_text(header + lines)
