"""The gRPC server: PredictionService, ModelService and grpc.health.v1 on one port.

Models are loaded before the port is bound, so anything answering on the port can serve. Every RPC
runs inside the manager's request scope, so a version unloaded mid-request stays open until the
request ends. Health follows the models: SERVING while a model has an AVAILABLE version.

The front end is grpc.aio: one event loop takes every call, and Predict runs on it up to the model
call, which it awaits (a batch thread or the worker pool runs it), so a request waiting for its batch
holds no thread and every waiting request can join the next batch. The other RPCs (Classify,
Regress, MultiInference, metadata, ModelService, health) are plain functions that grpc.aio runs on
the worker pool (--grpc_max_threads threads), as do Predicts that run unbatched.

Shutdown (SIGTERM or SIGINT) drains: health turns NOT_SERVING, calls that arrive from then on are
answered UNAVAILABLE (retry elsewhere), and every call accepted before is answered, within the grace
period. gRPC would answer CANCELLED to a call still queued inside it when the server stops, so the
server keeps taking calls off that queue (refusing them) until none has come for a moment, and only
then stops. The port is the server's alone (gRPC's SO_REUSEPORT off) unless reuse_port asks for
sharing it, so a second server on a taken port fails to start. With --ssl_config_file the port
speaks TLS only (serving/tls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc

from serving.batching.scheduler import Batcher
from serving.errors import LoadError
from serving.limits import UNLIMITED_MESSAGES, default_max_threads
from serving.manager.model_config import single_model_config
from serving.manager.model_manager import ModelManager
from serving.model_service import ModelService, ReloadPolicy
from serving.monitoring import Metrics
from serving.prediction_service import PredictionService
from serving.request_log import RequestLog
from serving.tls import SslConfig, server_credentials

log = logging.getLogger(__name__)

_HEALTH_METHODS = "/grpc.health.v1.Health/"  # still answered while draining: they say NOT_SERVING
# Draining waits until no call has arrived for SETTLE_S (at most MAX_SETTLE_S) before gRPC stops: by
# then every call that reached the server has been taken off gRPC's queue, accepted or refused.
SETTLE_S = 0.2
MAX_SETTLE_S = 1.0
SHUTTING_DOWN = "the server is shutting down; send the request to another server"


def create_server(address: str, manager: ModelManager, *, max_threads: int | None = None,
                  enable_signature_method_name_check: bool = False,
                  batcher: Batcher | None = None, metrics: Metrics | None = None,
                  channel_arguments: list[tuple[str, int | str]] | None = None,
                  ssl_config: SslConfig | None = None, request_log: RequestLog | None = None,
                  reload_policy: ReloadPolicy | None = None, reuse_port: bool = False,
                  ) -> tuple["GrpcServer", int, "Drain"]:
    """Builds and starts a server on address ("host:port", port 0 = pick one) for the loaded models.

    With a batcher (--enable_batching), concurrent requests are merged per model version and
    signature; its queues follow the manager, so a version's queue drains and stops when it unloads.
    With metrics (--monitoring_config_file), requests, batches and model load/unload events are counted.
    channel_arguments are gRPC server options (--grpc_channel_arguments); the default lifts gRPC's
    message size limits, as TF Serving does. With ssl_config (--ssl_config_file) the port speaks TLS
    only, and with its client_verify only to clients whose certificate custom_ca signed. With a
    request_log, successful requests of models whose config has a logging_config are sampled to it.
    reload_policy says whether (and from where) HandleReloadConfigRequest may reload (default: never).
    reuse_port lets other processes listen on the same port (SO_REUSEPORT), for workers sharing it on
    purpose; without it a taken port is an error (a "grpc.so_reuseport" channel argument wins).

    Returns:
        (server, bound port, drain for shutdown()). Health reports SERVING for "" and for every model with
        an AVAILABLE version, and follows reloads.

    Raises:
        RuntimeError: the address could not be bound.
    """
    options = list(UNLIMITED_MESSAGES) if channel_arguments is None else list(channel_arguments)
    if not any(key == "grpc.so_reuseport" for key, _ in options):
        options.append(("grpc.so_reuseport", int(reuse_port)))
    scope = _RequestScope(manager)
    health_servicer = health.HealthServicer()
    workers = futures.ThreadPoolExecutor(max_workers=max_threads or default_max_threads(), thread_name_prefix="grpc")

    def add_services(server: grpc.aio.Server) -> None:
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
            PredictionService(manager, enable_signature_method_name_check=enable_signature_method_name_check,
                              batcher=batcher, metrics=metrics, request_log=request_log, executor=workers), server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(manager, reload_policy), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    _follow_health(manager, health_servicer)
    if batcher is not None:
        follow_versions(manager, batcher)
    if metrics is not None:
        metrics.follow_models(manager)
        if batcher is not None:
            batcher.add_listener(metrics.observe_batch)
    server = GrpcServer.start(address, add_services, workers=workers, interceptors=[scope], options=options,
                              credentials=None if ssl_config is None else server_credentials(ssl_config))
    if request_log is not None:  # only now: a server that cannot start leaves no empty log files
        request_log.follow_models(manager)
    return server, server.port, Drain(health_servicer, scope)


class GrpcServer:
    """A grpc.aio server on an event loop of its own (a daemon thread), driven from plain threads with
    grpc.Server's stop(grace).wait().

    Use GrpcServer.start(address, add_services, ...); add_services(aio_server) registers the servicers.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 workers: futures.ThreadPoolExecutor) -> None:
        self._loop, self._thread, self._workers = loop, thread, workers
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self._stopped = threading.Event()
        self._stopping = False

    @classmethod
    def start(cls, address: str, add_services: Callable[[grpc.aio.Server], None], *,
              workers: futures.ThreadPoolExecutor, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
              options: Sequence[tuple[str, int | str]] = UNLIMITED_MESSAGES,
              credentials: grpc.ServerCredentials | None = None) -> "GrpcServer":
        """Binds address ("host:port", port 0 = pick one) and starts serving.

        Raises:
            RuntimeError: the address could not be bound.
        """
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
        thread.start()
        server = cls(loop, thread, workers)
        try:
            asyncio.run_coroutine_threadsafe(server._start(address, add_services, interceptors, options, credentials),
                                             loop).result()
        except BaseException:
            server._close_loop()
            raise
        return server

    async def _start(self, address: str, add_services: Callable[[grpc.aio.Server], None],
                     interceptors: Sequence[grpc.aio.ServerInterceptor], options: Sequence[tuple[str, int | str]],
                     credentials: grpc.ServerCredentials | None) -> None:
        self._server = grpc.aio.server(migration_thread_pool=self._workers, interceptors=list(interceptors),
                                       options=list(options))
        add_services(self._server)
        try:
            port = (self._server.add_insecure_port(address) if credentials is None
                    else self._server.add_secure_port(address, credentials))
        except RuntimeError as error:  # grpc's "Failed to bind to address ...; set GRPC_VERBOSITY=debug ..."
            raise RuntimeError(f"cannot listen on {address}: {str(error).split(';')[0]} (the port is taken, or the "
                               "address is not this machine's)") from None
        if port == 0:  # older grpcio returns 0 instead of raising
            raise RuntimeError(f"cannot listen on {address}")
        self.port = port
        await self._server.start()

    def stop(self, grace: float | None) -> threading.Event:
        """Stops taking calls; calls running now get grace seconds (None: none) to finish, then are cancelled.
        Returns an event that is set once the server, its loop and its workers have stopped."""
        if not self._stopping:
            self._stopping = True
            future = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)
            future.add_done_callback(lambda _: self._close_loop())
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._workers.shutdown(wait=False)
        self._stopped.set()


