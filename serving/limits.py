"""Limits a request, a client or a config cannot step past: the gRPC port's connections, streams and message
sizes, the requests in flight, worker threads, model names, the size of one request's tensors, and the
REST port's connections, timeouts and JSON. docs/operations.md's threat model lists each with its flag.

--grpc_channel_arguments follows TF Serving's server.cc: a comma-separated list of key=value, integer
values passed as ints and anything else as a string; a key given there replaces the default below.
Model names become path segments and metric labels, so a name with '/', '..' or NUL is refused.

A request is checked against these before anything is allocated for it (serving/servable/tensors.py,
serving/servable/inference.py), so what a request costs stays a small multiple of what its client sent.
"""

from __future__ import annotations

import os
from typing import Sequence

# A client's channel: TF Serving's clients lift gRPC's 4 MB default so that large batches go through.
UNLIMITED_MESSAGES = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))

DEFAULT_REST_API_MAX_BODY_BYTES = 64 * 1024 * 1024

# The gRPC port: the largest request message, counted after decompression (gRPC stops inflating a gzip
# bomb there: four 1 MB requests that inflate to 1 GiB each are RESOURCE_EXHAUSTED, not 3 GB of memory).
# TF Serving allows INT_MAX; ours is the REST body limit plus room for framing, which holds the default
# --max_request_elements of float32 values. (gRPC may keep one inflated buffer of this size for reuse.)
MAX_RECEIVE_MESSAGE_BYTES = DEFAULT_REST_API_MAX_BODY_BYTES + 1024 * 1024
MAX_CONCURRENT_STREAMS = 100  # calls open at once on one HTTP/2 connection (HTTP/2's own suggested minimum)
MAX_CONNECTION_IDLE_MS = 60_000  # a gRPC connection without calls this long is closed, as REST's idle timeout

# On SIGTERM, calls (and REST requests) keep being answered this long before new ones are refused
# UNAVAILABLE (503): gRPC may hold calls it received before the signal but has not handed to the server yet
# (measured: up to 44 of 48 closed-loop clients' calls); a moment's grace answers them instead of refusing.
DRAIN_ADMIT_S = 0.25

SHUTTING_DOWN = "the server is shutting down; send the request to another server"  # UNAVAILABLE, REST 503


def drain_s(grace_s: float) -> float:
    """How much of --grace_period_s the requests in flight get: the rest (a tenth, at most 2 s) is kept for closing
    the ports, the batch threads and the request logs, so that the process exits within the grace period
    (Kubernetes kills it then; under load the exit took the grace period and 1 to 2 s more, issue 31)."""
    return max(grace_s - min(0.1 * grace_s, 2.0), 0.0)


# Requests in flight, gRPC and REST together (--max_inflight_requests, --max_inflight_request_bytes): more
# are answered RESOURCE_EXHAUSTED (REST 429) at once, so pending work and the memory it holds stay bounded.
DEFAULT_MAX_INFLIGHT_REQUESTS = 1024
DEFAULT_MAX_INFLIGHT_REQUEST_BYTES = 256 * 1024 * 1024

# Completions (serving/rest/openai.py): max_tokens per prompt (the model's context bounds it too) and the longest
# prompt, in bytes, checked before tokenizing it (--generation_max_new_tokens, --generation_max_prompt_bytes).
DEFAULT_GENERATION_MAX_NEW_TOKENS = 4096
DEFAULT_GENERATION_MAX_PROMPT_BYTES = 64 * 1024
# A client's (peer address's) rows in a decode step while other clients generate too
# (--generation_max_rows_per_client, serving/generation/decoder.py). A step's attention reads every row's cache up
# to the deepest row, so rows deep in the context cost most: under issue 30's hostile mix (100 calls for the whole
# context from one client) a well-behaved stream kept 0.40 of its rate alone with 4, 0.45-0.68 with 2 (the same
# 2-vCPU AMD EPYC VM on two days), 0.60-0.64 with 1: one row per client while others generate, round robin in
# effect (bench figure 12; docs/serving.md).
DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT = 1

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
# ... and a body of more values (numbers, strings, arrays, objects) than this: parsing makes a Python object of
# each while holding the interpreter, ~0.5 s and ~250 MB per million one-number rows (a 64 MiB body of them
# stalled every client for 11 s). Flat rows of a million numbers parse in ~40 ms.
MAX_JSON_VALUES = 1 << 20
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


