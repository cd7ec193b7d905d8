"""`python -m serving (--model_name NAME --model_base_path DIR | --model_config_file FILE) [--port 8500] ...`

tensorflow_model_server's flag names and defaults, so scripts and clients written for it work
unchanged. The port is bound only once every configured model's latest version is AVAILABLE; then
exactly one line goes to stdout, as TF Serving logs it: `Running gRPC ModelServer at HOST:PORT ...`
(with --port 0 this is how callers learn the port). With --rest_api_port, a second line follows:
`Exporting HTTP/REST API at:HOST:PORT ...`. If a configured model cannot load, or a port is taken,
the server does not start: one line on stderr, exit code 1 (TF Serving: "Failed to start server").
Unless TF_CPP_MIN_LOG_LEVEL is set, TensorFlow's C++ INFO lines are left out of the log.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from serving import tf_log
from serving.limits import (DEFAULT_MAX_REQUEST_ELEMENTS, DEFAULT_REST_API_IDLE_TIMEOUT_S,
                            DEFAULT_REST_API_MAX_BODY_BYTES, DEFAULT_REST_API_READ_TIMEOUT_S, check_model_name,
                            parse_channel_arguments, set_max_request_elements)

if TYPE_CHECKING:
    from serving.tls import SslConfig


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_flags(parser, args)
    set_max_request_elements(args.max_request_elements)
    ssl_config = _ssl_config(parser, args.ssl_config_file) if args.ssl_config_file else None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from serving.manager import model_config  # no TensorFlow yet: a bad config costs a fraction of a second

    try:
        config = (model_config.read_model_config(args.model_config_file) if args.model_config_file
                  else model_config.single_model_config(args.model_name, args.model_base_path))
        model_config.validate_model_config(config)  # model names and logging_configs included
        model_config.check_versions_exist(config)
    except (model_config.ModelConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for port in (args.port, args.rest_api_port):
        if port > 0 and not args.reuse_port and _port_taken(args.host, port):  # before minutes of loading
            print(f"error: cannot listen on {_address(args.host, port)}: the port is taken (another server?); --reuse_port shares it on purpose",
                  file=sys.stderr)
            return 1
    from serving.monitoring import Metrics, MonitoringConfigError, read_monitoring_config

    metrics = None
    if args.monitoring_config_file:
        try:
            monitoring = read_monitoring_config(args.monitoring_config_file)
        except MonitoringConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        if monitoring.enable:
            metrics = Metrics(monitoring.path)
    _import_tensorflow()
    from serving.batching.scheduler import Batcher
    from serving.batching.parameters import BatchingConfigError, BatchingParameters, read_batching_parameters
    from serving.manager.model_manager import ModelManager
    from serving.model_service import ReloadPolicy
    from serving.request_log import RequestLog
    from serving.server import create_server, shutdown, stop_on_signals

    batcher = None
    if args.enable_batching:
        try:
            parameters = (read_batching_parameters(args.batching_parameters_file) if args.batching_parameters_file
                          else BatchingParameters())
        except BatchingConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        logging.getLogger("serving").info("batching: %s", parameters)
        batcher = Batcher(parameters)

    _set_tensorflow_threads(args.tensorflow_intra_op_parallelism, args.tensorflow_inter_op_parallelism)
    manager = ModelManager(file_system_poll_wait_seconds=args.file_system_poll_wait_seconds,
                           allow_version_labels_for_unavailable_models=args.allow_version_labels_for_unavailable_models,
                           enable_model_warmup=args.enable_model_warmup,
                           num_request_iterations_for_warmup=args.num_request_iterations_for_warmup,
                           max_num_load_retries=args.max_num_load_retries,
                           load_retry_interval_s=args.load_retry_interval_micros / 1e6)
    reload_policy = ReloadPolicy(args.allow_network_model_config_reload,
                                 tuple(args.model_config_reload_roots or _base_paths(config)))
    request_log = RequestLog(metrics=metrics)  # writes only for models whose config has a logging_config
    try:
        manager.reload_config(config)  # blocks until the models are AVAILABLE, as TF Serving's start-up does
        server, port, drain = create_server(
            _address(args.host, args.port), manager, max_threads=args.grpc_max_threads,
            enable_signature_method_name_check=args.enable_signature_method_name_check, batcher=batcher,
            metrics=metrics, channel_arguments=args.grpc_channel_arguments, ssl_config=ssl_config,
            request_log=request_log, reload_policy=reload_policy, reuse_port=args.reuse_port)
    except (model_config.ModelConfigError, OSError, RuntimeError) as error:  # a model that fails, port in use
        print(f"error: {error}", file=sys.stderr)
        return 1
    rest_server = rest_port = None
    if args.rest_api_port:
        from serving.rest.server import start_rest_server

        try:
            rest_server, rest_port = start_rest_server(
                args.host, args.rest_api_port, manager, batcher=batcher,
                max_threads=args.rest_api_num_threads,
                enable_signature_method_name_check=args.enable_signature_method_name_check,
                max_body_bytes=args.rest_api_max_body_bytes, metrics=metrics, request_log=request_log,
                max_connections=args.rest_api_max_connections, idle_timeout_s=args.rest_api_idle_timeout_s,
                read_timeout_s=args.rest_api_read_timeout_s, reuse_port=args.reuse_port)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            server.stop(0)
            request_log.close()
            return 1
    manager.start_polling()
    if args.model_config_file and args.model_config_file_poll_wait_seconds > 0:
        manager.watch_config_file(args.model_config_file, args.model_config_file_poll_wait_seconds)
    stop = stop_on_signals()
    print(f"Running gRPC ModelServer at {_address(args.host, port)} ...", flush=True)
    if ssl_config is not None:
        logging.getLogger("serving").info("gRPC port uses TLS%s", " and requires client certificates signed by "
                                          "custom_ca" if ssl_config.client_verify else "")
    if rest_server is not None:
        logging.getLogger("serving").info("REST API at http://%s%s", _address(args.host, rest_port),
                                          " (plain HTTP: --ssl_config_file covers the gRPC port, as in TF Serving)"
                                          if ssl_config is not None else "")
        print(f"Exporting HTTP/REST API at:{_address(args.host, rest_port)} ...", flush=True)
        if metrics is not None:
            logging.getLogger("serving").info("Prometheus metrics at http://%s%s",
                                              _address(args.host, rest_port), metrics.path)
    while not stop.wait(0.1):
        pass
    drain.begin(args.grace_period_s)  # gRPC health NOT_SERVING and new calls refused while REST drains too
    if rest_server is not None:
        rest_server.stop(grace_s=drain.seconds_left())
    shutdown(server, drain)
    if batcher is not None:
        batcher.stop()
    request_log.close()  # after the servers: every answered request that was sampled is written
    manager.stop()
    return 0


def _import_tensorflow() -> None:
    """Imports TensorFlow with its start-up INFO lines left out (serving/tf_log.py), unless the user set
    TF_CPP_MIN_LOG_LEVEL; warnings and errors still reach the server's log."""
    tf_log.quiet_tensorflow("1")
    importlib.import_module("tensorflow")


