"""pipeline audit with images: logged predict_images and classify_images requests replayed through the float32 twin,
which has the image signatures (the served version's limits, the training pipeline's decode)."""

from __future__ import annotations


import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2, prediction_service_pb2_grpc

from pipeline.audit import audit
from pipeline.export.signatures import CLASSIFY_IMAGES_SIGNATURE, IMAGE_FEATURE, IMAGES_INPUT, IMAGES_SIGNATURE
from serving.client import grpc_client
from serving.servable import tensors
from serving.servable.runner import Runner

pytestmark = pytest.mark.timeout(300)


def image_examples(files: list[bytes]) -> list:
    return [tf.train.Example(features=tf.train.Features(feature={
        IMAGE_FEATURE: tf.train.Feature(bytes_list=tf.train.BytesList(value=[contents]))})) for contents in files]


@pytest.fixture(scope="module")
def served_images(image_model, log_server, photographs, tmp_path_factory):
    """The image model served with every request logged: 64 validation image files through predict_images in
    requests of 16, the two photographs in one, 8 files through classify_images and 16 rows of pixels through
    serving_default."""
    root = tmp_path_factory.mktemp("audit-images")
    model = image_model
    files = [path.read_bytes() for path in sorted(model.folder.rglob("*.*"))[:64]]
    logged_server, _ = log_server
    (root / "logs").mkdir()
    with logged_server(model.base_path, model.model_name, root / "logs") as address, \
            grpc.insecure_channel(address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for start in range(0, len(files), 16):
            stub.Predict(grpc_client.predict_request(model.model_name, {IMAGES_INPUT: np.array(
                files[start:start + 16] + [b""], object)[:-1]}, IMAGES_SIGNATURE), timeout=60)
        stub.Predict(grpc_client.predict_request(model.model_name, {IMAGES_INPUT: np.array(
            list(photographs.values()), object)}, IMAGES_SIGNATURE), timeout=60)
        stub.Classify(grpc_client.classify_request(model.model_name, image_examples(files[:8]),
                                                   CLASSIFY_IMAGES_SIGNATURE), timeout=60)
        pixels = tf.cast(tf.stack([tf.io.decode_image(contents, channels=1) for contents in files[:16]]), tf.float32)
        stub.Predict(grpc_client.predict_request(model.model_name, {"features": pixels.numpy()}), timeout=60)
    [log] = (root / "logs").glob("*.tfrecord")
    return model, log


def test_logged_image_requests_replay_through_the_float32_twins_image_signatures(served_images, tmp_path):
    model, log = served_images
    found = audit(model.base_path, [str(log)], output=tmp_path / "audit")
    version = found["versions"]["1"]
    assert found["ok"] and found["requests"] == 4 + 1 + 1 + 1 and not found["skipped"]
    assert version["outputs"]["probabilities"]["rows"] == 64 + 2 + 16  # predict_images and serving_default
    assert version["outputs"]["scores"]["rows"] == 8  # classify_images
    assert version["outputs"]["probabilities"]["max_abs_diff"] > 0  # float16 served, float32 replayed
    reference = Runner.load(tmp_path / "audit" / "reference" / model.model_name / "1")
    assert {IMAGES_SIGNATURE, CLASSIFY_IMAGES_SIGNATURE} <= set(reference.signature_names)
    reference.close()


def test_against_the_served_policy_the_image_requests_are_answered_identically(served_images, tmp_path):
    model, log = served_images
    found = audit(model.base_path, [str(log)], against="mixed_float16", output=tmp_path / "audit")
    assert found["ok"] and found["requests"] == 7
    assert all(o["max_abs_diff"] == 0 for o in found["versions"]["1"]["outputs"].values())


def test_a_logged_image_the_reference_refuses_is_left_out_not_the_requests_merged_with_it(served_images, tmp_path):
    """A log the server did not write (TF Serving's, or edited): its refused request is counted as not replayed;
    the requests merged with it into one reference call are still compared."""
    model, log = served_images
    records = [prediction_log_pb2.PredictionLog.FromString(raw) for raw in tf.data.TFRecordDataset(str(log))
               .take(3).as_numpy_iterator()]
    request = records[1].predict_log.request.inputs[IMAGES_INPUT]
    images = tensors.to_ndarray(request, IMAGES_INPUT)
    images[5] = b"not an image"
    request.CopyFrom(grpc_client.predict_request(model.model_name, {IMAGES_INPUT: images}, IMAGES_SIGNATURE)
                     .inputs[IMAGES_INPUT])
    edited = tmp_path / "edited.tfrecord"
    with tf.io.TFRecordWriter(str(edited)) as writer:
        for record in records:
            writer.write(record.SerializeToString())
    found = audit(model.base_path, [str(edited)], output=tmp_path / "audit")
    assert found["requests"] == 2 and found["skipped"] == {"refused by the reference: InputError": 1}
    assert found["versions"]["1"]["outputs"]["probabilities"]["rows"] == 32 and found["ok"]
