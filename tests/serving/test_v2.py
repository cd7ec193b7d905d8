"""The Open Inference Protocol (serving/v2/), spoken by hand over the server's REST and gRPC ports: every route,
every datatype both ways (JSON, the binary extension, gRPC's typed and raw contents) equal to TF Serving's Predict
bit for bit, and every mistake a 400 / INVALID_ARGUMENT naming what is wrong. (Triton's own clients:
test_v2_clients.py; hostile requests: test_attacks.py.)
"""

from __future__ import annotations

import json

import grpc
import ml_dtypes
import numpy as np
import pytest
import requests
from google.protobuf import text_format
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from server_helpers import serving
from serving.manager.model_manager import ModelManager
from serving.servable import tensors
from serving.v2 import proto
from serving.v2.service import InferenceService
from v2_models import DTYPES, write_echo_model

pytestmark = pytest.mark.timeout(300)
HEADER = "Inference-Header-Content-Length"

SAMPLES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 255, 7]], np.uint8), "UINT16": np.array([[0, 65535, 9]], np.uint16),
    "UINT32": np.array([[0, 2**32 - 1, 5]], np.uint32), "UINT64": np.array([[0, 2**64 - 1, 3]], np.uint64),
    "INT8": np.array([[-128, 127, 0]], np.int8), "INT16": np.array([[-32768, 32767, 1]], np.int16),
    "INT32": np.array([[-2**31, 2**31 - 1, 2]], np.int32), "INT64": np.array([[-2**63, 2**63 - 1, 4]], np.int64),
    "FP16": np.array([[0.1, -65504, 6e-8]], np.float16),
    "BF16": np.array([[0.1, -3e38, 1e-38]], ml_dtypes.bfloat16),
    "FP32": np.array([[0.1, -1e38, 1.4e-45]], np.float32), "FP64": np.array([[0.1, -1e308, 5e-324]], np.float64),
    "BYTES": np.array([[b"", "h\u00e9llo \u2603".encode(), b"a\x00b"]], dtype=object),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("v2") / "echo"
    write_echo_model(base / "1")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    config = f'model_config_list {{ config {{ name: "echo" base_path: "{base}" model_platform: "tensorflow" %s }} }}'
    for labels in ("", 'version_labels { key: "stable" value: 1 }'):  # a label names a version already loaded
        manager.reload_config(text_format.Parse(config % labels, model_server_config_pb2.ModelServerConfig()))
    with serving(manager, rest_api_port=-1) as running:
        yield running


def url(server, path: str) -> str:
    return f"http://{server.rest_address}{path}"


