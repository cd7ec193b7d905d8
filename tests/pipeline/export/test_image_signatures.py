"""An image-folder model's export takes the image files' bytes and decodes them exactly as training did."""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.example import example_pb2, feature_pb2

from pipeline.config import load_config
from pipeline.data.images import decode_image
from pipeline.export import export
from pipeline.export.signatures import (CLASSIFY_IMAGES_SIGNATURE, IMAGE_FEATURE, IMAGES_INPUT, IMAGES_SIGNATURE,
                                        SIGNATURE)
from pipeline.train import train
from serving.servable import saved_model
from serving.servable.runner import Runner

IMAGE_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "digits_images.yaml"
SKLEARN_PHOTOS = Path(__import__("sklearn").__file__).parent / "datasets" / "images"


def image_examples(files) -> np.ndarray:
    return np.array([example_pb2.Example(features=feature_pb2.Features(feature={
        IMAGE_FEATURE: feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[contents]))})).SerializeToString()
        for contents in files], dtype=object)


def test_the_files_through_predict_images_are_the_training_decode_through_serving_default(image_export):
    runner = Runner.load(image_export.version_dir, model_name=image_export.model_name)
    files = np.array(image_export.files, dtype=object)
    assert {path.suffix for path in Path(image_export.config.data.path).rglob("*.*")} == {".png", ".jpg"}
    from_bytes = runner.predict({IMAGES_INPUT: files}, IMAGES_SIGNATURE)
    from_rows = runner.predict({image_export.config.data.input_name: image_export.rows})
    assert sorted(from_bytes) == sorted(from_rows) == ["logits", "probabilities"]
    for name in from_rows:
        assert from_bytes[name].dtype == np.float32
        np.testing.assert_array_equal(from_bytes[name], from_rows[name])
    classified = runner.predict({"inputs": image_examples(image_export.files)}, CLASSIFY_IMAGES_SIGNATURE)
    np.testing.assert_array_equal(classified["scores"], from_rows["probabilities"])
    assert classified["classes"][0].tolist() == [str(d).encode() for d in range(10)]


def test_the_parity_gate_and_pipeline_json_record_the_image_signatures(image_export):
    parity = json.loads((image_export.version_dir / "assets.extra" / "parity.json").read_text())
    checked = {(c["path"], c["reference"]): c for c in parity["comparisons"]}
    assert checked[("image_bytes", "saved_model")]["identical"] and checked[("server_images", "saved_model")]["identical"]
    recorded = saved_model.read_pipeline_json(image_export.version_dir)["signatures"]
    assert recorded[IMAGES_SIGNATURE]["inputs"][IMAGES_INPUT] == {
        "dtype": "string", "shape": [None], "content": "encoded JPEG or PNG images, one per row",
        "decoded_to": [8, 8, 1], "min_image_side": 8, "max_image_pixels": 4_194_304}
    assert recorded[IMAGES_SIGNATURE]["outputs"] == recorded[SIGNATURE]["outputs"]
    assert recorded[CLASSIFY_IMAGES_SIGNATURE]["inputs"]["inputs"]["example_feature"] == IMAGE_FEATURE
    assert recorded[CLASSIFY_IMAGES_SIGNATURE]["method_name"] == "tensorflow/serving/classify"


@pytest.mark.parametrize("serving_policy", ["float32", "float16", "bfloat16"])
def test_every_serving_policy_decodes_the_files_as_training_did(image_export, serving_policy, tmp_path):
    cfg = load_config(IMAGE_CONFIG, [*image_export.overrides, f"export.serving_policy={serving_policy}",
                                     f"export.base_path={tmp_path}"])
    version_dir = export(cfg)
    keras.config.set_dtype_policy("float32")
    parity = json.loads((version_dir / "assets.extra" / "parity.json").read_text())
    identical = {c["path"]: c["identical"] for c in parity["comparisons"] if c["reference"] == "saved_model"}
    assert identical["image_bytes"] and identical["server_images"]
    runner = Runner.load(version_dir, model_name=cfg.export.model_name)
    np.testing.assert_array_equal(
        runner.predict({IMAGES_INPUT: np.array(image_export.files, dtype=object)}, IMAGES_SIGNATURE)["probabilities"],
        runner.predict({cfg.data.input_name: image_export.rows})["probabilities"])


def test_full_size_photographs_are_resized_in_the_graph_as_in_training(tmp_path):
    """scikit-learn's two JPEG photographs (427x640), sent whole to an RGB model of 32x48 inputs."""
    photos = {name: (SKLEARN_PHOTOS / f"{name}.jpg").read_bytes() for name in ("china", "flower")}
    for name, contents in photos.items():
        image = tf.io.decode_jpeg(contents)
        for i in range(4):
            crop = tf.image.resize(image[i * 40:i * 40 + 300, i * 60:i * 60 + 450], [60, 90])
            (tmp_path / "photos" / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / "photos" / name / f"{i}.jpg").write_bytes(
                tf.io.encode_jpeg(tf.cast(crop, tf.uint8), quality=90).numpy())
    cfg = load_config(None, ["experiment=photos", "data.source=images", f"data.path={tmp_path / 'photos'}",
                             "data.image_shape=[32, 48, 3]", "data.validation_split=0.25", "model.kind=cnn",
                             "train.epochs=1", "train.batch_size=4", f"train.runs_dir={tmp_path / 'runs'}",
                             f"export.base_path={tmp_path / 'models'}", "export.parity_rows=2",
                             "export.tolerances={mixed_float16: {min_argmax_agreement: 0, max_metric_drop: 100, "
                             "max_rel_diff: 1}}"])
    train(cfg)
    version_dir = export(cfg)
    keras.config.set_dtype_policy("float32")
    runner = Runner.load(version_dir, model_name="photos")
    files = list(photos.values())
    decoded = np.stack([decode_image(tf.constant(contents), (32, 48, 3)).numpy() for contents in files])
    np.testing.assert_array_equal(runner.predict({IMAGES_INPUT: np.array(files, dtype=object)}, IMAGES_SIGNATURE)["logits"],
                                  runner.predict({"features": decoded})["logits"])

