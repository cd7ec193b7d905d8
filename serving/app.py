"""`python -m serving`: build what the flags describe, start the gRPC and REST front ends on one event loop,
wait for SIGTERM or SIGINT, drain (TF Serving's Server::BuildAndStart and its wait, model_servers/server.cc).

Start-up, in order: the flags (serving/flags.py; a bad one exits 2), the files they name (model config,
monitoring, batching parameters, SSL), the ports (a taken one is refused before minutes of loading),
TensorFlow, then every configured model's latest version is loaded and AVAILABLE, and only then are
the ports bound. A file or model that cannot be used, or a port that cannot be bound, stops start-up
with one line on stderr and exit code 1 (TF Serving: "Failed to start server"), 2 for an unusable
--ssl_config_file. Once both ports listen, exactly one line goes to stdout, as TF Serving logs it:
`Running gRPC ModelServer at HOST:PORT ...` (with --port 0 this is how callers learn the port), and
with --rest_api_port a second: `Exporting HTTP/REST API at:HOST:PORT ...`.

`python -m serving` parses its flags (serving/__main__.py) before this module, which imports
TensorFlow, is loaded: a bad flag costs a fraction of a second.

`Server` is both front ends of one `Core` (the loaded models and what their requests share) on the
running event loop; `ServerThread` runs one on a loop of its own thread, the small synchronous façade
for callers that are not on a loop (the parity gate's in-process server, tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import importlib.metadata
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import tensorflow as tf
from tensorflow_serving.config import model_server_config_pb2

from serving import frozen_weights, tf_log
from serving.batching.parameters import BatchingConfigError, BatchingParameters, read_batching_parameters
from serving.batching.scheduler import Batcher
from serving.errors import LoadError
from serving.flags import Options
from serving.limits import DRAIN_ADMIT_S, Admission, default_max_threads, drain_s, set_max_request_elements
from serving.manager import model_config
from serving.memory_return import MemoryReturner
from serving.manager.model_manager import ModelManager
from serving.model_service import ModelService, ReloadPolicy
from serving.monitoring import Metrics, MonitoringConfigError, read_monitoring_config
from serving.prediction_service import PredictionService
from serving.generation.decoder import DEFAULT_MAX_ROWS
from serving.generation.service import Generations
from serving.request_log import RequestLog
from serving.rest.openai import Limits, OpenAIApi
from serving.rest.routes import RestApi
from serving.rest.server import RestServer
from serving.server import GrpcFrontEnd, follow_health
from serving.tls import SslConfig, SslConfigError, read_ssl_config
from serving.v2.rest import V2Api

log = logging.getLogger("serving")


class StartupError(Exception):
    """Start-up cannot go on: one line for stderr, and the exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run(options: Options) -> int:
    """python -m serving: 0 after a drained stop, 1 (or 2) when start-up fails."""
    if options.version:  # as tensorflow_model_server --version: the versions, then exit
        print(f"python -m serving (mixed-precision-pipeline {importlib.metadata.version('mixed-precision-pipeline')}), "
              f"TensorFlow {tf.__version__}, TF Serving APIs {importlib.metadata.version('tensorflow-serving-api')}")
        return 0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        core = build(options)
    except StartupError as error:
        print(f"error: {error}", file=sys.stderr)  # the whole of stderr when it fails before loading
        return error.exit_code
    if tf_log.float16_note():  # once started: a server refused at start-up says one line only
        log.info("%s", tf_log.float16_note())
    log.info("%s", frozen_weights.describe())
    try:
        return asyncio.run(serve(options, core))
    finally:
        core.close()  # after the front ends: every answered request that was sampled is written