def predict(server, signature: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """TF Serving's Predict of the same input, for comparison."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "echo", signature
    request.inputs["x"].CopyFrom(tensors.to_tensor_proto(array))
    with grpc.insecure_channel(server.grpc_address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    return {name: tensors.to_ndarray(proto_, name) for name, proto_ in response.outputs.items()}


def grpc_call(server, rpc: str, request):
    _, response_type = proto.RPCS[rpc]
    with grpc.insecure_channel(server.grpc_address) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}", request_serializer=type(request).SerializeToString,
                                   response_deserializer=proto.message_class(response_type).FromString)
        return call(request, timeout=30)


def binary_infer(server, document: dict, blobs: list[bytes], path: str = "/v2/models/echo/infer"):
    header = json.dumps(document).encode()
    return requests.post(url(server, path), data=header + b"".join(blobs), headers={HEADER: str(len(header))},
                         timeout=30)


def split_binary(response) -> tuple[dict, dict[str, bytes]]:
    """The JSON header of a binary response and each binary output's bytes."""
    length = int(response.headers.get(HEADER, len(response.content)))
    document, offset, blobs = json.loads(response.content[:length]), length, {}
    for output in document["outputs"]:
        size = output.get("parameters", {}).get("binary_data_size")
        if size is not None:
            blobs[output["name"]], offset = response.content[offset:offset + size], offset + size
    assert offset == len(response.content)
    return document, blobs


def as_binary(array: np.ndarray) -> bytes:
    if array.dtype == object:
        return b"".join(len(item).to_bytes(4, "little") + item for item in array.ravel())
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


ROUTES = [  # (method, path, status, what the JSON body holds)
    ("GET", "/v2", 200, {"name": "mixed-precision-pipeline", "extensions": ["binary_tensor_data"]}),
    ("GET", "/v2/health/live", 200, {"live": True}),
    ("GET", "/v2/health/ready", 200, {"ready": True}),
    ("GET", "/v2/models/echo", 200, {"name": "echo", "versions": ["1"], "platform": "tensorflow_savedmodel"}),
    ("GET", "/v2/models/echo/versions/1", 200, {"name": "echo", "versions": ["1"]}),
    ("GET", "/v2/models/echo/versions/stable", 200, {"name": "echo"}),  # a TF Serving version label
    ("GET", "/v2/models/echo/ready", 200, {"ready": True}),
    ("GET", "/v2/models/echo/versions/1/ready", 200, {"ready": True}),
    ("GET", "/v2/models/echo/versions/7/ready", 503, {"ready": False}),
    ("GET", "/v2/models/nope", 404, {"error": "model 'nope' is not served here"}),
    ("GET", "/v2/models/nope/ready", 404, {"error": "model 'nope' is not served here"}),
    ("GET", "/v2/models/echo/versions/7", 404, {"error": "Servable not found for request: Specific(echo, 7)"}),
    ("GET", "/v2/elsewhere", 404, {}),
    ("POST", "/v2/health/live", 400, {"error": "/v2/health/live takes GET, not POST"}),
    ("GET", "/v2/models/echo/infer", 400, {"error": "/v2/models/echo/infer takes POST, not GET"}),
]


@pytest.mark.parametrize("method,path,status,expected", ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_routes_answer_as_the_spec_says(server, method, path, status, expected):
    response = requests.request(method, url(server, path), timeout=30)
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert {key: body[key] for key in expected} == expected


def test_model_metadata_lists_the_default_signature(server):
    body = requests.get(url(server, "/v2/models/echo"), timeout=30).json()
    assert body["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
    assert body["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 3]},
                               {"name": "y_bf16", "datatype": "BF16", "shape": [-1, 3]},
                               {"name": "y_half", "datatype": "FP16", "shape": [-1, 3]}]
    metadata = grpc_call(server, "ModelMetadata", proto.message_class("ModelMetadataRequest")(name="echo"))
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        (t["name"], t["datatype"], t["shape"]) for t in body["outputs"]]
    assert (metadata.platform, list(metadata.versions)) == ("tensorflow_savedmodel", ["1"])


def test_grpc_health_and_server_metadata(server):
    assert grpc_call(server, "ServerLive", proto.message_class("ServerLiveRequest")()).live
    assert grpc_call(server, "ServerReady", proto.message_class("ServerReadyRequest")()).ready
    ready = proto.message_class("ModelReadyRequest")
    assert grpc_call(server, "ModelReady", ready(name="echo")).ready
    assert not grpc_call(server, "ModelReady", ready(name="echo", version="7")).ready
    assert not grpc_call(server, "ModelReady", ready(name="nope")).ready  # as Triton answers
    metadata = grpc_call(server, "ServerMetadata", proto.message_class("ServerMetadataRequest")())
    assert (metadata.name, list(metadata.extensions)) == ("mixed-precision-pipeline", ["binary_tensor_data"])


@pytest.mark.parametrize("datatype", list(DTYPES))
def test_every_datatype_travels_every_way_equal_to_predict(server, datatype):
    """JSON, the binary extension, gRPC raw and typed contents: the same bytes as TF Serving's Predict answers."""
    sample, signature = SAMPLES[datatype], f"echo_{datatype}"
    expected = predict(server, signature, sample)["y"]
    assert as_binary(expected) == as_binary(sample)
    tensor = {"name": "x", "datatype": datatype, "shape": list(sample.shape)}
    parameters = {"signature_name": signature}

    document, blobs = split_binary(binary_infer(
        server, {"inputs": [{**tensor, "parameters": {"binary_data_size": len(as_binary(sample))}}],
                 "parameters": parameters, "outputs": [{"name": "y", "parameters": {"binary_data": True}}]},
        [as_binary(sample)]))
    assert document["outputs"][0] | {"parameters": None} == {**tensor, "name": "y", "parameters": None}
    assert blobs["y"] == as_binary(expected)

    if datatype == "BYTES":  # JSON carries text: the UTF-8 elements only
        sample = sample[:, :2]
        expected = predict(server, signature, sample)["y"]
        tensor["shape"] = list(sample.shape)
    data = ([item.decode() for item in sample.ravel()] if datatype == "BYTES"
            else sample.astype(np.float64 if sample.dtype.kind == "f" or datatype == "BF16" else sample.dtype).ravel().tolist())
    response = requests.post(url(server, "/v2/models/echo/infer"), timeout=30,
                             json={"inputs": [{**tensor, "data": data}], "parameters": parameters})
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert (output["datatype"], output["shape"]) == (datatype, list(expected.shape))
    values = (np.array([item.encode() for item in output["data"]], dtype=object) if datatype == "BYTES"
              else np.array(output["data"], dtype=expected.dtype) if expected.dtype.kind in "biu"
              else np.array(output["data"]).astype(expected.dtype))
    assert as_binary(values.reshape(expected.shape)) == as_binary(expected)

    sample = SAMPLES[datatype]
    request = proto.ModelInferRequest(model_name="echo")
    request.parameters["signature_name"].string_param = signature
    request.inputs.add(name="x", datatype=datatype, shape=list(sample.shape))
    request.raw_input_contents.append(as_binary(sample))
    raw = grpc_call(server, "ModelInfer", request)
    assert (raw.outputs[0].datatype, list(raw.outputs[0].shape), raw.model_version) == (datatype, [1, 3], "1")
    assert raw.raw_output_contents[0] == as_binary(predict(server, signature, sample)["y"])

    del request.raw_input_contents[:]
    field = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}.get(datatype)
    if field is None:  # FP16 and BF16 have no typed contents
        with pytest.raises(grpc.RpcError) as refused:
            grpc_call(server, "ModelInfer", request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == f"input 'x': {datatype} has no typed contents; send it in raw_input_contents"
        return
    getattr(request.inputs[0].contents, field).extend(sample.ravel().tolist())
    assert grpc_call(server, "ModelInfer", request).raw_output_contents[0] == raw.raw_output_contents[0]


def test_half_precision_outputs_reach_the_client_as_the_graphs_bits(server):
    x = np.array([[1.0, 2.0, 3.0], [-0.7, 1e-3, 7e4]], np.float32)
    expected = predict(server, "", x)
    document, blobs = split_binary(binary_infer(
        server, {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3],
                             "parameters": {"binary_data_size": 24}}], "parameters": {"binary_data_output": True}},
        [x.tobytes()]))
    assert [output["name"] for output in document["outputs"]] == ["y", "y_bf16", "y_half"]
    for name in ("y", "y_bf16", "y_half"):
        assert blobs[name] == as_binary(expected[name]), name
    json_outputs = requests.post(url(server, "/v2/models/echo/versions/stable/infer"), timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": x.tolist()}]}).json()["outputs"]
    for output in json_outputs:  # JSON numbers: the exact values, so cast back they are the same bits
        assert as_binary(np.array(output["data"]).astype(expected[output["name"]].dtype)) == \
            as_binary(expected[output["name"]].ravel())


def test_outputs_come_in_the_order_asked_and_only_those(server):
    body = requests.post(url(server, "/v2/models/echo/infer"), timeout=30, json={
        "id": "req-7", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
        "outputs": [{"name": "y_half"}, {"name": "y"}]}).json()
    assert (body["id"], body["model_name"], body["model_version"]) == ("req-7", "echo", "1")
    assert [(o["name"], o["data"]) for o in body["outputs"]] == [
        ("y_half", [0.0999755859375, 0.199951171875, 0.2998046875]), ("y", [2.5, 3.0, 3.5])]


def _x(**fields) -> dict:
    return {"name": "x", "datatype": "FP32", "shape": [1, 3], **fields}


MISTAKES = [  # (JSON document, binary part or None for a plain JSON body, what the error says)
    ({"inputs": [_x(datatype="FLOAT32", data=[1, 2, 3])]}, None, "input 'x': unknown datatype 'FLOAT32'; expected one of BOOL"),
    ({"inputs": [_x(datatype="FP64", data=[1, 2, 3])]}, None, "input 'x': datatype FP64 does not match the model's FP32"),
    ({"inputs": [_x(shape="1,3", data=[1, 2, 3])]}, None, "input 'x': 'shape' must be a list of at most 64 non-negative integers"),
    ({"inputs": [_x(shape=[1, -3], data=[1, 2, 3])]}, None, "'shape' must be a list of at most 64 non-negative"),
    ({"inputs": [_x(data=[1, 2])]}, None, "input 'x': shape [1, 3] holds 3 elements, but 'data' has 2"),
    ({"inputs": [_x(data=[1, "2", 3])]}, None, "its JSON values must all be numbers"),
    ({"inputs": [_x(data=[1, 2, 3]), _x(data=[1, 2, 3])]}, None, "input 'x' is given twice"),
    ({"inputs": [_x(name="z", data=[1, 2, 3])]}, None, "input 'z' is not an input of signature 'serving_default', which takes ['x']"),
    ({"inputs": [_x()]}, None, "input 'x' has neither 'data' nor parameters.binary_data_size"),
    ({"inputs": []}, None, "'inputs' must be a non-empty list of tensors"),
    ({"inputs": [_x(data=[1, 2, 3])], "outputs": [{"name": "nope"}]}, None, "nope"),
    ({"inputs": [_x(data=[1, 2, 3])], "outputs": [{"name": "y", "parameters": {"classification": 2}}]}, None,
     "output 'y': the classification extension is not supported"),
    ({"inputs": [_x(data=[1, 2, 3])], "parameters": {"signature_name": "nope"}}, None, "the model has no signature 'nope'"),
    ({"inputs": [_x(shape=[2**31, 2**31], data=[1, 2, 3])]}, None, "the server allows at most 16777216 per request (--max_request_elements)"),
    ({"inputs": [_x(parameters={"binary_data_size": 12})]}, b"\0" * 8, "input 'x': binary_data_size 12 goes past the 8 bytes"),
    ({"inputs": [_x(parameters={"binary_data_size": 8})]}, b"\0" * 8, "input 'x': shape [1, 3] of FP32 takes 12 bytes, but 8 were sent"),
    ({"inputs": [_x(parameters={"binary_data_size": 12})]}, b"\0" * 16, "the body has 4 bytes after the JSON"),
    ({"inputs": [_x(parameters={"binary_data_size": -1})]}, b"", "binary_data_size must be a non-negative integer"),
]


@pytest.mark.parametrize("document,binary,message", MISTAKES, ids=[m[2][:40] for m in MISTAKES])
def test_mistakes_are_400_naming_what_is_wrong(server, document, binary, message):
    response = (requests.post(url(server, "/v2/models/echo/infer"), json=document, timeout=30) if binary is None
                else binary_infer(server, document, [binary]))
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


def test_bytes_elements_and_header_lengths_past_the_body_are_400(server):
    def infer(header: bytes, length: str, blob: bytes) -> requests.Response:
        return requests.post(url(server, "/v2/models/echo/infer"), data=header + blob, headers={HEADER: length},
                             timeout=30)

    document = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 9}}],
                "parameters": {"signature_name": "echo_BYTES"}}
    header = json.dumps(document).encode()
    cases = [
        (header, str(len(header)), (3).to_bytes(4, "little") + b"abc" + b"\xff\xff", "BYTES element 1 has no 4-byte length"),
        (header, str(len(header)), (2**31).to_bytes(4, "little") + b"abcde", "BYTES element 0 declares 2147483648 bytes, but only 5"),
        (header, str(len(header) + 100), b"\0" * 9, f"{HEADER}: {len(header) + 100} is not a length within the body"),
        (header, "-1", b"\0" * 9, f"{HEADER}: -1 is not a length"),
    ]
    for head, length, blob, message in cases:
        response = infer(head, length, blob)
        assert response.status_code == 400 and message in response.json()["error"], (message, response.text)
    many = json.dumps({**document, "inputs": [{**document["inputs"][0], "shape": [1000],
                                                "parameters": {"binary_data_size": 9}}]}).encode()
    response = infer(many, str(len(many)), b"\0" * 9)
    assert "1000 BYTES elements need at least 4000 bytes, but 9 were sent" in response.json()["error"]