def default_max_connections() -> int:
    """Open connections per port (--rest_api_max_connections, and the gRPC port's
    grpc.max_allowed_incoming_connections): a quarter of the open-file limit (ulimit -n) each, so that idle
    or slow clients of both ports together can never take the descriptors model loading needs."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) // 4)


def grpc_server_options(given: Sequence[tuple[str, int | str]] | None, reuse_port: bool) -> list[tuple[str, int | str]]:
    """The gRPC port's channel arguments: the bounds above, SO_REUSEPORT as --reuse_port says, and whatever
    --grpc_channel_arguments gives (each key there wins)."""
    options: dict[str, int | str] = {
        "grpc.max_send_message_length": -1,  # answers carry whole batches, as TF Serving's do
        "grpc.max_receive_message_length": MAX_RECEIVE_MESSAGE_BYTES,
        "grpc.max_concurrent_streams": MAX_CONCURRENT_STREAMS,
        # gRPC's "overload protection" counts the streams not yet freed inside it against the limit above, so a
        # client that keeps to it is still refused (REFUSED_STREAM, UNAVAILABLE "Stream removed"): 269 of 500
        # calls opened at once on one channel (issue 31 #2). Off, a client's calls beyond the limit wait in the
        # client for a free stream, as HTTP/2 means them to; open streams stay bounded by the limit.
        "grpc.http.overload_protection": 0,
        "grpc.max_connection_idle_ms": MAX_CONNECTION_IDLE_MS,
        "grpc.max_allowed_incoming_connections": default_max_connections(),
        "grpc.so_reuseport": int(reuse_port),
    }
    options.update(given or ())
    return list(options.items())


class Admission:
    """The requests both front ends serve at once, and their bytes on the wire, bounded: one beyond either
    bound is refused at once (RESOURCE_EXHAUSTED), so neither the queues before the model nor the memory
    they hold can grow with what clients send. One request of any size is admitted when none is in flight
    (its size is bounded by the receive and body limits). Used on the server's event loop only."""

    def __init__(self, max_requests: int = DEFAULT_MAX_INFLIGHT_REQUESTS,
                 max_bytes: int = DEFAULT_MAX_INFLIGHT_REQUEST_BYTES) -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = self.bytes = 0

    def admit(self, size: int) -> str | None:
        """Takes a request of `size` bytes; returns why not (None: taken, and release(size) is due when done)."""
        if self.requests and (self.requests >= self.max_requests or self.bytes + size > self.max_bytes):
            return (f"the server is busy: {self.requests} requests ({self.bytes} bytes) in flight, at most "
                    f"{self.max_requests} and {self.max_bytes} bytes (--max_inflight_requests, "
                    "--max_inflight_request_bytes); retry later")
        self.requests += 1
        self.bytes += size
        return None

    def release(self, size: int) -> None:
        self.requests -= 1
        self.bytes -= size


def default_max_threads() -> int:
    """Worker threads (--grpc_max_threads, --rest_api_num_threads): TF releases the GIL and uses all
    cores per op, so a few per core suffice."""
    return 4 * (os.cpu_count() or 1)


def parse_channel_arguments(text: str) -> list[tuple[str, int | str]]:
    """gRPC server options from "k=v,k=v" (--grpc_channel_arguments), for grpc_server_options.

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
    return list(given.items())


def check_model_name(name: str) -> None:
    """Raises ValueError if a model name could leave its directory or confuse a path: '/', '..', NUL, empty."""
    if not name or "/" in name or "\\" in name or ".." in name or "\0" in name:
        raise ValueError(f"model name {name!r} is not allowed: it must be non-empty and contain no '/', '\\', "
                         "'..' or NUL")

