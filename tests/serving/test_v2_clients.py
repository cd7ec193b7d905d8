"""Triton's own clients (tritonclient.http and tritonclient.grpc, from a venv of their own: tests/helpers/
tritonclient_env.py) against `python -m serving`: health, metadata and infer on the echo model of every datatype,
the digits MLP, the image model (BYTES input) and a language model's serving_default, each answer equal to TF
Serving's Predict of the same inputs bit for bit (FP32, FP16, BF16 included), over HTTP binary, HTTP JSON and gRPC.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess

import grpc
import ml_dtypes
import numpy as np
import pytest
import requests
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

import tritonclient_env
from serving.servable import tensors
from v2_models import write_echo_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.subprocess]
DRIVER = tritonclient_env.REPO_ROOT / "tests" / "helpers" / "triton_clients.py"


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return base64.b64encode(buffer.getvalue()).decode()


def _array(encoded: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, exported_model, image_export, tiny_lm_export):
    root = tmp_path_factory.mktemp("v2_clients")
    write_echo_model(root / "echo" / "1")
    served = {"echo": root / "echo", exported_model.model_name: exported_model.base_path,
              image_export.model_name: image_export.base_path, "tiny_lm": tiny_lm_export.base_path}
    config = root / "models.config"
    config.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{path}" model_platform: "tensorflow" }}\n'
        for name, path in served.items()) + "}\n")
    return root, config


@pytest.fixture(scope="module")
def server(models, start_server):
    root, config = models
    server = start_server(f"--model_config_file={config}", "--rest_api_port=-1", log_dir=root)
    yield server
    assert server.stop() == 0, server.stderr_tail()
    assert "Traceback" not in server.stderr_path.read_text(errors="replace")


def _predict(server, model: str, signature: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = model, signature
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tensors.to_tensor_proto(array))
    with grpc.insecure_channel(server.address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)
    return {name: tensors.to_ndarray(output, name) for name, output in response.outputs.items()}


def _metadata_input(server, model: str) -> dict:
    (tensor,) = requests.get(f"http://{server.rest_address}/v2/models/{model}", timeout=30).json()["inputs"]
    return tensor


def _bits(array: np.ndarray) -> np.ndarray:
    """An array as the driver passes it: BF16 as its uint16 bit patterns (.npy has no bfloat16)."""
    return array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array


def _json_carries(datatype: str, values: np.ndarray) -> bool:
    """Whether tritonclient sends these values as JSON: not BF16, not BYTES that are not UTF-8."""
    if datatype == "BF16":
        return False
    try:
        return datatype != "BYTES" or all(item.decode("utf-8") is not None for item in values.ravel())
    except UnicodeDecodeError:
        return False


def test_tritonclient_http_and_grpc_agree_with_predict_bit_for_bit(server, exported_model, image_export,
                                                                   tiny_lm_export):
    python = tritonclient_env.python()  # made once: ~30-40 s from the package registry
    lm_input = _metadata_input(server, "tiny_lm")
    mlp_input = _metadata_input(server, exported_model.model_name)
    cases = [  # (model, signature, {input: (datatype, values)})
        ("echo", "", {"x": ("FP32", np.array([[1.0, 2.0, 3.0], [-0.7, 1e-3, 7e4]], np.float32))}),
        ("echo", "echo_FP16", {"x": ("FP16", np.array([0.1, -65504, 6e-8], np.float16))}),
        ("echo", "echo_BF16", {"x": ("BF16", np.array([0.1, -3e38, 1e-38], ml_dtypes.bfloat16))}),
        ("echo", "echo_BYTES", {"x": ("BYTES", np.array([b"", "h\u00e9llo".encode()], dtype=object))}),
        ("echo", "echo_INT64", {"x": ("INT64", np.array([[-2**63, 2**63 - 1]], np.int64))}),
        ("echo", "echo_UINT8", {"x": ("UINT8", np.array([0, 255], np.uint8))}),
        ("echo", "echo_BOOL", {"x": ("BOOL", np.array([True, False]))}),
        (exported_model.model_name, "", {mlp_input["name"]: ("FP32", exported_model.val_x[:4].astype(np.float32))}),
        (image_export.model_name, "predict_images", {"image_bytes": ("BYTES", np.array(image_export.files[:2], dtype=object))}),
        ("tiny_lm", "", {lm_input["name"]: ("INT32", np.array([[72, 101, 108, 108, 111, 32, 119, 111]], np.int32))}),
    ]
    assert lm_input["datatype"] == "INT32"
    request = {"http": server.rest_address, "grpc": server.address, "cases": [
        {"model": model, "parameters": {"signature_name": signature} if signature else None, "outputs": [],
         "inputs": [{"name": name, "datatype": datatype, "shape": list(values.shape),
                     "npy": _npy(_bits(values))} for name, (datatype, values) in inputs.items()]}
        for model, signature, inputs in cases]}
    done = subprocess.run([str(python), str(DRIVER)], input=json.dumps(request), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)

    for client in ("http", "grpc"):
        seen = report[client]
        assert (seen["live"], seen["ready"], seen["missing_ready"]) == (True, True, False), client
        assert seen["server"]["name"] == "mixed-precision-pipeline"
        for model, found in seen["models"].items():
            assert found["ready"] is True, (client, model)
            assert found["metadata"]["platform"] == "tensorflow_savedmodel"
            inputs = [{**tensor, "shape": [int(size) for size in tensor["shape"]]}  # gRPC's JSON: int64 as text
                      for tensor in found["metadata"]["inputs"]]
            assert inputs == requests.get(
                f"http://{server.rest_address}/v2/models/{model}", timeout=30).json()["inputs"], (client, model)

    for (model, signature, inputs), answers in zip(cases, report["cases"]):
        expected = _predict(server, model, signature, {name: values for name, (_, values) in inputs.items()})
        for way, answer in answers.items():
            if way == "http_json" and not all(_json_carries(datatype, values) for datatype, values in inputs.values()):
                assert "binary_data=True" in answer["error"], answer  # the client itself refuses to send it as JSON
                continue
            assert "error" not in answer, (model, signature, way, answer)
            assert sorted(answer["outputs"]) == sorted(expected), (model, way)
            for name, want in expected.items():
                got, want = _array(answer["outputs"][name]), _bits(want)
                assert got.dtype == want.dtype and got.shape == want.shape, (model, way, name, got.dtype)
                assert (got.tobytes() if got.dtype != object else got.tolist()) == \
                    (want.tobytes() if want.dtype != object else want.tolist()), (model, signature, way, name)
