"""The Open Inference Protocol's REST API under /v2, on the REST port (serving/rest/server.py sends /v2 here):

    GET  /v2                                           server metadata
    GET  /v2/health/live | /v2/health/ready            200 {"live"|"ready": true}; 503 {"ready": false}
    GET  /v2/models/{m}[/versions/{v}]                 model metadata (the default signature)
    GET  /v2/models/{m}[/versions/{v}]/ready           200 {"ready": true}; 503 {"ready": false}
    POST /v2/models/{m}[/versions/{v}]/infer           JSON tensors, and the binary tensor extension

The binary tensor extension (what tritonclient and KServe's SDK send by default): a request whose header
`Inference-Header-Content-Length: N` says its first N bytes are the JSON, followed by each input with
`parameters.binary_data_size` in order; outputs asked for with `parameters.binary_data` (or all, with the
request's `parameters.binary_data_output`) come back after the JSON the same way, with the same header.
Routes and fields follow the spec (open-inference-protocol specification/protocol/inference_rest.md; the
extension: Triton's docs/protocol/extension_binary_data.md). Errors are {"error": "..."}, a client's mistake
a 4xx (serving/rest/routes.py HTTP_STATUS).
"""

from __future__ import annotations

import re
import time
from typing import Any

from aiohttp import web

from serving.errors import InvalidArgument, NotFound, ServingError, call_with_status, short
from serving.manager.model_manager import ModelManager
from serving.prediction_service import INLINE_BYTES, off_loop, request_bytes
from serving.rest import json_codec
from serving.rest.routes import HTTP_STATUS, Context, RestApi
from serving.v2 import tensors
from serving.v2.service import InferenceService, Input, Request, Response

PREFIX = "/v2"
HEADER_LENGTH = "Inference-Header-Content-Length"
_MODEL = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
_ROUTES = re.compile(_MODEL + r"(?P<action>/ready|/infer)?/?")


class V2Api:
    """Answers /v2 requests; handle() is a coroutine on the server's event loop."""

    def __init__(self, manager: ModelManager, api: RestApi, executor: Any = None) -> None:
        self._manager = manager
        self.service = InferenceService(manager, api.predict, executor, api.count_unanswered)
        self._executor = executor

    async def handle(self, request: web.Request, body: bytearray) -> web.Response:
        context = Context(request.remote or "")
        request_bytes.set(len(body))
        result, code, message = await call_with_status(self._dispatch, request, body, context)
        if isinstance(result, web.Response):
            return result
        return _json(HTTP_STATUS.get(code, 500), {"error": message})

    async def _dispatch(self, request: web.Request, body: bytearray, context: Context) -> web.Response:
        path, method = request.path, request.method
        if path in ("/v2", "/v2/"):
            _require(method, "GET", path)
            return _json(200, self.service.server_metadata())
        if path in ("/v2/health/live", "/v2/health/ready"):
            _require(method, "GET", path)
            if path.endswith("/live"):
                return _json(200, {"live": True})
            ready = self.service.server_ready()
            return _json(200 if ready else 503, {"ready": ready})
        match = _ROUTES.fullmatch(path)
        if match is None:
            raise NotFound(f"Not found: {short(method)} {short(path)}; the v2 API serves /v2, /v2/health/live, "
                           "/v2/health/ready and /v2/models/{name}[/versions/{version}][/ready|/infer]")
        name, version, action = match["name"], match["version"] or "", match["action"]
        with self._manager.request_scope():
            if action == "/infer":
                _require(method, "POST", path)
                return await self._infer(request, body, name, version, context)
            _require(method, "GET", path)
            if action == "/ready":
                ready = self.service.model_ready(name, version)
                return _json(200 if ready else 503, {"name": name, "ready": ready})
            return _json(200, self.service.model_metadata(name, version))

    async def _infer(self, request: web.Request, body: bytearray, name: str, version: str,
                     context: Context) -> web.Response:
        inline = len(body) <= INLINE_BYTES
        header = request.headers.get(HEADER_LENGTH)
        start = time.monotonic()
        try:
            parsed, binary_outputs = parse_infer(body, header, name, version)
        except ServingError as error:
            self.service.count_refused(name, version, error.code, time.monotonic() - start)
            raise
        response = await self.service.infer(parsed, context)
        encode = lambda: encode_response(response, binary_outputs)  # noqa: E731 - run here or on the pool
        payload, headers = encode() if inline else await off_loop(self._executor, encode)
        return web.Response(status=200, body=payload, headers=headers)


def _require(method: str, wanted: str, path: str) -> None:
    if method != wanted:
        raise InvalidArgument(f"{short(path)} takes {wanted}, not {short(method)}")


def _json(status: int, payload: Any) -> web.Response:
    return web.Response(status=status, body=json_codec.dumps(payload), content_type="application/json")


