"""Limits a request or a config cannot step past: gRPC channel arguments, worker threads, model names,
the size of one request's tensors, and the REST port's connections, timeouts and JSON.

--grpc_channel_arguments follows TF Serving's server.cc: a comma-separated list of key=value, integer
values passed as ints and anything else as a string. Model names become path segments and metric
labels, so a name with '/', '..' or NUL is refused.

A request is checked against these before anything is allocated for it (serving/servable/tensors.py,
serving/servable/inference.py), so what a request costs stays a small multiple of what its client sent.
"""

from __future__ import annotations

import os

# TF Serving lifts gRPC's 4 MB default to INT_MAX, so large batches go through.
UNLIMITED_MESSAGES = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))

DEFAULT_REST_API_MAX_BODY_BYTES = 64 * 1024 * 1024

# --max_request_elements: the tensor elements (or tf.Examples) one request may declare, all inputs
# together; 16 Mi float32 elements are 64 MiB, as much as the default REST body. 0: no limit.
DEFAULT_MAX_REQUEST_ELEMENTS = 16 * 1024 * 1024
# A TensorProto whose values do not fill its shape is filled as TF's Tensor::FromProto does (no
# values: zeros; fewer: the last value repeated), but only up to this many elements, so that a few
# bytes cannot declare gigabytes.
MAX_FILLED_ELEMENTS = 65536
# Classify/Regress: a tf.Example context is copied into every row (as TF Serving's util.cc
# InputToSerializedExampleTensor does); these copies may total at most this many bytes per request.
MAX_CONTEXT_COPY_BYTES = 64 * 1024 * 1024
# numpy holds at most 64 dimensions (TF's TensorShape allows 254).
MAX_RANK = 64

# REST: JSON nesting deeper than any tensor numpy can hold, or numbers longer than any float64 needs
# (its longest exact decimal has 767 significant digits), are refused before they are parsed.
MAX_JSON_DEPTH = 100
MAX_JSON_NUMBER_CHARS = 1000
DEFAULT_REST_API_IDLE_TIMEOUT_S = 60.0  # a connection with no complete request head is closed after this
DEFAULT_REST_API_READ_TIMEOUT_S = 30.0  # a request body must arrive within this, once its head has

_max_request_elements = DEFAULT_MAX_REQUEST_ELEMENTS


def max_request_elements() -> int:
    """The server's --max_request_elements (0: no limit)."""
    return _max_request_elements


def set_max_request_elements(limit: int) -> None:
    """Sets the per-request element limit for this process (python -m serving calls it once, from its flag)."""
    global _max_request_elements
    if limit < 0:
        raise ValueError(f"expected 0 (no limit) or a positive number of elements, got {limit}")
    _max_request_elements = limit


def default_rest_api_max_connections() -> int:
    """--rest_api_max_connections: half the process's open-file limit (ulimit -n), so that slow or idle
    REST clients can never take the descriptors the gRPC port and model loading need."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) // 2)


def default_max_threads() -> int:
    """Worker threads (--grpc_max_threads, --rest_api_num_threads): TF releases the GIL and uses all
    cores per op, so a few per core suffice."""
    return 4 * (os.cpu_count() or 1)


def parse_channel_arguments(text: str) -> list[tuple[str, int | str]]:
    """gRPC server options from "k=v,k=v", on top of the unlimited message sizes (a key given here wins).

    Raises:
        ValueError: an entry is not key=value.
    """
    given: dict[str, int | str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value, got {entry!r}")
        value = value.strip()
        try:
            given[key.strip()] = int(value)
        except ValueError:
            given[key.strip()] = value
    options = dict(UNLIMITED_MESSAGES)
    options.update(given)
    return list(options.items())


def check_model_name(name: str) -> None:
    """Raises ValueError if a model name could leave its directory or confuse a path: '/', '..', NUL, empty."""
    if not name or "/" in name or "\\" in name or ".." in name or "\0" in name:
        raise ValueError(f"model name {name!r} is not allowed: it must be non-empty and contain no '/', '\\', "
                         "'..' or NUL")

