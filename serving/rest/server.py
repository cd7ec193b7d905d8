"""TF Serving's REST API (`--rest_api_port`): the gRPC services, reached over HTTP/JSON.

Routes, JSON formats and status codes follow TF Serving (model_servers/http_rest_api_handler.cc,
util/json_tensor.cc, model_servers/http_server.cc):

    GET  /v1/models/{m}[/versions/{v} | /labels/{l}]            model status (GetModelStatus as JSON)
    GET  /v1/models/{m}[/versions/{v} | /labels/{l}]/metadata   GetModelMetadata (signature_def)
    POST /v1/models/{m}[/versions/{v} | /labels/{l}]:predict    {"instances": [...]} or {"inputs": ...}
    POST /v1/models/{m}[/versions/{v} | /labels/{l}]:classify   {"examples": [...], "context": {...}}
    POST /v1/models/{m}[/versions/{v} | /labels/{l}]:regress

Each JSON body becomes the same request proto a gRPC client would send, and the same servicer
methods answer it (PredictionService, ModelService), inside the manager's request scope and through
the same batcher: REST and gRPC give the same numbers. Failures are {"error": "..."} with the gRPC
code mapped as TF Serving's ToHTTPStatusCode does. Unlike TF Serving, float16 and bfloat16 outputs are
written as JSON numbers. As in TF Serving, the port is plain HTTP, --ssl_config_file or not.

aiohttp serves the port from its own event loop in a background thread. A Predict is answered on the
loop up to its model call, which it awaits like a gRPC Predict (the batch or the worker pool runs
it), so a request waiting for its batch holds no thread; the other requests run on a thread pool, so
one slow model does not hold up the others.

Hostile or careless clients are bounded (serving/limits.py): a connection that has not sent a
complete request head within the idle timeout is closed, a body that does not arrive within the read
timeout gets 408, connections beyond the cap get 503 and are closed at once, and a JSON body nested
deeper than MAX_JSON_DEPTH or with a number longer than MAX_JSON_NUMBER_CHARS is refused before it is
parsed (serving/json_codec.py, the JSON codec). Every client mistake is a 4xx with one line, and
malformed HTTP is logged without a traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import sys
import threading
import time
from typing import Any, Callable

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2, model_pb2,
                                     predict_pb2, regression_pb2)

from serving.rest import json_codec
from serving.servable import tensors
from serving.errors import (Internal, InvalidArgument, NotFound, ServingError, call_with_status,
                            call_with_status_async)
from serving.limits import (DEFAULT_REST_API_IDLE_TIMEOUT_S, DEFAULT_REST_API_MAX_BODY_BYTES,
                            DEFAULT_REST_API_READ_TIMEOUT_S, default_max_threads, default_rest_api_max_connections)
from serving.manager.model_manager import ModelManager
from serving.model_service import ModelService
from serving.monitoring import Metrics
from serving.prediction_service import SIGNATURE_DEF_FIELD, PredictionService
from serving.request_log import RequestLog
from serving.servable.saved_model import DEFAULT_SIGNATURE

log = logging.getLogger(__name__)

# A predict body larger than this is parsed, and its answer written, on a worker thread rather than on the
# event loop (a single-row request is a few KiB).
INLINE_BODY_BYTES = 65_536

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


class _Context:
    """The one part of grpc.ServicerContext the servicers use: abort(code, message), raised as a ServingError."""

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise ServingError(message, code)


class _AsyncContext:
    """_Context for the coroutine servicer methods (grpc.aio's abort is a coroutine)."""

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise ServingError(message, code)


class RestApi:
    """Answers REST requests with the gRPC servicers; handle() is synchronous and thread-safe.

    Args:
        manager: the loaded models.
        prediction_service: the gRPC server's PredictionService (same batcher, same flags).
        metrics: counts the requests that fail before a servicer sees them (bad JSON, unknown model,
            a malformed path, a body over the limit); the servicers count the others.
    """

    def __init__(self, manager: ModelManager, prediction_service: PredictionService,
                 metrics: Metrics | None = None) -> None:
        self._manager = manager
        self._predictions = prediction_service
        self._models = ModelService(manager)
        self._metrics = metrics
        self._local = threading.local()  # per request (one thread each): did a servicer answer it?

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        """(HTTP status, JSON-able body) for one request; errors are {"error": message}."""
        start = time.monotonic()
        self._local.answered = False
        payload, code, message = call_with_status(self._scoped_dispatch, method, path, body)
        if code == grpc.StatusCode.OK:
            return 200, payload
        if not self._local.answered:
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

    def _call(self, servicer_method: Callable[[Any, Any], Any], request: Any) -> Any:
        """Hands a request to a gRPC servicer method, which from here on accounts for it."""
        self._local.answered = True
        return servicer_method(request, _Context())

    def _scoped_dispatch(self, method: str, path: str, body: bytes) -> Any:
        with self._manager.request_scope():
            return self._dispatch(method, path, body)

    async def handle_async(self, method: str, path: str, body: bytes,
                           executor: concurrent.futures.Executor) -> tuple[int, Any]:
        """handle() for the event loop: a Predict is answered on the loop up to its model call, which it
        awaits (PredictionService.Predict), so waiting holds no thread; a body over INLINE_BODY_BYTES is
        parsed and its answer written on executor. Every other request runs handle() on executor."""
        loop = asyncio.get_running_loop()
        match = PREDICTION_PATH.fullmatch(path) if method == "POST" else None
        if match is None or match["method"].lower() != "predict" or not path.lower().startswith("/v1/"):
            return await loop.run_in_executor(executor, self.handle, method, path, body)
        start, state = time.monotonic(), {"answered": False}
        payload, code, message = await call_with_status_async(self._predict_async, match, body, executor, state)
        if code == grpc.StatusCode.OK:
            return 200, payload
        if not state["answered"]:
            self.observe_failure(method, path, code, time.monotonic() - start)
        return HTTP_STATUS.get(code, 500), {"error": message}

    async def _predict_async(self, match: re.Match, body: bytes, executor: concurrent.futures.Executor,
                             state: dict) -> Any:
        loop = asyncio.get_running_loop()
        inline = len(body) <= INLINE_BODY_BYTES
        with self._manager.request_scope():
            model_spec = self._model_spec(match)
            request, row_format = (self._predict_request(model_spec, body) if inline else
                                   await loop.run_in_executor(executor, self._predict_request, model_spec, body))
            state["answered"] = True  # from here on the servicer accounts for it
            response = await self._predictions.Predict(request, _AsyncContext())
        return (self._predict_answer(response, row_format) if inline else
                await loop.run_in_executor(executor, self._predict_answer, response, row_format))

    def _dispatch(self, method: str, path: str, body: bytes) -> Any:
        if not path.lower().startswith("/v1/"):  # TF Serving hands only /v1/ paths to its REST handler
            raise NotFound(f"Not found: {method} {path}; the REST API serves /v1/models/...")
        match = PREDICTION_PATH.fullmatch(path) if method == "POST" else STATUS_PATH.fullmatch(path)
        if method not in ("GET", "POST") or match is None:
            raise InvalidArgument(f"Malformed request: {json_codec.short(method)} {json_codec.short(path)}")
        model_spec = self._model_spec(match)
        if method == "GET":
            return self._metadata(model_spec) if match["metadata"] else self._status(model_spec)
        if match["method"].lower() == "predict":  # handle_async answers these; handle() only when called itself
            raise Internal("REST predict is answered on the event loop (RestApi.handle_async)")
        request = json_codec.parse_body(body)
        handlers: dict[str, Callable[[model_pb2.ModelSpec, dict], Any]] = {
            "classify": self._classify, "regress": self._regress}
        return handlers[match["method"].lower()](model_spec, request)

    @staticmethod
    def _model_spec(match: re.Match) -> model_pb2.ModelSpec:
        """The ModelSpec a /v1/models/... path names."""
        model_spec = model_pb2.ModelSpec(name=json_codec.text(match["name"], "Failed to decode model name:"))
        if match["version"]:
            digits = match["version"].lstrip("0") or "0"  # as absl::SimpleAtoi into an int64 (http_rest_api_util.cc)
            if len(digits) > 19 or int(digits) > json_codec.INT64_MAX:
                raise InvalidArgument(f"Failed to convert version: {json_codec.short(match['version'])} to numeric.")
            model_spec.version.value = int(digits)
        elif match["label"]:
            model_spec.version_label = json_codec.text(match["label"], "Failed to decode model version label:")
        return model_spec

    def _status(self, model_spec: model_pb2.ModelSpec) -> Any:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.CopyFrom(model_spec)
        if model_spec.version_label:  # a label names the version it points at
            version, _ = self._manager.resolve(model_spec)
            request.model_spec.version.value = version
        return json_codec.as_dict(self._call(self._models.GetModelStatus, request))

    def _metadata(self, model_spec: model_pb2.ModelSpec) -> Any:
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=[SIGNATURE_DEF_FIELD])
        request.model_spec.CopyFrom(model_spec)
        response = self._call(self._predictions.GetModelMetadata, request)
        signature_defs = get_model_metadata_pb2.SignatureDefMap()
        response.metadata[SIGNATURE_DEF_FIELD].Unpack(signature_defs)
        return {"model_spec": json_codec.as_dict(response.model_spec), "metadata": {SIGNATURE_DEF_FIELD: json_codec.as_dict(signature_defs)}}

    def _predict_request(self, model_spec: model_pb2.ModelSpec, body: bytes) -> tuple[predict_pb2.PredictRequest, bool]:
        """The PredictRequest a JSON body stands for, and whether it used the row ("instances") format."""
        parsed = json_codec.parse_body(body)
        request = predict_pb2.PredictRequest()
        request.model_spec.CopyFrom(model_spec)
        request.model_spec.signature_name = json_codec.signature_name(parsed)
        version, runner = self._manager.resolve(model_spec)
        request.model_spec.version.value = version  # run the version whose input dtypes we read
        signature = runner.signature_defs.get(request.model_spec.signature_name or DEFAULT_SIGNATURE)
        if signature is None:  # json_tensor.cc needs the input dtypes
            raise InvalidArgument(f'Serving signature name: "{request.model_spec.signature_name or DEFAULT_SIGNATURE}"'
                                  " not found in signature def")
        row_format = json_codec.predict_inputs(parsed, signature, request)
        return request, row_format

    @staticmethod
    def _predict_answer(response: predict_pb2.PredictResponse, row_format: bool) -> Any:
        outputs = {name: tensors.to_ndarray(proto, name) for name, proto in response.outputs.items()}
        return json_codec.predictions_json(outputs) if row_format else json_codec.outputs_json(outputs)

    def _classify(self, model_spec: model_pb2.ModelSpec, body: dict) -> Any:
        request = classification_pb2.ClassificationRequest()
        request.model_spec.CopyFrom(model_spec)
        request.model_spec.signature_name = json_codec.signature_name(body)
        json_codec.fill_examples(body, request.input)
        response = self._call(self._predictions.Classify, request)
        return {"results": [[[entry.label, entry.score] for entry in row.classes]
                            for row in response.result.classifications]}

    def _regress(self, model_spec: model_pb2.ModelSpec, body: dict) -> Any:
        request = regression_pb2.RegressionRequest()
        request.model_spec.CopyFrom(model_spec)
        request.model_spec.signature_name = json_codec.signature_name(body)
        json_codec.fill_examples(body, request.input)
        response = self._call(self._predictions.Regress, request)
        return {"results": [regression.value for regression in response.result.regressions]}