@dataclasses.dataclass
class Core:
    """What both front ends serve, built before any port is bound: the loaded models and what their requests
    share. `follow()` keeps the batch queues, metrics and request logs in step with the manager."""

    manager: ModelManager
    batcher: Batcher | None = None  # --enable_batching
    metrics: Metrics | None = None  # --monitoring_config_file
    request_log: RequestLog | None = None
    reload_policy: ReloadPolicy | None = None  # None: reloads refused
    ssl_config: SslConfig | None = None  # --ssl_config_file
    admission: Admission = dataclasses.field(default_factory=Admission)  # --max_inflight_requests, ..._bytes
    generations: Generations | None = None  # the language models' decode loops
    _listeners: list[Callable] = dataclasses.field(default_factory=list)

    def follow(self) -> None:
        """Subscribes the batcher, metrics and request log to the manager's changes (once)."""
        if self._listeners:
            return
        if self.batcher is not None:
            batcher = self.batcher

            def retire(manager: ModelManager) -> None:  # queues of versions no longer AVAILABLE drain, then stop
                batcher.retire([runner for name in manager.model_names for runner in manager.versions(name).values()])

            self.manager.add_listener(retire)
            self._listeners.append(retire)
            if self.metrics is not None:
                batcher.add_listener(self.metrics.observe_batch)
        if self.metrics is not None:
            self._listeners.append(self.metrics.follow_models(self.manager))
        if self.request_log is not None:
            self._listeners.append(self.request_log.follow_models(self.manager))

    def close(self) -> None:
        """Stops the batch threads (what is queued runs first), closes the request logs, stops polling."""
        for listener in self._listeners:
            self.manager.remove_listener(listener)
        if self.batcher is not None:
            self.batcher.stop()
        if self.generations is not None:
            self.generations.stop()
        if self.request_log is not None:
            self.request_log.close()
        self.manager.stop()


def build(options: Options) -> Core:
    """The Core the flags describe, with every configured model loaded (TF Serving loads before it binds).

    Raises:
        StartupError: a file a flag names cannot be used, a port is taken, or a model did not load.
    """
    set_max_request_elements(options.max_request_elements)
    ssl_config = _read_ssl_config(options.ssl_config_file) if options.ssl_config_file else None
    config = _read_model_config(options)
    for port in (options.port, options.rest_api_port):
        problem = _bind_problem(options.host, port, options.reuse_port) if port >= 0 else None
        if problem:  # before minutes of loading
            raise StartupError(f"cannot listen on {_address(options.host, port)}: {problem}")
    metrics = _read_metrics(options.monitoring_config_file) if options.monitoring_config_file else None
    _set_tensorflow_threads(options)
    batcher, decode_rows = None, DEFAULT_MAX_ROWS
    if options.enable_batching:
        try:
            parameters = (read_batching_parameters(options.batching_parameters_file)
                          if options.batching_parameters_file else BatchingParameters())
        except BatchingConfigError as error:
            raise StartupError(str(error)) from None
        log.info("batching: %s", parameters)
        batcher = Batcher(parameters)
        if options.batching_parameters_file:  # its max_batch_size bounds a decode step too (not the 1000 default)
            decode_rows = parameters.max_batch_size
    manager = ModelManager(file_system_poll_wait_seconds=options.file_system_poll_wait_seconds,
                           allow_version_labels_for_unavailable_models=options.allow_version_labels_for_unavailable_models,
                           enable_model_warmup=options.enable_model_warmup,
                           num_request_iterations_for_warmup=options.num_request_iterations_for_warmup,
                           max_num_load_retries=options.max_num_load_retries,
                           load_retry_interval_s=options.load_retry_interval_micros / 1e6)
    roots = options.model_config_reload_roots or [model.base_path for model in config.model_config_list.config]
    core = Core(manager, batcher, metrics, RequestLog(metrics=metrics), ReloadPolicy(
        options.allow_network_model_config_reload, tuple(roots)), ssl_config,
                Admission(options.max_inflight_requests, options.max_inflight_request_bytes),
                Generations(manager, decode_rows, metrics, options.generation_max_rows_per_client,
                            options.generation_max_cache_bytes))
    try:
        manager.reload_config(config)  # blocks until the models are AVAILABLE, as TF Serving's start-up does
    except model_config.ModelConfigError as error:
        core.close()
        raise StartupError(str(error)) from None
    return core


async def serve(options: Options, core: Core) -> int:
    """Serves until SIGTERM or SIGINT, then drains (within --grace_period_s); 1 if a port cannot be bound."""
    stop = _stop_on_signals()
    try:
        server = await Server.start(options, core)
    except RuntimeError as error:  # a port that cannot be bound
        print(f"error: {error}", file=sys.stderr)
        return 1
    core.manager.start_polling()
    if options.model_config_file and options.model_config_file_poll_wait_seconds > 0:
        core.manager.watch_config_file(options.model_config_file, options.model_config_file_poll_wait_seconds)
    _announce(options, server, core)
    memory = MemoryReturner().start()
    try:
        await stop.wait()
        await server.stop(options.grace_period_s)
    finally:
        memory.stop()
    return 0


