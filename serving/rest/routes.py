"""TF Serving's REST routes: each request becomes the request proto a gRPC client would send, answered by the
same servicer coroutines.

Routes, JSON formats and status codes follow TF Serving (model_servers/http_rest_api_handler.cc,
util/json_tensor.cc, model_servers/http_server.cc):

    GET  /v1/models/{m}[/versions/{v} | /labels/{l}]            model status (GetModelStatus as JSON)
    GET  /v1/models/{m}[/versions/{v} | /labels/{l}]/metadata   GetModelMetadata (signature_def)
    POST /v1/models/{m}[/versions/{v} | /labels/{l}]:predict    {"instances": [...]} or {"inputs": ...}
    POST /v1/models/{m}[/versions/{v} | /labels/{l}]:classify   {"examples": [...], "context": {...}}
    POST /v1/models/{m}[/versions/{v} | /labels/{l}]:regress

The servicers (PredictionService, ModelService) answer inside the manager's request scope and through
the same batcher as gRPC: REST and gRPC give the same numbers. Failures are {"error": "..."} with the
gRPC code mapped as TF Serving's ToHTTPStatusCode does. Unlike TF Serving, float16 and bfloat16
outputs are written as JSON numbers.

A request is answered on the event loop up to its model call, which it awaits like a gRPC request; a
body over INLINE_BYTES is parsed, and its answer written, on the REST worker pool instead, so a large
request never stalls the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
from typing import Any, Callable

import grpc
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2, model_pb2,
                                     predict_pb2, regression_pb2)

from serving.errors import InvalidArgument, NotFound, ServingError, call_with_status, short
from serving.limits import Admission
from serving.manager.model_manager import ModelManager
from serving.model_service import ModelService
from serving.monitoring import Metrics
from serving.prediction_service import INLINE_BYTES, SIGNATURE_DEF_FIELD, PredictionService, off_loop, request_bytes
from serving.rest import json_codec
from serving.servable import tensors

_MODEL = r"/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>[0-9]+)|/labels/(?P<label>[^/:]+))?"
PREDICTION_PATH = re.compile(_MODEL + r":(?P<method>classify|regress|predict)", re.IGNORECASE)
STATUS_PATH = re.compile(_MODEL + r"(?P<metadata>/metadata)?", re.IGNORECASE)

_RPCS = {"predict": "Predict", "classify": "Classify", "regress": "Regress"}
# http_server.cc ToHTTPStatusCode.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DATA_LOSS: 500, grpc.StatusCode.UNAUTHENTICATED: 401,
}


class Context:
    """The part of grpc.aio's ServicerContext the servicers use: abort(code, message), raised as a ServingError,
    and time_remaining() until the --rest_api_timeout_in_ms deadline (None: no deadline). handed_over says
    whether a servicer took the request (from then on it accounts for it); client is the peer's address."""

    def __init__(self, client: str = "") -> None:
        self.handed_over = False
        self.client = client
        self.deadline: float | None = None  # time.monotonic()

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise ServingError(message, code)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class RestApi:
    """Answers REST requests with the gRPC servicers; handle() is a coroutine on the server's event loop.

    Args:
        manager: the loaded models.
        services: the PredictionService and ModelService REST requests go to (their api label "rest").
        admission: the requests in flight, shared with the gRPC port (serving/limits.py).
        metrics: counts the requests that fail before a servicer sees them (bad JSON, unknown model,
            a malformed path, a body over the limit); the servicers count the others.
        executor: the REST worker pool, where large bodies are parsed and large answers written.
        timeout_s: --rest_api_timeout_in_ms in seconds (None: no deadline).
    """

    def __init__(self, manager: ModelManager, services: tuple[PredictionService, ModelService],
                 admission: Admission | None = None, metrics: Metrics | None = None,
                 executor: concurrent.futures.Executor | None = None, timeout_s: float | None = None) -> None:
        self._manager = manager
        self._timeout_s = timeout_s
        self._predictions, self._models = services
        self._raw_predictions = self._predictions.answering_in_tensor_content()  # v2's binary outputs: as they are
        self._admission = admission or Admission()
        self._metrics = metrics
        self._executor = executor

    def admit(self, method: str, path: str, size: int) -> tuple[int, Any] | None:
        """Takes a request of `size` bytes into the in-flight bounds; else the 429 answer (counted). A taken request
        is released with release(size) once answered."""
        refusal = self._admission.admit(size)
        if refusal:
            self.observe_failure(method, path, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
            return HTTP_STATUS[grpc.StatusCode.RESOURCE_EXHAUSTED], {"error": refusal}
        return None

    def release(self, size: int) -> None:
        self._admission.release(size)

    async def handle(self, method: str, path: str, body: bytearray, client: str = "") -> tuple[int, Any]:
        """(HTTP status, JSON-able body) for one request, admitted already (admit); errors are {"error": message}.

        The body is emptied once parsed: a request waiting for its model holds its request proto and tensors,
        not its JSON as well (3,000 pending 286 KB bodies: peak RSS 1.8-2.0x --max_inflight_request_bytes while
        every body was kept until answered, issue 31 #3)."""
        start, context = time.monotonic(), Context(client)
        request_bytes.set(len(body))
        payload, code, message = await call_with_status(self._dispatch, method, path, body, context)
        if code == grpc.StatusCode.OK:
            return 200, payload
        if not context.handed_over:
            self.observe_failure(method, path, code, time.monotonic() - start)
        return HTTP_STATUS.get(code, 500), {"error": message}

    def observe_failure(self, method: str, path: str, code: grpc.StatusCode, seconds: float) -> None:
        """Counts a request refused before any servicer saw it, labelled with what its path names."""
        if self._metrics is None:
            return
        match = PREDICTION_PATH.fullmatch(path) if method == "POST" else STATUS_PATH.fullmatch(path)
        if match is None:
            model_name = version = rpc = ""
        else:
            model_name, version = match["name"], match["version"] or ""
            rpc = (_RPCS[match["method"].lower()] if method == "POST"
                   else "GetModelMetadata" if match["metadata"] else "GetModelStatus")
        self._metrics.observe_request(model_name=model_name, version=version, signature_name="", api="rest",
                                      rpc=rpc, status=code.name, seconds=seconds)

    async def _dispatch(self, method: str, path: str, body: bytearray, context: Context) -> Any:
        if not path.lower().startswith("/v1/"):  # TF Serving hands only /v1/ paths to its REST handler
            raise NotFound(f"Not found: {short(method)} {short(path)}; the REST API serves /v1/models/...")
        match = PREDICTION_PATH.fullmatch(path) if method == "POST" else STATUS_PATH.fullmatch(path)
        if method not in ("GET", "POST") or match is None:
            raise InvalidArgument(f"Malformed request: {short(method)} {short(path)}")
        with self._manager.request_scope():
            model_spec = _model_spec(match)
            if method == "GET":
                return await (self._metadata(model_spec, context) if match["metadata"]
                              else self._status(model_spec, context))
            rpc = match["method"].lower()
            build = {"predict": self._predict, "classify": self._classify, "regress": self._regress}[rpc]

            def request_for(body: bytearray) -> tuple[Any, Callable[[Any], Any]]:
                try:
                    return build(model_spec, json_codec.parse_body(body))
                finally:
                    body.clear()  # frees the buffer, whoever else still refers to it

            inline = len(body) <= INLINE_BYTES
            request, answer = request_for(body) if inline else await off_loop(self._executor, request_for, body)
            response = await self.run(getattr(self._predictions, _RPCS[rpc]), request, context)
            return answer(response) if inline else await off_loop(self._executor, answer, response)

    async def run(self, servicer_method: Callable[[Any, Any], Any], request: Any, context: Context) -> Any:
        """A Predict, Classify or Regress, within --rest_api_timeout_in_ms (TF Serving's deadline on the model
        run, http_rest_api_handler.cc): past it, DEADLINE_EXCEEDED in DirectSession's words (HTTP 504). A model
        call already running finishes on its thread; only its answer is given up (a TF2 function cannot be
        stopped), and a call still queued for a batch is dropped from it."""
        if self._timeout_s is None:
            return await self._call(servicer_method, request, context)
        context.deadline = time.monotonic() + self._timeout_s
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._call(servicer_method, request, context)
        except TimeoutError:
            raise ServingError("Timed out waiting for notification", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    async def predict(self, request: predict_pb2.PredictRequest, context: Context) -> predict_pb2.PredictResponse:
        """A Predict as a REST request runs it (within --rest_api_timeout_in_ms), its outputs in tensor_content:
        the Open Inference Protocol's infer (serving/v2/) is one."""
        return await self.run(self._raw_predictions.Predict, request, context)

    def count_unanswered(self, rpc: str, request: Any, code: grpc.StatusCode, seconds: float) -> None:
        """Counts a REST request refused before its servicer saw it, as PredictionService.count_unanswered."""
        self._predictions.count_unanswered(rpc, request, code, seconds)

    async def _call(self, servicer_method: Callable[[Any, Any], Any], request: Any, context: Context) -> Any:
        """Hands a request to a servicer method, which from here on accounts for it."""
        context.handed_over = True
        return await servicer_method(request, context)

    async def _status(self, model_spec: model_pb2.ModelSpec, context: Context) -> Any:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.CopyFrom(model_spec)
        if model_spec.version_label:  # a label names the version it points at
            version, _ = self._manager.resolve(model_spec)
            request.model_spec.version.value = version
        return json_codec.as_dict(await self._call(self._models.GetModelStatus, request, context))

    async def _metadata(self, model_spec: model_pb2.ModelSpec, context: Context) -> Any:
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=[SIGNATURE_DEF_FIELD])
        request.model_spec.CopyFrom(model_spec)
        response = await self._call(self._predictions.GetModelMetadata, request, context)
        signature_defs = get_model_metadata_pb2.SignatureDefMap()
        response.metadata[SIGNATURE_DEF_FIELD].Unpack(signature_defs)
        return {"model_spec": json_codec.as_dict(response.model_spec),
                "metadata": {SIGNATURE_DEF_FIELD: json_codec.as_dict(signature_defs)}}

    def _predict(self, model_spec: model_pb2.ModelSpec, body: dict) -> tuple[Any, Callable[[Any], Any]]:
        """The PredictRequest a JSON body stands for, and how its response becomes JSON (row or columnar)."""
        request = predict_pb2.PredictRequest()
        request.model_spec.CopyFrom(model_spec)
        request.model_spec.signature_name = json_codec.signature_name(body)
        version, runner = self._manager.resolve(model_spec)
        request.model_spec.version.value = version  # run the version whose input dtypes we read
        signature = runner.signature_defs.get(request.model_spec.signature_name or "serving_default")
        if signature is None:  # json_tensor.cc needs the input dtypes
            raise InvalidArgument(f'Serving signature name: "{short(request.model_spec.signature_name or "serving_default")}"'
                                  " not found in signature def")
        row_format = json_codec.predict_inputs(body, signature, request)

        def answer(response: predict_pb2.PredictResponse) -> Any:
            outputs = {name: tensors.to_ndarray(proto, name) for name, proto in response.outputs.items()}
            return json_codec.predictions_json(outputs) if row_format else json_codec.outputs_json(outputs)

        return request, answer

    @staticmethod
    def _classify(model_spec: model_pb2.ModelSpec, body: dict) -> tuple[Any, Callable[[Any], Any]]:
        request = _examples_request(classification_pb2.ClassificationRequest(), model_spec, body)
        return request, lambda response: {"results": [[[entry.label, entry.score] for entry in row.classes]
                                                      for row in response.result.classifications]}

    @staticmethod
    def _regress(model_spec: model_pb2.ModelSpec, body: dict) -> tuple[Any, Callable[[Any], Any]]:
        request = _examples_request(regression_pb2.RegressionRequest(), model_spec, body)
        return request, lambda response: {"results": [regression.value for regression in response.result.regressions]}


def _model_spec(match: re.Match) -> model_pb2.ModelSpec:
    """The ModelSpec a /v1/models/... path names."""
    model_spec = model_pb2.ModelSpec(name=json_codec.text(match["name"], "Failed to decode model name:"))
    if match["version"]:
        digits = match["version"].lstrip("0") or "0"  # as absl::SimpleAtoi into an int64 (http_rest_api_util.cc)
        if len(digits) > 19 or int(digits) > json_codec.INT64_MAX:
            raise InvalidArgument(f"Failed to convert version: {short(match['version'])} to numeric.")
        model_spec.version.value = int(digits)
    elif match["label"]:
        model_spec.version_label = json_codec.text(match["label"], "Failed to decode model version label:")
    return model_spec


def _examples_request(request: Any, model_spec: model_pb2.ModelSpec, body: dict) -> Any:
    """A Classify or Regress request from the JSON body's "examples" (and "context"), for the model named in the URL."""
    request.model_spec.CopyFrom(model_spec)
    request.model_spec.signature_name = json_codec.signature_name(body)
    json_codec.fill_examples(body, request.input)
    return request