def parse_infer(body: bytearray, header_length: str | None, name: str, version: str) -> tuple[Request, Any]:
    """The inference request of a body (JSON, or JSON and binary tensors), and which outputs go back binary:
    a set of names, or True for all."""
    json_length = len(body)
    if header_length is not None:
        if not header_length.isascii() or not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidArgument(f"{HEADER_LENGTH}: {short(header_length)} is not a length within the body's "
                                  f"{len(body)} bytes")
        json_length = int(header_length)
    document = json_codec.parse_body(bytes(memoryview(body)[:json_length]))
    binary = memoryview(body)[json_length:]
    parameters = _object(document.get("parameters", {}), "parameters")
    signature_name = parameters.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise InvalidArgument("parameters.signature_name must be a string")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    inputs, offset = _inputs(document.get("inputs"), binary)
    if offset != len(binary):
        raise InvalidArgument(f"the body has {len(binary) - offset} bytes after the JSON and the inputs' "
                              "binary_data_size")
    outputs, binary_outputs = _outputs(document.get("outputs", []), parameters)
    return Request(name, version, inputs, outputs, signature_name, request_id), binary_outputs


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"'{what}' must be a JSON object")
    return value


def _inputs(given: Any, binary: memoryview) -> tuple[list[Input], int]:
    """The request's inputs, each reading its values from JSON `data` or its slice of the binary part."""
    if not isinstance(given, list) or not given:
        raise InvalidArgument("'inputs' must be a non-empty list of tensors")
    inputs, offset = [], 0
    for index, tensor in enumerate(given):
        tensor = _object(tensor, f"inputs[{index}]")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"inputs[{index}] has no 'name'")
        datatype = tensor.get("datatype")  # checked against the signature's with the other inputs (service.py)
        shape = tensors.checked_shape(tensor.get("shape"), name)
        size = _object(tensor.get("parameters", {}), f"inputs[{index}].parameters").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidArgument(f"input '{short(name)}': binary_data_size must be a non-negative integer")
            if size > len(binary) - offset:
                raise InvalidArgument(f"input '{short(name)}': binary_data_size {size} goes past the "
                                      f"{len(binary) - offset} bytes of binary data left in the body")
            part = binary[offset:offset + size]
            offset += size
            encode = lambda n=name, d=datatype, s=shape, p=part: tensors.binary_tensor_proto(n, d, s, p)  # noqa: E731
        elif "data" in tensor:
            encode = lambda n=name, d=datatype, s=shape, v=tensor["data"]: (  # noqa: E731
                tensors.tensor_proto(tensors.from_json(n, d, s, v)))
        else:
            raise InvalidArgument(f"input '{short(name)}' has neither 'data' nor parameters.binary_data_size")
        inputs.append(Input(name, datatype, shape, encode))
    return inputs, offset


def _outputs(given: Any, parameters: dict) -> tuple[list[str], Any]:
    """The outputs asked for (names, in order) and which go back binary."""
    binary_all = parameters.get("binary_data_output", False)
    if not isinstance(binary_all, bool):
        raise InvalidArgument("parameters.binary_data_output must be true or false")
    if not isinstance(given, list):
        raise InvalidArgument("'outputs' must be a list")
    names, binary = [], set()
    for index, output in enumerate(given):
        output = _object(output, f"outputs[{index}]")
        name = output.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"outputs[{index}] has no 'name'")
        if name in names:
            raise InvalidArgument(f"output '{short(name)}' is asked for twice")
        output_parameters = _object(output.get("parameters", {}), f"outputs[{index}].parameters")
        if "classification" in output_parameters:  # Triton's extension; other parameters are ignored (the spec)
            raise InvalidArgument(f"output '{short(name)}': the classification extension is not supported; "
                                  "ask for the scores and take the top classes client-side")
        wants_binary = output_parameters.get("binary_data", binary_all)
        if not isinstance(wants_binary, bool):
            raise InvalidArgument(f"output '{short(name)}': parameters.binary_data must be true or false")
        names.append(name)
        if wants_binary:
            binary.add(name)
    return names, (True if binary_all and not names else binary)


def encode_response(response: Response, binary_outputs: Any) -> tuple[bytes, dict[str, str]]:
    """The response body and headers: JSON, with binary outputs after it where asked for."""
    header: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        header["id"] = response.id
    header["outputs"], blobs = [], []
    for output in response.outputs:
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": output.shape}
        if binary_outputs is True or output.name in binary_outputs:
            blob = output.binary()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = tensors.to_json(output.array(), output.name)
        header["outputs"].append(entry)
    text = json_codec.dumps(header)
    if not blobs:
        return text, {"Content-Type": "application/json"}
    return b"".join([text, *blobs]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(text))}
