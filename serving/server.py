"""The gRPC front end: PredictionService, ModelService, grpc.health.v1 and the Open Inference Protocol's
inference.GRPCInferenceService (serving/v2/grpc_service.py) on one grpc.aio port.

It runs on the server's one event loop (serving/app.py), beside the REST front end. Every servicer
method is a coroutine: a call is taken, checked and answered on the loop, and whatever blocks (a
model call, a large request's decoding, a reload) is awaited on the worker pool (--grpc_max_threads
threads) or the batcher, so a waiting request holds no thread. Every RPC runs inside the manager's
request scope, so a version unloaded mid-request stays open until the request ends. Health follows
the models: SERVING while a model has an AVAILABLE version (grpc_health's asyncio servicer, so a
Watch stream holds no thread either).

Drain (serving/app.py Server.stop): health turns NOT_SERVING at once; calls keep being answered for
limits.DRAIN_ADMIT_S more, so that those gRPC had already received when the signal came (queued inside
it, not yet handed to the server) are answered, not refused; later calls are answered UNAVAILABLE
(retry elsewhere); every call accepted is answered within the grace period. gRPC would answer
CANCELLED to a call still queued inside it when the server stops, so the server keeps taking calls
off that queue (refusing them) until none has come for a moment, and only then stops. The port is the
server's alone (gRPC's SO_REUSEPORT off) unless --reuse_port asks for
sharing it, so a second server on a taken port fails to start. With --ssl_config_file the port speaks
TLS only (serving/tls.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc

from serving.errors import cancelled_code, short
from serving.flags import Options
from serving.limits import SHUTTING_DOWN, Admission, grpc_server_options
from serving.manager.model_manager import ModelManager
from serving.model_service import ModelService
from serving.prediction_service import PredictionService, request_bytes
from serving.tls import SslConfig, server_credentials
from serving.v2 import grpc_service as v2_grpc
from serving.v2.grpc_service import InferenceServicer
from serving.v2.service import InferenceService

log = logging.getLogger(__name__)

# How a call answered before the servicer saw it is counted: (rpc, request or None, status, seconds).
Count = Callable[[str, Any, grpc.StatusCode, float], None]

_HEALTH_METHODS = "/grpc.health.v1.Health/"  # still answered while draining: they say NOT_SERVING
_PREDICTION_METHODS = "/tensorflow.serving.PredictionService/"  # counted in request_count by status
# Draining waits until no call has arrived for SETTLE_S (at most MAX_SETTLE_S) before gRPC stops: by
# then every call that reached the server has been taken off gRPC's queue, accepted or refused.
SETTLE_S = 0.2
MAX_SETTLE_S = 1.0
DECODE_WARNING_INTERVAL_S = 60.0
# A call that ends without a message was cancelled (or expired) if gRPC says so within this; else none was sent.
CANCEL_NOTICE_S = 0.05


class GrpcFrontEnd:
    """One bound, started grpc.aio server; use `await GrpcFrontEnd.start(...)`."""

    def __init__(self, server: grpc.aio.Server, port: int, calls: "_Calls",
                 health_servicer: health.aio.HealthServicer, inference: InferenceService) -> None:
        self.port = port
        self.health = health_servicer
        self._inference = inference
        self._server, self._calls = server, calls

    @classmethod
    async def start(cls, options: Options, manager: ModelManager, admission: Admission,
                    services: tuple[PredictionService, ModelService],
                    ssl_config: SslConfig | None = None) -> "GrpcFrontEnd":
        """Binds options.host:options.port (0 picks a port) and starts serving the two services and health.

        Raises:
            RuntimeError: the address could not be bound.
        """
        calls = _Calls(manager, admission, services[0].count_unanswered)
        server = grpc.aio.server(interceptors=[calls],
                                 options=grpc_server_options(options.grpc_channel_arguments, options.reuse_port))
        health_servicer = health.aio.HealthServicer()
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(services[0], server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(services[1], server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        raw = services[0].answering_in_tensor_content()
        inference = InferenceServicer(InferenceService(manager, raw.Predict, raw.executor, raw.count_unanswered))
        v2_grpc.add_to_server(inference, server)
        address = _address(options.host, options.port)
        try:
            port = (server.add_insecure_port(address) if ssl_config is None
                    else server.add_secure_port(address, server_credentials(ssl_config)))
        except RuntimeError as error:  # grpc's "Failed to bind to address ...; set GRPC_VERBOSITY=debug ..."
            raise RuntimeError(f"cannot listen on {address}: {str(error).split(';')[0]} (the port is taken, or the "
                               "address is not this machine's)") from None
        if port == 0:  # older grpcio returns 0 instead of raising
            raise RuntimeError(f"cannot listen on {address}")
        await server.start()
        return cls(server, port, calls, health_servicer, inference.service)

    async def begin_drain(self, refuse_from: float) -> None:
        """Health NOT_SERVING for "" and every model; calls arriving from time.monotonic() refuse_from on are
        answered UNAVAILABLE."""
        await self.health.enter_graceful_shutdown()
        self._inference.draining = True  # ServerReady and ModelReady say false from now on
        self._calls.refuse_from = refuse_from

    async def stop(self, deadline: float) -> None:
        """Lets the accepted calls finish (until the time.monotonic() deadline), then stops the server; what is
        still running then is cancelled."""
        await self._calls.settle(deadline)
        await self._server.stop(max(deadline - time.monotonic(), 0.0))


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"  # IPv6 literal


class _Calls(grpc.aio.ServerInterceptor):
    """Every unary call is admitted first (limits.Admission: RESOURCE_EXHAUSTED beyond the requests or bytes in
    flight), then runs inside manager.request_scope(), with its size on the wire in request_bytes (so large
    requests are prepared on the worker pool); a message that does not parse is INVALID_ARGUMENT; while
    draining, calls (but health's) arriving from refuse_from on are refused UNAVAILABLE. `running` counts the
    calls being answered, `last_call` is when the latest arrived.

    Every PredictionService call that reaches the server is counted by its status (count_unanswered), those
    answered here too: refused, unparsable, or expired or cancelled before their message arrived (a loaded
    server's queue: 547 of 712 calls with 50 ms deadlines once ended there, uncounted, issue 31 #6). So the
    handler is served as stream-unary: grpc.aio hands it the call at once, before the message is read
    (for a unary handler it drops a call whose message never came without a word), and the one message
    is read here. On the wire a unary call and a one-message stream are the same.

    grpc.aio asks the interceptor on its event loop for every call, as the call arrives, so the scoped
    handler is built once per method and reused (the services' handlers never change after start-up).
    """

    def __init__(self, manager: ModelManager, admission: Admission, count: Count | None = None) -> None:
        self._manager, self._admission, self._count = manager, admission, count
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self.refuse_from = float("inf")  # calls arriving from then on (but health's) are refused: draining
        self.last_call = time.monotonic()
        self.running = 0

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001 - grpc's interface
        method = handler_call_details.method
        self.last_call = time.monotonic()
        if self.last_call >= self.refuse_from and not method.startswith(_HEALTH_METHODS):
            self._counted(method, None, grpc.StatusCode.UNAVAILABLE, self.last_call)
            return _REFUSED
        if method in self._handlers:
            return self._handlers[method]
        handler = await continuation(handler_call_details)
        if handler is not None and handler.unary_unary is not None:
            handler = self._scoped(method, handler)
        if handler is not None:  # unknown methods are not cached: a client could send any name
            self._handlers[method] = handler
        return handler  # health's Watch stream resolves no model: served as it is

    def _counted(self, method: str, request: Any, code: grpc.StatusCode, start: float) -> None:
        if self._count is not None and method.startswith(_PREDICTION_METHODS):
            self._count(method[len(_PREDICTION_METHODS):], request, code, time.monotonic() - start)

    def _scoped(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior, request_scope = handler.unary_unary, self._manager.request_scope

        async def refuse(request: Any, code: grpc.StatusCode, message: str, context: grpc.aio.ServicerContext,
                         start: float) -> None:
            self._counted(method, request, code, start)
            await context.abort(code, message)

        async def scoped(_requests: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.monotonic()
            try:
                request = await context.read()
                if request is grpc.aio.EOF and not _expired(context):  # none sent, or cancelled: core says which
                    await asyncio.sleep(CANCEL_NOTICE_S)  # a moment later, by cancelling this task
            except asyncio.CancelledError:  # expired or cancelled in the queue, before its message was read
                self._counted(method, None, cancelled_code(context), start)
                raise
            if request is grpc.aio.EOF:
                if context.cancelled() or _expired(context):
                    await refuse(None, cancelled_code(context), "", context, start)  # answered by gRPC already
                await refuse(None, grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message",
                             context, start)
            if isinstance(request, _Undecodable):
                await refuse(request, grpc.StatusCode.INVALID_ARGUMENT, request.message, context, start)
            size = request_bytes.get()
            refusal = self._admission.admit(size)
            if refusal:
                await refuse(request, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, context, start)
            self.running += 1  # on the loop's thread only: no lock
            try:
                with request_scope():
                    return await behavior(request, context)
            finally:
                self.running -= 1
                self._admission.release(size)

        return grpc.stream_unary_rpc_method_handler(scoped, request_deserializer=_checked(handler.request_deserializer),
                                                    response_serializer=handler.response_serializer)

    async def settle(self, deadline: float) -> None:
        """Waits (until deadline) for refusing to begin and the accepted calls to return, then until no call has
        arrived for SETTLE_S (at most MAX_SETTLE_S more): with nothing running to slow it down, gRPC's polling
        thread has by then taken every call that reached the server off its queue."""
        while (self.running or time.monotonic() < self.refuse_from) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        until = min(time.monotonic() + MAX_SETTLE_S, deadline)
        while time.monotonic() < until and time.monotonic() - self.last_call < SETTLE_S:
            await asyncio.sleep(0.02)


def _expired(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class _Undecodable:
    """What a request that does not parse as its RPC's message becomes: answered INVALID_ARGUMENT, not gRPC's
    UNKNOWN with a traceback (a client's mistake; gRPC's C++ server, so TF Serving, answers INTERNAL)."""

    def __init__(self, message: str) -> None:
        self.message = message


_undecodable_warned_at = [-DECODE_WARNING_INTERVAL_S]


def _checked(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """deserializer, noting the message's size for the call (grpc.aio deserializes in the call's own task), and
    turning a message that does not parse into _Undecodable (one log line at most every minute)."""
    def deserialize(data: bytes) -> Any:
        request_bytes.set(len(data))
        try:
            return deserializer(data)
        except DecodeError as error:
            message = f"Failed to parse the request ({len(data)} bytes) as its RPC's message: {short(str(error))}"
            now = time.monotonic()
            if now - _undecodable_warned_at[0] >= DECODE_WARNING_INTERVAL_S:
                _undecodable_warned_at[0] = now
                log.warning("%s (logged at most every %.0f s)", message, DECODE_WARNING_INTERVAL_S)
            return _Undecodable(message)

    return deserialize


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:  # noqa: ANN001 - raw bytes: never deserialized
    await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)


_REFUSED = grpc.unary_unary_rpc_method_handler(_refuse)


async def follow_health(manager: ModelManager, health_servicer: health.aio.HealthServicer) -> Callable:
    """Keeps each model's health status in step with its versions (SERVING while one is AVAILABLE), whichever
    thread the manager reports on; returns the listener, for ModelManager.remove_listener."""
    loop = asyncio.get_running_loop()
    seen: set[str] = set()  # touched on the loop only

    async def apply() -> None:  # reads the manager when it runs, so the last one applied is the latest state
        names = set(manager.model_names)
        for name in sorted(names):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING if manager.versions(name)
                                      else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in seen - names:  # removed by a reload
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        seen.update(names)

    def update(manager: ModelManager) -> None:
        asyncio.run_coroutine_threadsafe(apply(), loop)

    await apply()
    manager.add_listener(update)
    return update