class Server:
    """The gRPC and (with --rest_api_port) REST front ends of one Core, on the running event loop."""

    def __init__(self, grpc_front_end: GrpcFrontEnd, rest_server: RestServer | None, pools: list[ThreadPoolExecutor],
                 health_listener: Callable, core: Core) -> None:
        self._grpc, self._rest, self._pools = grpc_front_end, rest_server, pools
        self._health_listener, self._core = health_listener, core
        self.grpc_port = grpc_front_end.port
        self.rest_port = rest_server.port if rest_server is not None else None

    @classmethod
    async def start(cls, options: Options, core: Core) -> "Server":
        """Binds and starts both ports; then the core follows the manager (request logs open only now, so a
        server that cannot start leaves no empty log files).

        Raises:
            RuntimeError: a port could not be bound (nothing is left listening).
        """
        pools = [ThreadPoolExecutor(options.grpc_max_threads or default_max_threads(), thread_name_prefix="grpc")]

        def services(api: str, pool: ThreadPoolExecutor) -> tuple[PredictionService, ModelService]:
            predictions = PredictionService(core.manager, options, batcher=core.batcher, metrics=core.metrics, api=api,
                                            request_log=core.request_log, executor=pool, generations=core.generations)
            return predictions, ModelService(core.manager, core.reload_policy, executor=pool)

        grpc_front_end = await GrpcFrontEnd.start(options, core.manager, core.admission, services("grpc", pools[0]),
                                                  core.ssl_config)
        rest_server = None
        if options.rest_api_port:
            pools.append(ThreadPoolExecutor(options.rest_api_num_threads or default_max_threads(),
                                            thread_name_prefix="rest"))
            predictions, models = services("rest", pools[1])
            try:
                timeout_s = options.rest_api_timeout_in_ms / 1e3 if options.rest_api_timeout_in_ms > 0 else None
                api = RestApi(core.manager, (predictions, models), core.admission, core.metrics, pools[1], timeout_s)
                completions = OpenAIApi(core.manager, core.generations or Generations(core.manager),
                                        Limits(options.generation_max_prompt_bytes, options.generation_max_new_tokens,
                                               timeout_s), core.metrics, core.request_log)
                rest_server = await RestServer.start(api, options, core.metrics, completions,
                                                     V2Api(core.manager, api, pools[1]))
            except RuntimeError:
                await grpc_front_end.stop(time.monotonic())
                raise
        health_listener = await follow_health(core.manager, grpc_front_end.health)
        core.follow()
        return cls(grpc_front_end, rest_server, pools, health_listener, core)

    async def stop(self, grace_s: float) -> None:
        """Drains: health NOT_SERVING at once; requests keep being answered for limits.DRAIN_ADMIT_S (gRPC may
        hold some that arrived before the signal), later ones are refused (gRPC UNAVAILABLE, REST 503); what
        was accepted gets grace_s to finish, then both ports close and what still runs is cancelled."""
        now = time.monotonic()
        deadline, refuse_from = now + drain_s(grace_s), now + min(DRAIN_ADMIT_S, grace_s)
        await self._grpc.begin_drain(refuse_from)
        if self._rest is not None:
            self._rest.begin_drain(refuse_from)
        log.info("health NOT_SERVING; answering the requests that arrived (grace %.0f s), refusing new ones in "
                 "%.2f s", grace_s, max(refuse_from - time.monotonic(), 0.0))  # true from now on
        async def timed(name: str, stopping) -> None:
            await stopping
            log.info("%s port closed after %.1f s", name, time.monotonic() - now)  # which port held a long drain

        await asyncio.gather(timed("gRPC", self._grpc.stop(deadline)),
                             *([timed("REST", self._rest.stop(deadline))] if self._rest else []))
        self._core.manager.remove_listener(self._health_listener)
        for pool in self._pools:
            pool.shutdown(wait=False)
        log.info("server stopped")


class ServerThread:
    """A Server on an event loop of its own daemon thread, for synchronous callers (the parity gate, tests).

    Use as a context manager, or call stop(); grpc_address and rest_address are "127.0.0.1:PORT".
    """

    def __init__(self, options: Options, core: Core) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="serving-loop", daemon=True)
        self._thread.start()
        try:
            self.server: Server = self._call(Server.start(options, core))
        except BaseException:
            self._close_loop()
            raise
        self.grpc_address = _address(options.host, self.server.grpc_port)
        self.rest_address = _address(options.host, self.server.rest_port) if self.server.rest_port else None

    def stop(self, grace_s: float = 0.0) -> None:
        """Drains (grace_s for the requests in flight), then stops the loop and its thread."""
        if self._thread.is_alive():
            try:
                self._call(self.server.stop(grace_s))
            finally:
                self._close_loop()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


