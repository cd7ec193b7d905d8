"""tensorflow_model_server's flags, checked, as one immutable Options object (TF Serving's Server::Options,
model_servers/server.h; flag names, meanings and defaults from model_servers/main.cc).

Every flag's default lives in Options, and `parse` is the only reader of argv: a flag that cannot be
used (a port outside 0-65535, a negative or non-finite number of seconds, two ways of naming models)
exits 2 with one line naming the flag and what it takes, as argparse's own errors do, without the
usage block. Files a flag names (model config, batching parameters, SSL and monitoring configs) are
read by serving/app.py, which owns start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, Callable, NoReturn

from serving.limits import (DEFAULT_GENERATION_MAX_NEW_TOKENS, DEFAULT_GENERATION_MAX_PROMPT_BYTES,
                            DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT,
                            DEFAULT_MAX_INFLIGHT_REQUEST_BYTES, DEFAULT_MAX_INFLIGHT_REQUESTS,
                            DEFAULT_MAX_REQUEST_ELEMENTS, DEFAULT_REST_API_IDLE_TIMEOUT_S,
                            DEFAULT_REST_API_MAX_BODY_BYTES, DEFAULT_REST_API_READ_TIMEOUT_S, check_model_name,
                            parse_channel_arguments)

MAX_PORT = 65535


@dataclasses.dataclass(frozen=True)
class Options:
    """What one server process is told to do; the defaults are tensorflow_model_server's unless --help says."""

    port: int = 8500
    host: str = "127.0.0.1"
    model_name: str | None = None
    model_base_path: str | None = None
    model_config_file: str | None = None
    model_config_file_poll_wait_seconds: float = 0.0
    file_system_poll_wait_seconds: float = 1.0
    allow_version_labels_for_unavailable_models: bool = False
    enable_signature_method_name_check: bool = False
    enable_model_warmup: bool = True
    num_request_iterations_for_warmup: int = 0
    rest_api_port: int = 0
    rest_api_num_threads: int | None = None
    rest_api_timeout_in_ms: int = 30_000
    enable_batching: bool = False
    batching_parameters_file: str = ""
    rest_api_max_body_bytes: int = DEFAULT_REST_API_MAX_BODY_BYTES
    rest_api_max_connections: int | None = None
    rest_api_idle_timeout_s: float = DEFAULT_REST_API_IDLE_TIMEOUT_S
    rest_api_read_timeout_s: float = DEFAULT_REST_API_READ_TIMEOUT_S
    max_request_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS
    max_inflight_requests: int = DEFAULT_MAX_INFLIGHT_REQUESTS
    max_inflight_request_bytes: int = DEFAULT_MAX_INFLIGHT_REQUEST_BYTES
    generation_max_new_tokens: int = DEFAULT_GENERATION_MAX_NEW_TOKENS
    generation_max_prompt_bytes: int = DEFAULT_GENERATION_MAX_PROMPT_BYTES
    generation_max_rows_per_client: int = DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT
    generation_max_cache_bytes: int = 0
    monitoring_config_file: str = ""
    grpc_channel_arguments: tuple[tuple[str, int | str], ...] | None = None
    ssl_config_file: str = ""
    grpc_max_threads: int | None = None
    tensorflow_intra_op_parallelism: int = 0
    tensorflow_inter_op_parallelism: int = 0
    grace_period_s: float = 10.0
    max_num_load_retries: int = 5
    load_retry_interval_micros: int = 60_000_000
    allow_network_model_config_reload: bool = False
    model_config_reload_roots: tuple[str, ...] | None = None
    reuse_port: bool = False
    tensorflow_session_parallelism: int = 0
    enable_serialization_as_tensor_content: bool = False
    refuse_nonfinite_outputs: bool = False
    enable_grpc_healthcheck_service: bool = False  # accepted for scripts written for TF Serving: health is always on
    saved_model_tags: str = "serve"
    version: bool = False


def parse(argv: list[str] | None = None) -> Options:
    """The Options argv stands for; a flag that cannot be used exits 2 with one line on stderr.

    Every flag of tensorflow_model_server (model_servers/main.cc) is known: those this server implements
    take their values; the others (TF_SERVING_ONLY) are accepted at TF Serving's default, so scripts that
    pass them keep working, and refused with the reason at any other value.
    """
    parser = _parser()
    values = vars(parser.parse_args(argv))
    for name, (default, reason) in TF_SERVING_ONLY.items():
        given = values.pop(name)
        if given is not None and not _at_default(given, default):
            parser.error(f"--{name}={given}: {reason} (tensorflow_model_server's default, {default or 'empty'}, "
                         "is accepted)")
    options = Options(**{name: _frozen(value) for name, value in values.items()})
    problem = _problem(options)
    if problem:
        parser.error(problem)
    return options


