"""Image folders: one sub-folder per class, decoded one file at a time into the model's raw pixels."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from data_files import digits_as_images, load
from pipeline.data import DataError
from pipeline.data.images import decode_image


def test_digits_as_png_files_are_the_digits_pixels_with_their_folders_as_classes(tmp_path):
    pixels, labels = digits_as_images(tmp_path / "digits", per_class=30)
    ds = load("data.source=images", f"data.path={tmp_path / 'digits'}", "data.image_shape=[8, 8, 1]")
    assert ds.spec.label_names == tuple(str(d) for d in range(10)) and ds.spec.num_classes == 10
    assert ds.spec.input_shape == (8, 8, 1) and ds.spec.image_shape == (8, 8, 1)
    assert ds.train_examples + ds.val_examples == 300
    x, y = ds.train.rows()
    assert x.dtype == np.float32 and x.shape[1:] == (8, 8, 1) and x.max() == 255.0  # raw pixels: the model scales
    written = {row.tobytes(): label for row, label in zip(pixels.astype(np.float32), labels)}
    assert all(written[row.tobytes()] == label for row, label in zip(x, y))  # exact: same size, no resize
    assert list(ds.statistics.class_counts) == np.bincount(y).tolist()


def test_a_jpeg_photograph_is_resized_to_the_image_shape(tmp_path):
    from sklearn.datasets import load_sample_images  # two photographs that ship with scikit-learn

    for name, image in zip(("china", "flower"), load_sample_images().images):
        for copy in range(5):
            (tmp_path / "photos" / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / "photos" / name / f"{copy}.jpg").write_bytes(tf.io.encode_jpeg(image, quality=90).numpy())
    ds = load("data.source=images", f"data.path={tmp_path / 'photos'}", "data.image_shape=[64, 96, 3]",
              "data.validation_split=0.3")
    x, y = ds.train.rows()
    assert x.shape[1:] == (64, 96, 3) and 0 <= x.min() and x.max() <= 255
    again = decode_image(tf.constant((tmp_path / "photos" / "china" / "0.jpg").read_bytes()), (64, 96, 3)).numpy()
    assert any(np.array_equal(again, row) for row in x)  # training decodes with the one decode_image


def test_a_file_that_is_not_an_image_is_named_or_counted(tmp_path):
    digits_as_images(tmp_path / "digits", per_class=20)
    (tmp_path / "digits" / "3" / "notes.txt").write_text("not an image")
    (tmp_path / "digits" / "3" / ".DS_Store").write_bytes(b"\0\1")  # hidden: not a record
    with pytest.raises(DataError, match=r"^data\.path: .*digits/3/notes\.txt: not a decodable JPEG, PNG, GIF or BMP "
                                        r"image"):
        load("data.source=images", f"data.path={tmp_path / 'digits'}", "data.image_shape=[8, 8, 1]")
    ds = load("data.source=images", f"data.path={tmp_path / 'digits'}", "data.image_shape=[8, 8, 1]",
              "data.max_bad_records=1")
    assert ds.train_examples + ds.val_examples == 200
    [bad] = ds.statistics.bad_records
    assert bad["file"].endswith("digits/3/notes.txt")
    assert sum(len(y) for _, y in ds.train_dataset(32, 100, seed=1)) == ds.train_examples  # left out of epochs too
    first = sorted((tmp_path / "digits" / "5").iterdir())[0]
    (tmp_path / "digits" / "5" / "0000-cut.png").write_bytes(first.read_bytes()[:40])  # its folder's first file
    ds = load("data.source=images", f"data.path={tmp_path / 'digits'}", "data.image_shape=[8, 8, 1]",
              "data.max_bad_records=2")
    assert sorted(Path(b["file"]).name for b in ds.statistics.bad_records) == ["0000-cut.png", "notes.txt"]


@pytest.mark.parametrize("layout, message", [
    (lambda root: root.mkdir(), r"data\.path: .*empty holds no class folders"),
    (lambda root: (root / "cat").mkdir(parents=True), r"data\.path: .*empty/cat holds no files"),
])
def test_a_folder_without_class_folders_or_images_is_one_line(tmp_path, layout, message):
    layout(tmp_path / "empty")
    with pytest.raises(DataError, match=message):
        load("data.source=images", f"data.path={tmp_path / 'empty'}", "data.image_shape=[8, 8, 1]")


def test_the_validation_folder_needs_the_same_classes(tmp_path):
    digits_as_images(tmp_path / "train", per_class=10)
    digits_as_images(tmp_path / "val", per_class=3)
    ds = load("data.source=images", f"data.path={tmp_path / 'train'}", f"data.validation_path={tmp_path / 'val'}",
              "data.image_shape=[8, 8, 1]")
    assert (ds.train_examples, ds.val_examples) == (100, 30)
    (tmp_path / "val" / "extra").mkdir()
    (tmp_path / "val" / "extra" / "x.png").write_bytes((tmp_path / "val" / "1").iterdir().__next__().read_bytes())
    with pytest.raises(DataError, match=r"data\.validation_path: .*its class folders \(0, 1, .*, extra\) differ"):
        load("data.source=images", f"data.path={tmp_path / 'train'}", f"data.validation_path={tmp_path / 'val'}",
             "data.image_shape=[8, 8, 1]")
