"""Clients send image files: gRPC DT_STRING and REST {"b64": ...} to predict_images, Classify with image/encoded;
hostile images are INVALID_ARGUMENT / 400 naming the row, and with batching on they fail only their own request."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import get_model_metadata_pb2, prediction_service_pb2_grpc

from pipeline.data.image_probes import png_declaring
from pipeline.export.signatures import CLASSIFY_IMAGES_SIGNATURE, IMAGE_FEATURE, IMAGES_INPUT, IMAGES_SIGNATURE
from serving.client import grpc_client
from serving.servable import tensors

pytestmark = pytest.mark.timeout(300)
PHOTO = (Path(__import__("sklearn").__file__).parent / "datasets" / "images" / "china.jpg").read_bytes()


HOSTILE = {  # the image, and words its refusal must hold
    "bomb": (png_declaring(40_000, 40_000, rows=1), r"image_bytes\[1\]: 40000x40000 pixels, more than the 4194304"),
    "text": (b"hello", r"image_bytes\[1\]: not a JPEG or PNG image"),
    "b64 of b64": (base64.b64encode(base64.b64encode(PHOTO)), r"image_bytes\[1\]: not a JPEG or PNG image"),
    "truncated": (PHOTO[:5000], r"Invalid JPEG data"),
}


@pytest.fixture(scope="module")
def served(image_export, start_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("images")
    parameters = logs / "batching.config"  # a long timeout: concurrent requests merge into one batch
    parameters.write_text("max_batch_size { value: 64 }\nbatch_timeout_micros { value: 200000 }\n"
                          "num_batch_threads { value: 1 }\n")
    server = start_server(f"--model_name={image_export.model_name}", f"--model_base_path={image_export.base_path}",
                          "--rest_api_port=-1", "--enable_batching", f"--batching_parameters_file={parameters}",
                          "--enable_signature_method_name_check", log_dir=logs)
    yield server
    assert server.stop() == 0, server.stderr_tail()
    assert "Traceback" not in server.stderr_tail()


def predict(address: str, images: list[bytes], timeout: float = 30) -> dict[str, np.ndarray]:
    with grpc.insecure_channel(address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = grpc_client.predict_request("tiny_images", {IMAGES_INPUT: np.array(images, dtype=object)},
                                              IMAGES_SIGNATURE)
        response = stub.Predict(request, timeout=timeout)
    return {name: tensors.to_ndarray(proto, name) for name, proto in response.outputs.items()}


def test_grpc_rest_and_classify_answer_the_image_files_as_the_float_rows(served, image_export):
    files, rows = list(image_export.files[:8]), image_export.rows[:8]
    expected = grpc_client.predict_rows(served.address, "tiny_images", "features", rows, 8)
    np.testing.assert_array_equal(predict(served.address, files)["probabilities"], expected["probabilities"])
    body = json.dumps({"signature_name": IMAGES_SIGNATURE,
                       "instances": [{"b64": base64.b64encode(f).decode()} for f in files]}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://{served.rest_address}/v1/models/tiny_images:predict",
                                                       data=body, method="POST"), timeout=30) as reply:
        predictions = json.loads(reply.read())["predictions"]
    np.testing.assert_array_equal(np.array([p["probabilities"] for p in predictions], np.float32),
                                  expected["probabilities"])
    examples = [example_pb2.Example(features=feature_pb2.Features(feature={
        IMAGE_FEATURE: feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[f]))})) for f in files]
    with grpc.insecure_channel(served.address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        result = stub.Classify(grpc_client.classify_request("tiny_images", examples, CLASSIFY_IMAGES_SIGNATURE),
                               timeout=30).result
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        request.model_spec.name = "tiny_images"
        metadata = stub.GetModelMetadata(request, timeout=30)
    scores = np.array([[c.score for c in row.classes] for row in result.classifications], np.float32)
    np.testing.assert_array_equal(scores, expected["probabilities"])
    signatures = get_model_metadata_pb2.SignatureDefMap()
    metadata.metadata["signature_def"].Unpack(signatures)
    assert signatures.signature_def[IMAGES_SIGNATURE].inputs[IMAGES_INPUT].dtype == types_pb2.DT_STRING


@pytest.mark.parametrize("attack", HOSTILE)
def test_a_hostile_image_is_invalid_argument_naming_row_and_reason_over_grpc_and_rest(served, image_export, attack):
    contents, words = HOSTILE[attack]
    with pytest.raises(grpc.RpcError) as refused:
        predict(served.address, [image_export.files[0], contents])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"signature '{IMAGES_SIGNATURE}': ")
    assert re.search(words, refused.value.details()), refused.value.details()
    body = json.dumps({"signature_name": IMAGES_SIGNATURE, "inputs": {IMAGES_INPUT: [
        {"b64": base64.b64encode(image_export.files[0]).decode()}, {"b64": base64.b64encode(contents).decode()}]}})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(urllib.request.Request(f"http://{served.rest_address}/v1/models/tiny_images:predict",
                                                      data=body.encode(), method="POST"), timeout=30)
    assert answer.value.code == 400
    assert re.search(words, json.loads(answer.value.read())["error"])


def test_with_batching_a_bad_image_fails_only_its_own_request(served, image_export):
    """16 clients at once, merged into one batch (200 ms timeout): the four hostile ones fail, the others do not."""
    good = list(image_export.files[:12])
    bad = [contents for contents, _ in HOSTILE.values()]
    calls = [[f] for f in good[:6]] + [[b] for b in bad] + [[f] for f in good[6:]]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(predict, served.address, call) for call in calls]
        outcomes = [future.exception() or future.result() for future in futures]
    hostile = outcomes[6:10]
    assert all(isinstance(o, grpc.RpcError) and o.code() == grpc.StatusCode.INVALID_ARGUMENT for o in hostile)
    answered = outcomes[:6] + outcomes[10:]
    assert not any(isinstance(o, Exception) for o in answered), [o for o in answered if isinstance(o, Exception)]
    expected = grpc_client.predict_rows(served.address, "tiny_images", "features", image_export.rows[:12], 12)
    # Within float32 rounding, not bit for bit: which requests share a batch varies, and a CPU kernel's rounding
    # may depend on the batch's size (Eigen's does: docs/testing.md).
    np.testing.assert_allclose(np.concatenate([o["probabilities"] for o in answered]), expected["probabilities"],
                               rtol=1e-5, atol=1e-7)