def _problem(options: Options) -> str | None:
    """What makes a set of flags unusable together, in one line (None: usable)."""
    if options.version:
        return None  # python -m serving --version prints the versions and exits (serving/app.py)
    if options.tensorflow_session_parallelism and (options.tensorflow_intra_op_parallelism
                                                   or options.tensorflow_inter_op_parallelism):
        return ("--tensorflow_session_parallelism sets both thread pools; give it or "
                "--tensorflow_intra_op_parallelism/--tensorflow_inter_op_parallelism, not both (as TF Serving's main.cc)")
    if set(options.saved_model_tags.split(",")) != {"serve"}:
        return (f"--saved_model_tags={options.saved_model_tags}: this server loads the MetaGraph tagged 'serve' "
                "(the first one if none is), as TF Serving's default")
    if options.model_config_file and (options.model_name or options.model_base_path):
        return "use either --model_config_file or --model_name/--model_base_path, not both"
    if not options.model_config_file and not (options.model_name and options.model_base_path):
        return "--model_name and --model_base_path are required together (or give --model_config_file)"
    if options.model_name:
        try:
            check_model_name(options.model_name)
        except ValueError as error:
            return f"--model_name: {error}"
    if options.monitoring_config_file and not options.rest_api_port:
        return "--monitoring_config_file needs --rest_api_port: the metrics are served on the REST port"
    if options.batching_parameters_file and not options.enable_batching:
        # TF Serving refuses to start too (tensorflow_serving/model_servers/server.cc, BuildAndStart).
        return "--batching_parameters_file is set without setting --enable_batching to true"
    if options.model_config_reload_roots and not options.allow_network_model_config_reload:
        return "--model_config_reload_roots needs --allow_network_model_config_reload"
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block first: the flag and what is wrong with it."""
        self.exit(2, f"{self.prog}: error: {message} (python -m serving --help lists the flags)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m serving", description="A TensorFlow Serving-compatible model server.")
    defaults = Options()
    for name, (default, reason) in TF_SERVING_ONLY.items():
        parser.add_argument(f"--{name}", nargs="?", const="true", default=None,
                            help=f"tensorflow_model_server's; accepted at its default ({default}): {reason}")
    for name, kind, text in _FLAGS:
        default = getattr(defaults, name)
        shown = "" if "default" in text else f" (default {str(default).lower() if kind is _bool else default})"
        if kind is _bool:
            parser.add_argument(f"--{name}", type=_bool, nargs="?", const=True, default=default, help=text + shown)
        else:
            parser.add_argument(f"--{name}", type=kind, default=default, help=text + shown)
    return parser


def _at_default(given: str, default: str) -> bool:
    """Whether a TF_SERVING_ONLY flag's value is its default: booleans by truth (true/1, false/0), numbers by
    value, text as it is."""
    value = given.strip().lower()
    if default in ("true", "false"):
        return value in ((default, "1") if default == "true" else (default, "0"))
    try:
        return float(value) == float(default or "nan")
    except ValueError:
        return value == default


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _bool(text: str) -> bool:
    """TF Serving's boolean flags: --flag, --flag=true, --flag=false (also 1/0)."""
    value = text.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _integer(low: int, high: int | None = None, zero_means: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from low (to high); the error says what is allowed and what 0 means."""
    if high is not None:
        allowed = f"{low} to {high}" + (f" (0: {zero_means})" if zero_means else "")
    elif low == 0:
        allowed = f"0 ({zero_means}) or a positive number"
    else:
        allowed = "a positive number" if low == 1 else f"{low} or more"

    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text}")
        return value

    parse.__name__ = "integer"  # argparse's word for a value int() cannot read: "invalid integer value"
    return parse


def _seconds(low: float, *, zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > low (>= low with zero)."""
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (value == low and not zero):
            raise argparse.ArgumentTypeError(f"expected {'0 or more' if zero else 'a positive number of'} seconds, "
                                             f"got {text}")
        return value

    parse.__name__ = "number"
    return parse


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


_port = _integer(0, MAX_PORT, "pick a free port")
_positive = _integer(1)
_SECONDS, _POSITIVE_SECONDS = _seconds(0.0, zero=True), _seconds(0.0, zero=False)

# (flag, type, help): every flag python -m serving takes, named and meant as tensorflow_model_server's.
_FLAGS: list[tuple[str, Callable[[str], Any] | None, str]] = [
    ("port", _port, "gRPC port; 0 picks a free one"),
    ("host", None, "address to bind (0.0.0.0 for all)"),
    ("model_name", None, "name clients put in model_spec.name (one model, its latest version)"),
    ("model_base_path", None, "directory holding numeric version subdirectories"),
    ("model_config_file", None, "text ModelServerConfig listing several models: model_config_list { config { name, "
                                "base_path, model_platform: 'tensorflow', model_version_policy, version_labels } }; "
                                "instead of --model_name/--model_base_path"),
    ("model_config_file_poll_wait_seconds", _SECONDS, "re-read --model_config_file this often and apply changes "
                                                      "(default 0: read once)"),
    ("file_system_poll_wait_seconds", _SECONDS, "look for new version directories this often (0: only at start-up "
                                                "and reloads)"),
    ("allow_version_labels_for_unavailable_models", _bool, "let a new version label point at a version that is not "
                                                           "loaded yet"),
    ("enable_signature_method_name_check", _bool, "Classify/Regress only on signatures whose method_name says so"),
    ("enable_model_warmup", _bool, "replay assets.extra/tf_serving_warmup_requests before a version serves"),
    ("num_request_iterations_for_warmup", _integer(0, zero_means="once"), "times each warmup request is replayed "
                                                                         "(default 0: once)"),
    ("rest_api_port", _integer(-1, MAX_PORT, "no REST API"), "HTTP/REST API port on --host (default 0: no REST API; "
                                                             "unlike TF Serving, -1 picks a free port)"),
    ("rest_api_timeout_in_ms", int, "deadline of a REST Predict, Classify or Regress (its model run): past it, 504 "
                                    "(0 or less: none)"),
    ("rest_api_num_threads", _positive, "REST worker threads: unbatched model calls and large requests (default 4 "
                                        "per CPU core)"),
    ("enable_batching", _bool, "merge concurrent requests to the same model version and signature into one batch"),
    ("batching_parameters_file", None, "text BatchingParameters: max_batch_size, batch_timeout_micros, "
                                       "max_enqueued_batches, num_batch_threads, allowed_batch_sizes, "
                                       "pad_variable_length_inputs (with --enable_batching; default: none)"),
    ("rest_api_max_body_bytes", _positive, "larger REST request bodies get 413"),
    ("rest_api_max_connections", _positive, "open REST connections at most; more are answered 503 and closed "
                                            "(default: a quarter of ulimit -n)"),
    ("rest_api_idle_timeout_s", _POSITIVE_SECONDS, "close a REST connection that has sent no complete request head "
                                                   "for this long"),
    ("rest_api_read_timeout_s", _POSITIVE_SECONDS, "a REST request body must arrive within this after its head, "
                                                   "else 408"),
    ("max_request_elements", _integer(0, zero_means="no limit"), "tensor elements (or tf.Examples) one request may "
                                                                 "declare, all inputs together; more is "
                                                                 "INVALID_ARGUMENT (0: no limit)"),
    ("max_inflight_requests", _positive, "requests served at once, gRPC and REST together; more are answered "
                                         "RESOURCE_EXHAUSTED (REST 429) at once"),
    ("max_inflight_request_bytes", _positive, "bytes of those requests on the wire, together; a request that would "
                                              "go past it is answered RESOURCE_EXHAUSTED (REST 429)"),
    ("generation_max_new_tokens", _positive, "the most tokens one prompt of a completion may ask for "
                                             "(max_tokens); the model's context bounds it too"),
    ("generation_max_prompt_bytes", _positive, "the longest prompt a completion may send, in UTF-8 bytes, checked "
                                               "before it is tokenized"),
    ("generation_max_rows_per_client", _positive, "the most rows one client (peer address) holds in a decode step "
                                                  "while other clients generate too; its others wait, paused"),
    ("generation_max_cache_bytes", _integer(0, zero_means="no bound but the batch's rows"),
     "the key/value cache one language model's decoding rows may hold together, in the batch and paused; a row "
     "waits for room, and a completion whose rows alone need more is RESOURCE_EXHAUSTED (REST 429) (0: no bound "
     "but the batch's rows)"),
    ("monitoring_config_file", None, "text MonitoringConfig: prometheus_config { enable: true, path: "
                                     "'/monitoring/prometheus/metrics' }; metrics are served on --rest_api_port "
                                     "(default: none)"),
    ("grpc_channel_arguments", _channel_arguments, "gRPC server options as comma-separated key=value, each "
                                                   "replacing the server's default (e.g. "
                                                   "grpc.max_receive_message_length=1048576; default: the bounds in "
                                                   "docs/operations.md's threat model)"),
    ("ssl_config_file", None, "text SSLConfig for TLS on the gRPC port: server_key, server_cert (PEM texts inline), "
                              "custom_ca, client_verify (mutual TLS); the REST port stays plain HTTP, as in TF "
                              "Serving (default: none)"),
    ("grpc_max_threads", _positive, "gRPC worker threads: unbatched model calls, large requests and reloads "
                                    "(default 4 per CPU core)"),
    ("tensorflow_intra_op_parallelism", _integer(0, zero_means="TensorFlow decides"),
     "threads one TensorFlow op may use (default 0: TensorFlow decides, one per core); 1 is faster for small "
     "models on few cores, where concurrent requests already use every core"),
    ("tensorflow_inter_op_parallelism", _integer(0, zero_means="TensorFlow decides"),
     "TensorFlow ops run at once within one model call (default 0: TensorFlow decides)"),
    ("grace_period_s", _SECONDS, "on SIGTERM/SIGINT, how long in-flight requests may take to finish; new ones are "
                                 "refused"),
    ("max_num_load_retries", _integer(0, zero_means="no retry"), "times a failed model load is tried again before "
                                                                 "the version is given up"),
    ("load_retry_interval_micros", int, "microseconds between those tries (default 60000000: one minute; negative: "
                                        "no wait)"),
    ("allow_network_model_config_reload", _bool, "let gRPC clients replace the model list with "
                                                 "HandleReloadConfigRequest (default false: refused)"),
    ("model_config_reload_roots", _directories, "comma-separated absolute directories that reloaded models' base "
                                                "paths must lie under (default: the start-up models' base paths)"),
    ("reuse_port", _bool, "let other processes listen on the gRPC and REST ports too (SO_REUSEPORT), for workers "
                          "sharing them on purpose (default false: a taken port is an error)"),
    ("tensorflow_session_parallelism", _integer(0, zero_means="TensorFlow decides"),
     "threads of both TensorFlow pools at once (TF Serving's; not with the two flags above)"),
    ("enable_serialization_as_tensor_content", _bool, "Predict outputs as tensor_content bytes instead of typed "
                                                      "fields"),
    ("refuse_nonfinite_outputs", _bool, "answer FAILED_PRECONDITION (REST 400) naming the output instead of an answer "
                                        "holding NaN or Inf (default false: answered as computed, as TF Serving; "
                                        "counted and logged either way)"),
    ("enable_grpc_healthcheck_service", _bool, "accepted for TF Serving's scripts: this server always serves "
                                               "grpc.health.v1 (TF Serving only with this flag)"),
    ("saved_model_tags", None, "MetaGraph tags to load; only 'serve' (TF Serving's default)"),
    ("version", _bool, "print the versions and exit"),
]

# tensorflow_model_server's flags (model_servers/main.cc, tensorflow/serving 9d981c5) this server does not
# implement: {flag: (TF Serving's default, why not)}. At the default they change nothing, so they are accepted.
TF_SERVING_ONLY = {
    "grpc_socket_path": ("", "no UNIX-socket gRPC endpoint; use --port"),
    "rest_api_enable_cors_support": ("false", "no CORS headers; put a proxy in front of the REST port"),
    "enable_per_model_batching_parameters": ("false", "one --batching_parameters_file serves every model"),
    "num_load_threads": ("0", "versions load one at a time"),
    "num_unload_threads": ("0", "versions unload one at a time"),
    "flush_filesystem_caches": ("true", "no filesystem caches to flush"),
    "tensorflow_session_config_file": ("", "no ConfigProto file; use the --tensorflow_*_parallelism flags"),
    "use_alts_credentials": ("false", "no ALTS; use --ssl_config_file"),
    "platform_config_file": ("", "TensorFlow SavedModels only (model_platform 'tensorflow')"),
    "per_process_gpu_memory_fraction": ("0", "no GPU memory fraction; TensorFlow grows GPU memory as needed"),
    "remove_unused_fields_from_bundle_metagraph": ("true", "the MetaGraph is read once and only signatures kept"),
    "prefer_tflite_model": ("false", "no TensorFlow Lite models"),
    "num_tflite_pools": ("1", "no TensorFlow Lite models"),
    "num_tflite_interpreters_per_pool": ("1", "no TensorFlow Lite models"),
    "xla_cpu_compilation_enabled": ("false", "no XLA just-in-time compilation"),
    "xla_gpu_compilation_enabled": ("false", "no XLA just-in-time compilation"),
    "enable_profiler": ("true", "no profiler service"),
    "thread_pool_factory_config_file": ("", "no custom thread pools"),
    "mixed_precision": ("", "no graph rewrite at load; export the precision to serve (export.serving_policy, "
                            "docs/precision.md)"),
    "skip_initialize_tpu": ("false", "no TPUs"),
}