@contextlib.contextmanager
def serving_in_process(version_dir: str | os.PathLike, model_name: str, version: int) -> Iterator[str]:
    """Serves one version directory, wherever it lies (e.g. an export still being staged), on a free
    127.0.0.1 port of this process's own server (model manager, warmup, PredictionService); yields the
    gRPC address and stops everything on exit.

    The version is hard-linked into a throwaway base path next to it, so the directory itself is never
    touched and nothing is copied byte by byte.

    Raises:
        LoadError: the version did not load (the message is the manager's).
    """
    version_dir = Path(version_dir)
    base = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-serve-", dir=version_dir.parent))
    core = Core(ModelManager(file_system_poll_wait_seconds=0))
    try:
        shutil.copytree(version_dir, base / str(version), copy_function=os.link)
        core.manager.reload_config(model_config.single_model_config(model_name, base))
        if not core.manager.versions(model_name):
            states = core.manager.version_states(model_name)
            raise LoadError(f"the server did not load {version_dir}: "
                            f"{'; '.join(s.error_message for s in states.values()) or 'no version loaded'}")
        with ServerThread(Options(port=0, grpc_max_threads=2), core) as server:
            yield server.grpc_address
    finally:
        for runner in core.manager.versions(model_name).values():
            runner.close()
        core.close()
        shutil.rmtree(base, ignore_errors=True)


def _read_model_config(options: Options) -> model_server_config_pb2.ModelServerConfig:
    try:
        config = (model_config.read_model_config(options.model_config_file) if options.model_config_file
                  else model_config.single_model_config(options.model_name, options.model_base_path))
        model_config.validate_model_config(config)  # model names and logging_configs included
        model_config.check_versions_exist(config)
    except (model_config.ModelConfigError, ValueError) as error:
        raise StartupError(str(error)) from None
    return config


def _read_ssl_config(path: str) -> SslConfig:
    try:
        return read_ssl_config(path)
    except SslConfigError as error:
        raise StartupError(f"--ssl_config_file: {error}", exit_code=2) from None


def _read_metrics(path: str) -> Metrics | None:
    try:
        monitoring = read_monitoring_config(path)
    except MonitoringConfigError as error:
        raise StartupError(str(error)) from None
    return Metrics(monitoring.path) if monitoring.enable else None


def _set_tensorflow_threads(options: Options) -> None:
    """TensorFlow's thread pools (--tensorflow_intra_op_parallelism, --tensorflow_inter_op_parallelism, or
    --tensorflow_session_parallelism for both; 0 leaves TensorFlow's default): TensorFlow fixes them when it
    first runs an op, so before any model loads."""
    intra = options.tensorflow_intra_op_parallelism or options.tensorflow_session_parallelism
    inter = options.tensorflow_inter_op_parallelism or options.tensorflow_session_parallelism
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(inter)


def _bind_problem(host: str, port: int, reuse_port: bool) -> str | None:
    """Why the server could not listen on host:port, found by a bind as gRPC and asyncio make it (SO_REUSEADDR,
    so connections in TIME_WAIT do not count; without SO_REUSEPORT, which any listener refuses, unless
    --reuse_port): an unknown host, an address of no interface here, a port taken; None when it can."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return f"unknown host {host!r} ({error.strerror}); --host takes a name or address of this machine"
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE and reuse_port:
                    return "the port is taken by a listener that does not share it (SO_REUSEPORT)"
                if error.errno == errno.EADDRINUSE:
                    return "the port is taken (another server?); --reuse_port shares it on purpose"
                if error.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is no address of this machine; --host takes one of its own (0.0.0.0: all)"
                return error.strerror or str(error)
    return None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"  # IPv6 literal


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT; installed before the port is announced, so no signal is missed."""
    stop, loop = asyncio.Event(), asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        log.info("%s received", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


def _announce(options: Options, server: Server, core: Core) -> None:
    """The ready lines on stdout (TF Serving's words: callers wait for them), and what the log should say."""
    print(f"Running gRPC ModelServer at {_address(options.host, server.grpc_port)} ...", flush=True)
    if core.ssl_config is not None:
        log.info("gRPC port uses TLS%s", " and requires client certificates signed by custom_ca"
                 if core.ssl_config.client_verify else "")
    if server.rest_port is not None:
        rest = _address(options.host, server.rest_port)
        log.info("REST API at http://%s%s", rest, " (plain HTTP: --ssl_config_file covers the gRPC port, as in TF "
                 "Serving)" if core.ssl_config is not None else "")
        print(f"Exporting HTTP/REST API at:{rest} ...", flush=True)
        if core.metrics is not None:
            log.info("Prometheus metrics at http://%s%s", rest, core.metrics.path)