@contextlib.contextmanager
def serving_in_process(version_dir: str | os.PathLike, model_name: str, version: int) -> Iterator[str]:
    """Serves one version directory, wherever it lies (e.g. an export still being staged), on a free
    127.0.0.1 port of this process's own gRPC stack (model manager, warmup, PredictionService); yields
    the address and stops everything on exit.

    The version is hard-linked into a throwaway base path next to it, so the directory itself is never
    touched and nothing is copied byte by byte.

    Raises:
        LoadError: the version did not load (the message is the manager's).
    """
    version_dir = Path(version_dir)
    base = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-serve-", dir=version_dir.parent))
    manager = ModelManager(file_system_poll_wait_seconds=0)
    server = None
    try:
        shutil.copytree(version_dir, base / str(version), copy_function=os.link)
        manager.reload_config(single_model_config(model_name, base))
        if not manager.versions(model_name):
            states = manager.version_states(model_name)
            raise LoadError(f"the server did not load {version_dir}: "
                            f"{'; '.join(s.error_message for s in states.values()) or 'no version loaded'}")
        server, port, _ = create_server("127.0.0.1:0", manager, max_threads=2)
        yield f"127.0.0.1:{port}"
    finally:
        if server is not None:
            server.stop(0).wait()
        for runner in manager.versions(model_name).values():
            runner.close()
        manager.stop()
        shutil.rmtree(base, ignore_errors=True)


