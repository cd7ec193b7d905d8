"""Limits a request or a config cannot step past: gRPC channel arguments, worker threads and model names.

--grpc_channel_arguments follows TF Serving's server.cc: a comma-separated list of key=value, integer
values passed as ints and anything else as a string. Model names become path segments and metric
labels, so a name with '/', '..' or NUL is refused.
"""

from __future__ import annotations

import os

# TF Serving lifts gRPC's 4 MB default to INT_MAX, so large batches go through.
UNLIMITED_MESSAGES = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))

DEFAULT_REST_API_MAX_BODY_BYTES = 64 * 1024 * 1024


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

