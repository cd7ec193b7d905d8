"""pipeline score with images: an image folder and TFRecords of `image/encoded` through predict_images, in process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.dataset as pa_dataset
import pytest
import tensorflow as tf

from pipeline import cli
from pipeline.data.image_probes import png_header
from pipeline.export.signatures import IMAGE_FEATURE, IMAGES_INPUT, IMAGES_SIGNATURE
from pipeline.score import images, score
from serving.servable.runner import Runner

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def runner(image_model):
    loaded = Runner.load(image_model.version_dir)
    yield loaded
    loaded.close()


def answers(runner: Runner, files: list[bytes], batch: int) -> dict[str, np.ndarray]:
    """predict_images' answers for the files in calls of `batch`: score must give exactly these."""
    parts = [runner.predict({IMAGES_INPUT: np.array(files[i:i + batch] + [b""], object)[:-1]}, IMAGES_SIGNATURE)
             for i in range(0, len(files), batch)]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def column(table, name: str) -> np.ndarray:
    return np.array(table.column(name).to_pylist(), np.float32)


def bad_rows(output: Path) -> list[dict]:
    return [json.loads(line) for part in sorted((output / "bad_rows").glob("*.jsonl"))
            for line in part.read_text().splitlines()]


def image_example(contents, **more: tf.train.Feature) -> bytes:
    """A tf.Example as TF Model Garden writes image data: image/encoded (bytes), image/format, image/class/label."""
    values = contents if isinstance(contents, list) else [contents]
    feature = {IMAGE_FEATURE: tf.train.Feature(bytes_list=tf.train.BytesList(value=values)),
               "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"png"])), **more}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_records(path: Path, records: list[bytes]) -> Path:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def test_a_class_folder_is_scored_file_by_file_exactly_as_predict_images_answers(image_model, runner, tmp_path, capsys):
    output = tmp_path / "scored"
    assert cli.main(["score", str(image_model.base_path), "--input", str(image_model.folder), "--output", str(output),
                     "--batch_size", "100"]) == 0
    out = capsys.readouterr().out
    files = sorted(str(path) for path in image_model.folder.rglob("*") if path.is_file())
    assert f"scored {len(files):,} of {len(files):,} rows" in out and "bad rows: 0" in out
    summary = json.loads((output / "summary.json").read_text())
    assert [shard["image_files"] for shard in summary["shards"]] == \
        [len(task) for task in images.in_tasks(files)]  # tasks of IMAGES_PER_TASK files, each its own part
    table = pa_dataset.dataset(output / "predictions", format="parquet").to_table()
    assert table.column_names == ["source", "row", "label", "logits", "probabilities"]
    assert table.column("source").to_pylist() == files and set(table.column("row").to_pylist()) == {0}
    contents = [Path(path).read_bytes() for path in files]
    want = {name: np.concatenate([answers(runner, contents[i:i + images.IMAGES_PER_TASK], 100)[name]
                                  for i in range(0, len(files), images.IMAGES_PER_TASK)]) for name in ("logits", "probabilities")}
    for name in ("logits", "probabilities"):
        np.testing.assert_array_equal(column(table, name), want[name])
    labels = table.column("label").to_pylist()
    assert labels == [str(i) for i in want["probabilities"].argmax(-1)]
    folders = [Path(path).parent.name for path in files]  # the class folder: the digit
    assert np.mean([label == folder for label, folder in zip(labels, folders)]) > 0.5


def test_files_that_are_not_images_are_bad_rows_by_kind_and_photographs_are_scored(image_model, runner, photographs,
                                                                                    tmp_path):
    folder = tmp_path / "inbox"
    folder.mkdir()
    digits = sorted(image_model.folder.rglob("*.png"))[:12]
    for path in digits:
        shutil.copy(path, folder / path.name)
    for name, contents in photographs.items():
        (folder / name).write_bytes(contents)
    hostile = {
        "notes.txt": b"not an image\n",
        "empty.png": b"",
        "truncated.png": digits[0].read_bytes()[:60],  # a whole header, half a body: its chunks run past the end
        "truncated.jpg": photographs["china.jpg"][:20_000],  # a sound header, then the data stops
        "bomb.png": png_header(30_000, 30_000, color_type=0),  # 900 megapixels declared in 33 bytes
        "tiny.png": tf.io.encode_png(np.zeros((2, 2, 1), np.uint8)).numpy(),
        "damaged.jpg": b"\xff\xd8\xff\xe0\x00\x10JFIF" + b"\x00" * 40,
    }
    for name, contents in hostile.items():
        (folder / name).write_bytes(contents)
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")  # hidden: skipped, as training skips it
    summary = score(image_model.version_dir, [str(folder)], tmp_path / "scored", batch_size=8)
    assert summary["rows"] == 12 + 2 + 7 and summary["scored"] == 14
    assert summary["bad_rows_by_kind"] == {"not_an_image": 1, "empty": 1, "not_decodable": 1, "too_large": 1,
                                           "too_small": 1, "damaged_header": 2}
    bad = {Path(row["source"]).name: row for row in bad_rows(tmp_path / "scored")}
    assert {name: row["kind"] for name, row in bad.items()} == {
        "notes.txt": "not_an_image", "empty.png": "empty", "truncated.png": "damaged_header",
        "truncated.jpg": "not_decodable", "bomb.png": "too_large", "tiny.png": "too_small", "damaged.jpg": "damaged_header"}
    limits = runner.metadata["signatures"][IMAGES_SIGNATURE]["inputs"][IMAGES_INPUT]
    assert f"30000x30000 pixels, more than the {limits['max_image_pixels']}" in bad["bomb.png"]["message"]
    assert "not a JPEG or PNG image" in bad["notes.txt"]["message"] and bad["notes.txt"]["raw"] == b"not an image\n".hex()
    table = pa_dataset.dataset(tmp_path / "scored" / "predictions", format="parquet").to_table()
    scored = [Path(source).name for source in table.column("source").to_pylist()]
    assert sorted(scored) == sorted([path.name for path in digits] + list(photographs))
    alone = answers(runner, [(folder / name).read_bytes() for name in scored], 1)  # split batches: other sizes
    np.testing.assert_allclose(column(table, "probabilities"), alone["probabilities"], atol=1e-3)


def test_tfrecords_of_encoded_images_are_scored_by_file_and_record(image_model, runner, tmp_path):
    files = [path.read_bytes() for path in sorted(image_model.folder.rglob("*.*"))[:30]]
    label = tf.train.Feature(int64_list=tf.train.Int64List(value=[3]))
    records = [image_example(contents, **{"image/class/label": label}) for contents in files]
    records += [b"not an example", tf.train.Example().SerializeToString(), image_example(b"GIF89a not served"),
                image_example([files[0], files[1]])]
    path = write_records(tmp_path / "val-00000-of-00001.tfrecord", records)
    summary = score(image_model.version_dir, [str(path)], tmp_path / "scored", batch_size=10)
    assert summary["scored"] == 30 and summary["bad_rows_by_kind"] == {
        "not_an_example": 1, "missing_feature": 1, "not_an_image": 1, "wrong_shape": 1}
    assert [(row["row"], row["kind"]) for row in bad_rows(tmp_path / "scored")] == [
        (30, "not_an_example"), (31, "missing_feature"), (32, "not_an_image"), (33, "wrong_shape")]
    table = pa_dataset.dataset(tmp_path / "scored" / "predictions", format="parquet").to_table()
    assert set(table.column("source").to_pylist()) == {str(path)} and table.column("row").to_pylist() == list(range(30))
    want = answers(runner, files, 10)
    for name in ("logits", "probabilities"):
        np.testing.assert_array_equal(column(table, name), want[name])


def test_an_image_model_still_scores_rows_of_pixels(image_model, runner, tmp_path):
    from pipeline.data import load_datasets

    config = image_model.config
    files, rows, _ = load_datasets(config.data, config.seed, config.run_dir / "data").val.encoded_rows(40)
    np.savez(tmp_path / "pixels.npz", features=rows)
    score(image_model.version_dir, [str(tmp_path / "pixels.npz")], tmp_path / "scored", batch_size=40)
    table = pa_dataset.dataset(tmp_path / "scored" / "predictions", format="parquet").to_table()
    np.testing.assert_array_equal(column(table, "probabilities"), answers(runner, files, 40)["probabilities"])


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "folder", "folder is a folder, which score reads as images, but this version takes no images: it "
                             "has no predict_images signature (only a model trained on an image folder, data.source "
                             "images, has one); name files of rows by a glob, e.g. '"),
    (lambda d: d / "folder" / "*.png", "image files, but this version takes no images"),
    (lambda d: write_records(d / "images.tfrecord", [image_example(b"\x89PNG")]),
     "images.tfrecord record 0: an encoded image ('image/encoded'), but this version takes no images"),
])
def test_images_for_a_model_that_takes_none_are_one_line_exit_2(exported_model, tmp_path, capsys, make, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.png").write_bytes(tf.io.encode_png(np.zeros((8, 8, 1), np.uint8)).numpy())
    output = tmp_path / "out"
    code = cli.main(["score", str(exported_model.version_dir), "--input", str(make(tmp_path)), "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not output.exists()


@pytest.mark.parametrize("make, message", [
    (lambda d: write_records(d / "ints.tfrecord", [tf.train.Example(features=tf.train.Features(feature={
        IMAGE_FEATURE: tf.train.Feature(int64_list=tf.train.Int64List(value=[7]))})).SerializeToString()]),
     "ints.tfrecord record 0: feature 'image/encoded' holds int64_list of 1 values; expected one encoded JPEG or PNG "
     "image as the bytes feature 'image/encoded'"),
    (lambda d: write_records(d / "other.tfrecord", [tf.train.Example().SerializeToString()]),
     "other.tfrecord record 0: no feature 'features' (has none); every record of a shard must hold feature "
     "'features' with 64 numbers (or, for images, an encoded image as the bytes feature 'image/encoded')"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "empty is a folder without files"),
])
def test_image_inputs_that_cannot_be_scored_are_one_line_exit_2(image_model, tmp_path, capsys, make, message):
    output = tmp_path / "out"
    code = cli.main(["score", str(image_model.version_dir), "--input", str(make(tmp_path)), "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not output.exists()