class _RequestScope(grpc.aio.ServerInterceptor):
    """Runs each unary RPC inside manager.request_scope(): the Runner it resolved stays open until it returns.

    grpc.aio asks the interceptor on its event loop for every call, as the call arrives, so the scoped
    handler is built once per method and reused (the services' handlers never change after start-up).
    A coroutine handler (Predict) is scoped on the loop, a plain one on the worker thread that runs it.
    Once refuse_new_calls() is called, calls arriving from then on (but health's) are answered
    UNAVAILABLE; last_call is when the latest call arrived, running how many run now.
    """

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._refusing = False
        self.last_call = time.monotonic()
        self.running = 0
        self._running_lock = threading.Lock()

    def refuse_new_calls(self) -> None:
        self._refusing = True

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001 - grpc's interface
        method = handler_call_details.method
        self.last_call = time.monotonic()
        if self._refusing and not method.startswith(_HEALTH_METHODS):
            return _REFUSED
        if method in self._handlers:
            return self._handlers[method]
        handler = await continuation(handler_call_details)
        if handler is not None and handler.unary_unary is not None:
            handler = self._scoped(handler)
        if handler is not None:  # unknown methods are not cached: a client could send any name
            self._handlers[method] = handler
        return handler  # health's Watch stream resolves no model: served as it is

    def _scoped(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior, request_scope = handler.unary_unary, self._manager.request_scope

        if inspect.iscoroutinefunction(behavior):
            async def scoped(request, context):  # noqa: ANN001
                with self._running_lock:
                    self.running += 1
                try:
                    with request_scope():
                        return await behavior(request, context)
                finally:
                    with self._running_lock:
                        self.running -= 1
        else:
            def scoped(request, context):  # noqa: ANN001
                with self._running_lock:
                    self.running += 1
                try:
                    with request_scope():
                        return behavior(request, context)
                finally:
                    with self._running_lock:
                        self.running -= 1

        return grpc.unary_unary_rpc_method_handler(scoped, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:  # noqa: ANN001 - raw bytes: never deserialized
    await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)


_REFUSED = grpc.unary_unary_rpc_method_handler(_refuse)


class Drain:
    """A graceful stop of one gRPC server, in steps: begin() (health NOT_SERVING, new calls refused), then
    shutdown(). python -m serving begins it first, so that its REST port drains at the same time."""

    def __init__(self, health_servicer: health.HealthServicer, scope: _RequestScope) -> None:
        self.health_servicer = health_servicer
        self._scope = scope
        self._deadline: float | None = None

    def begin(self, grace_s: float) -> None:
        """Health NOT_SERVING for "" and every model, new calls UNAVAILABLE; the grace period starts now."""
        if self._deadline is None:
            self._deadline = time.monotonic() + grace_s
            log.info("finishing in-flight requests (grace %.0f s); new calls are refused", grace_s)
            self.health_servicer.enter_graceful_shutdown()
            self._scope.refuse_new_calls()

    def seconds_left(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0) if self._deadline is not None else 0.0

    def settle(self) -> None:
        """Waits (within the grace period) until the accepted calls have returned, then until no call has
        arrived for SETTLE_S (at most MAX_SETTLE_S more): with nothing running to slow it down, gRPC's
        polling thread has by then taken every call that reached the server off its queue."""
        while self._scope.running and time.monotonic() < self._deadline:
            time.sleep(0.02)
        until = min(time.monotonic() + MAX_SETTLE_S, self._deadline)
        while time.monotonic() < until and time.monotonic() - self._scope.last_call < SETTLE_S:
            time.sleep(0.02)


def _follow_health(manager: ModelManager, health_servicer: health.HealthServicer) -> None:
    """Keeps each model's health status in step with its versions: SERVING while one is AVAILABLE."""
    lock = threading.Lock()
    seen: set[str] = set()

    def update(manager: ModelManager) -> None:
        with lock:
            names = set(manager.model_names)
            for name in names:
                serving = health_pb2.HealthCheckResponse.SERVING if manager.versions(name) else \
                    health_pb2.HealthCheckResponse.NOT_SERVING
                health_servicer.set(name, serving)
            for name in seen - names:  # removed by a reload
                health_servicer.set(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            seen.update(names)

    update(manager)
    manager.add_listener(update)


def follow_versions(manager: ModelManager, batcher: Batcher) -> None:
    """Retires the batch queues of versions that are no longer AVAILABLE (they drain, then stop)."""
    def update(manager: ModelManager) -> None:
        batcher.retire([runner for name in manager.model_names for runner in manager.versions(name).values()])

    manager.add_listener(update)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT; install it before announcing the port, so no signal is missed."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s received", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def shutdown(server: GrpcServer, drain: Drain, grace_s: float = 10.0) -> None:
    """Drains the server (drain.begin(grace_s) unless begun already), lets the calls it accepted finish
    within the grace period, then stops it; what is still running then is cancelled."""
    drain.begin(grace_s)
    drain.settle()
    server.stop(drain.seconds_left()).wait()
    log.info("server stopped")