def test_a_bytes_output_that_is_not_utf8_goes_binary_only(server):
    document = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}],
                "parameters": {"signature_name": "echo_BYTES"}}
    response = binary_infer(server, document, [(2).to_bytes(4, "little") + b"\xff\xfe"])
    assert response.status_code == 400
    assert response.json()["error"].startswith("output 'y' holds bytes that are not UTF-8, which JSON cannot carry")


def test_grpc_mistakes_are_invalid_argument(server):
    def refused(request) -> str:
        with pytest.raises(grpc.RpcError) as error:
            grpc_call(server, "ModelInfer", request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        return error.value.details()

    request = proto.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    request.inputs.add(name="w", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"\0" * 12)
    assert refused(request) == ("raw_input_contents has 1 entries for 2 inputs; send every input's values there, "
                                "or none")
    del request.inputs[1]
    request.inputs[0].shape[:] = [1, 4]
    assert refused(request) == "input 'x': shape [1, 4] of FP32 takes 16 bytes, but 12 were sent"
    del request.raw_input_contents[:]
    request.inputs[0].contents.fp32_contents.extend([1, 2, 3])
    assert refused(request) == "input 'x': shape [1, 4] holds 4 elements, but contents.fp32_contents has 3"
    request.inputs[0].datatype = "INT8"
    request.parameters["signature_name"].string_param = "echo_INT8"
    request.inputs[0].shape[:] = [1]
    del request.inputs[0].contents.fp32_contents[:]
    request.inputs[0].contents.int_contents.append(300)
    assert refused(request) == "input 'x': a value is out of INT8's range [-128, 127]"
    assert refused(proto.ModelInferRequest(model_name="echo")) == "the request has no inputs"


def test_ready_says_no_while_the_server_drains(server):
    service = InferenceService(server.server._core.manager, predict=None)
    assert service.server_ready() and service.model_ready("echo", "")
    service.draining = True
    assert not service.server_ready() and not service.model_ready("echo", "")