class _ClientErrorLog(logging.LoggerAdapter):
    """aiohttp's connection logger: a client's malformed HTTP (a bad request line or header) is one line
    at debug level, never a traceback; anything else keeps aiohttp's traceback."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, (HttpProcessingError, ConnectionError)):
            self.debug(f"{msg}: %s", *args, error)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


class _Refusal(asyncio.Protocol):
    """A connection over --rest_api_max_connections: answered 503 (retry later) and closed at once, so its
    descriptor is free again before the client has sent anything."""

    BODY = json.dumps({"error": "Too many connections to the REST API (--rest_api_max_connections); "
                                "retry later"}).encode()
    RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.RESPONSE)
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted from the moment it is accepted (asyncio accepts up
    to 100 connections per event-loop turn, before aiohttp sees any of them) until it is closed."""

    def __init__(self, inner: asyncio.Protocol, server: "RestServer") -> None:
        self._inner, self._server = inner, server
        server.open_connections += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.open_connections -= 1
        self._inner.connection_lost(exc)


class RestServer:
    """The HTTP port: aiohttp on its own event loop in a daemon thread.

    Args:
        api: answers requests (RestApi).
        max_threads: worker threads for the blocking servicer calls.
        max_body_bytes: larger request bodies get 413 (--rest_api_max_body_bytes).
        metrics: served in Prometheus' text format at metrics.path (--monitoring_config_file).
        max_connections: open connections at most; more are answered 503 and closed
            (--rest_api_max_connections; None: half the open-file limit).
        idle_timeout_s: a connection that has not sent a complete request head this long after it
            opened or after its last answer is closed (--rest_api_idle_timeout_s).
        read_timeout_s: a body that has not fully arrived this long after its head gets 408
            (--rest_api_read_timeout_s).
    """

    def __init__(self, api: RestApi, *, max_threads: int, max_body_bytes: int = DEFAULT_REST_API_MAX_BODY_BYTES,
                 metrics: Metrics | None = None, max_connections: int | None = None,
                 idle_timeout_s: float = DEFAULT_REST_API_IDLE_TIMEOUT_S,
                 read_timeout_s: float = DEFAULT_REST_API_READ_TIMEOUT_S) -> None:
        self._api = api
        self._max_body_bytes, self._metrics = max_body_bytes, metrics
        self._max_connections = max_connections or default_rest_api_max_connections()
        self._idle_timeout_s, self._read_timeout_s = idle_timeout_s, read_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="rest")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rest-api", daemon=True)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._refused_warning_at = 0.0
        self.open_connections = 0  # changed on the event loop's thread only

    def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listens on host:port (0 picks a free port) and returns the bound port; reuse_port lets other
        processes listen on it too (SO_REUSEPORT, --reuse_port).

        Raises:
            RuntimeError: the address could not be bound.
        """
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self._start(host, port, reuse_port), self._loop).result(30)
        except OSError as error:
            raise RuntimeError(f"cannot listen on {host}:{port} for the REST API: {error.strerror}") from None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stops accepting connections, lets running requests finish within grace_s, then stops the loop."""
        if self._runner is not None:
            future = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
            try:
                future.result(grace_s + 5)
            except concurrent.futures.TimeoutError:
                log.warning("REST API did not stop within %.0f s", grace_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._pool.shutdown(wait=False)

    async def _start(self, host: str, port: int, reuse_port: bool) -> int:
        app = web.Application(client_max_size=self._max_body_bytes)
        app.router.add_route("*", "/{path:.*}", self._handle)
        # aiohttp closes a connection still waiting for a complete request head keepalive_timeout
        # after it opened or after its last answer; lingering (reading an unread body before closing)
        # is bounded by the read timeout.
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self._idle_timeout_s,
                                     lingering_time=min(10.0, self._read_timeout_s),
                                     logger=_ClientErrorLog(logging.getLogger("aiohttp.server"), {}))
        await self._runner.setup()
        self._listener = await asyncio.get_running_loop().create_server(self._connection, host, port,
                                                                        reuse_port=reuse_port or None)
        return self._listener.sockets[0].getsockname()[1]  # the port actually bound (port 0)

    async def _stop(self) -> None:
        if self._listener is not None:
            self._listener.close()  # no new connections
        await self._runner.cleanup()  # idle connections close, running requests finish

    def _connection(self) -> asyncio.Protocol:
        """The protocol for a new connection: aiohttp's, or past the connection cap a 503 refusal."""
        server = self._runner.server
        if server is not None and self.open_connections < self._max_connections:
            return _Counted(server(), self)
        now = time.monotonic()
        if now - self._refused_warning_at > 60:
            self._refused_warning_at = now
            log.warning("REST API: %d connections open; refusing more with 503 (--rest_api_max_connections)",
                        self._max_connections)
        return _Refusal()

    async def _handle(self, request: web.Request) -> web.Response:
        if self._metrics is not None and request.method == "GET" and request.path == self._metrics.path:
            return web.Response(body=self._metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
        try:
            async with asyncio.timeout(self._read_timeout_s):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            message = (f"Request body is larger than the limit of {self._max_body_bytes} bytes "
                       "(--rest_api_max_body_bytes)")
            self._api.observe_failure(request.method, request.path, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
            return web.Response(status=413, text=json.dumps({"error": message}), content_type="application/json")
        except TimeoutError:
            message = (f"Request body did not arrive within {self._read_timeout_s:g} s (--rest_api_read_timeout_s)")
            self._api.observe_failure(request.method, request.path, grpc.StatusCode.DEADLINE_EXCEEDED, 0.0)
            response = web.Response(status=408, text=json.dumps({"error": message}), content_type="application/json")
            response.force_close()
            return response
        status, payload = await self._api.handle_async(request.method, request.path, body, self._pool)
        return web.Response(status=status, body=json_codec.dumps(payload), content_type="application/json")


def start_rest_server(host: str, port: int, manager: ModelManager, *, batcher: Any = None,
                      max_threads: int | None = None,
                      enable_signature_method_name_check: bool = False,
                      max_body_bytes: int = DEFAULT_REST_API_MAX_BODY_BYTES,
                      metrics: Metrics | None = None,
                      request_log: RequestLog | None = None,
                      max_connections: int | None = None,
                      idle_timeout_s: float = DEFAULT_REST_API_IDLE_TIMEOUT_S,
                      read_timeout_s: float = DEFAULT_REST_API_READ_TIMEOUT_S,
                      reuse_port: bool = False) -> tuple[RestServer, int]:
    """Serves the REST API for manager's models on host:port (-1 picks a free port); returns (server, port).

    Raises:
        RuntimeError: the address could not be bound.
    """
    predictions = PredictionService(manager, enable_signature_method_name_check=enable_signature_method_name_check,
                                    batcher=batcher, metrics=metrics, api="rest", request_log=request_log)
    server = RestServer(RestApi(manager, predictions, metrics), max_threads=max_threads or default_max_threads(),
                        max_body_bytes=max_body_bytes, metrics=metrics, max_connections=max_connections,
                        idle_timeout_s=idle_timeout_s, read_timeout_s=read_timeout_s)
    return server, server.start(host, max(port, 0), reuse_port)