def _port_taken(host: str, port: int) -> bool:
    """Whether something listens on host:port already: a bind as gRPC and asyncio make it (SO_REUSEADDR, so
    connections in TIME_WAIT do not count) but without SO_REUSEPORT, which any listener refuses."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # the server's own bind reports it
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
    return False


def _base_paths(config) -> list[str]:  # noqa: ANN001 - a ModelServerConfig
    """The default --model_config_reload_roots: the start-up models' own base paths."""
    return [model.base_path for model in config.model_config_list.config]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"  # IPv6 literal


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__.splitlines()[0])
    flag = parser.add_argument
    flag("--port", type=int, default=8500, help="gRPC port; 0 picks a free one (default 8500)")
    flag("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    flag("--model_name", help="name clients put in model_spec.name (one model, its latest version)")
    flag("--model_base_path", help="directory holding numeric version subdirectories")
    flag("--model_config_file", help="text ModelServerConfig listing several models: model_config_list { config "
                                     "{ name, base_path, model_platform: 'tensorflow', model_version_policy, "
                                     "version_labels } }; instead of --model_name/--model_base_path")
    flag("--model_config_file_poll_wait_seconds", type=_seconds, default=0.0,
         help="re-read --model_config_file this often and apply changes (default 0: read once)")
    flag("--file_system_poll_wait_seconds", type=_seconds, default=1.0,
         help="look for new version directories this often (default 1; 0: only at start-up and reloads)")
    flag("--allow_version_labels_for_unavailable_models", type=_bool, nargs="?", const=True, default=False,
         help="let a new version label point at a version that is not loaded yet (default false)")
    flag("--enable_signature_method_name_check", type=_bool, nargs="?", const=True, default=False,
         help="Classify/Regress only on signatures whose method_name says so (default false)")
    flag("--enable_model_warmup", type=_bool, nargs="?", const=True, default=True,
         help="replay assets.extra/tf_serving_warmup_requests before a version serves (default true)")
    flag("--num_request_iterations_for_warmup", type=int, default=0,
         help="times each warmup request is replayed (default 0: once)")
    flag("--rest_api_port", type=int, default=0,
         help="HTTP/REST API port on --host (default 0: no REST API; unlike TF Serving, -1 picks a free port)")
    flag("--rest_api_num_threads", type=int, default=None,
         help="REST worker threads: unbatched model calls and every REST request but Predict's decoding "
              "(default 4 per CPU core)")
    flag("--enable_batching", type=_bool, nargs="?", const=True, default=False,
         help="merge concurrent requests to the same model version and signature into one batch (default false)")
    flag("--batching_parameters_file", default="",
         help="text BatchingParameters: max_batch_size, batch_timeout_micros, max_enqueued_batches, "
              "num_batch_threads, allowed_batch_sizes, pad_variable_length_inputs (with --enable_batching)")
    flag("--rest_api_max_body_bytes", type=int, default=DEFAULT_REST_API_MAX_BODY_BYTES,
         help="larger REST request bodies get 413 (default 64 MiB)")
    flag("--rest_api_max_connections", type=_positive, default=None,
         help="open REST connections at most; more are answered 503 and closed (default: half of ulimit -n)")
    flag("--rest_api_idle_timeout_s", type=_positive_seconds, default=DEFAULT_REST_API_IDLE_TIMEOUT_S,
         help="close a REST connection that has sent no complete request head for this long (default 60)")
    flag("--rest_api_read_timeout_s", type=_positive_seconds, default=DEFAULT_REST_API_READ_TIMEOUT_S,
         help="a REST request body must arrive within this after its head, else 408 (default 30)")
    flag("--max_request_elements", type=_zero_or_more("no limit"), default=DEFAULT_MAX_REQUEST_ELEMENTS,
         help="tensor elements (or tf.Examples) one request may declare, all inputs together; more is "
              "INVALID_ARGUMENT (default 16777216; 0: no limit)")
    flag("--monitoring_config_file", default="",
         help="text MonitoringConfig: prometheus_config { enable: true, path: '/monitoring/prometheus/metrics' }; "
              "metrics are served on --rest_api_port")
    flag("--grpc_channel_arguments", type=_channel_arguments, default=None,
         help="gRPC server options as comma-separated key=value (e.g. grpc.max_receive_message_length=1048576); "
              "message sizes stay unlimited unless set here")
    flag("--ssl_config_file", default="",
         help="text SSLConfig for TLS on the gRPC port: server_key, server_cert (PEM texts inline), custom_ca, "
              "client_verify (mutual TLS); the REST port stays plain HTTP, as in TF Serving")
    flag("--grpc_max_threads", type=int, default=None,
         help="gRPC worker threads: unbatched model calls and every RPC but Predict (default 4 per CPU core)")
    flag("--tensorflow_intra_op_parallelism", type=_zero_or_more("TensorFlow decides"), default=0,
         help="threads one TensorFlow op may use (default 0: TensorFlow decides, one per core); "
              "1 is faster for small models on few cores, where concurrent requests already use every core")
    flag("--tensorflow_inter_op_parallelism", type=_zero_or_more("TensorFlow decides"), default=0,
         help="TensorFlow ops run at once within one model call (default 0: TensorFlow decides)")
    flag("--grace_period_s", type=float, default=10.0,
         help="on SIGTERM/SIGINT, how long in-flight requests may take to finish; new ones are refused")
    flag("--max_num_load_retries", type=_zero_or_more("no retry"), default=5,
         help="times a failed model load is tried again before the version is given up (default 5; 0: once)")
    flag("--load_retry_interval_micros", type=int, default=60_000_000,
         help="microseconds between those tries (default 60000000: one minute; negative: no wait)")
    flag("--allow_network_model_config_reload", type=_bool, nargs="?", const=True, default=False,
         help="let gRPC clients replace the model list with HandleReloadConfigRequest (default false: refused)")
    flag("--model_config_reload_roots", type=_directories, default=None,
         help="comma-separated absolute directories that reloaded models' base paths must lie under "
              "(default: the start-up models' base paths)")
    flag("--reuse_port", type=_bool, nargs="?", const=True, default=False,
         help="let other processes listen on the gRPC and REST ports too (SO_REUSEPORT), for workers sharing them on purpose "
              "(default false: a taken port is an error)")
    return parser


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--model_config_file, or --model_name with --model_base_path (exit 2 otherwise)."""
    if args.model_config_file:
        if args.model_name or args.model_base_path:
            parser.error("use either --model_config_file or --model_name/--model_base_path, not both")
    elif not (args.model_name and args.model_base_path):
        parser.error("--model_name and --model_base_path are required together (or give --model_config_file)")
    if args.model_name:
        try:
            check_model_name(args.model_name)
        except ValueError as error:
            parser.error(f"--model_name: {error}")
    if args.monitoring_config_file and not args.rest_api_port:
        parser.error("--monitoring_config_file needs --rest_api_port: the metrics are served on the REST port")
    if args.rest_api_max_body_bytes <= 0:
        parser.error(f"--rest_api_max_body_bytes: expected a positive number of bytes, got {args.rest_api_max_body_bytes}")
    if args.batching_parameters_file and not args.enable_batching:
        # TF Serving refuses to start too (tensorflow_serving/model_servers/server.cc, BuildAndStart).
        parser.error("--batching_parameters_file is set without setting --enable_batching to true")
    if args.model_config_reload_roots and not args.allow_network_model_config_reload:
        parser.error("--model_config_reload_roots needs --allow_network_model_config_reload")


def _ssl_config(parser: argparse.ArgumentParser, path: str) -> "SslConfig":
    """The checked --ssl_config_file (exit 2 with one line on what is wrong)."""
    from serving.tls import SslConfigError, read_ssl_config

    try:
        return read_ssl_config(path)
    except SslConfigError as error:
        parser.error(f"--ssl_config_file: {error}")


def _bool(text: str) -> bool:
    """TF Serving's boolean flags: --flag, --flag=true, --flag=false (also 1/0)."""
    value = text.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _channel_arguments(text: str) -> list[tuple[str, int | str]]:
    try:
        return parse_channel_arguments(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _directories(text: str) -> list[str]:
    paths = [part.strip() for part in text.split(",") if part.strip()]
    if not paths or not all(os.path.isabs(path) for path in paths):
        raise argparse.ArgumentTypeError(f"expected comma-separated absolute directories, got {text!r}")
    return paths


def _set_tensorflow_threads(intra_op: int, inter_op: int) -> None:
    """TF Serving's --tensorflow_intra_op_parallelism/--tensorflow_inter_op_parallelism; 0 leaves TF's default.

    Must run before the first model loads: TensorFlow fixes its thread pools when it first runs an op.
    """
    import tensorflow as tf

    if intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    if inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def _zero_or_more(zero_means: str):
    """An argparse type: an integer >= 0, where 0 means `zero_means` (the error says so)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected 0 ({zero_means}) or a positive number, got {text}")
        return value

    parse.__name__ = "integer"  # argparse's word for a value int() cannot read: "invalid integer value"
    return parse


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
