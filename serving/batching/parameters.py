"""TF Serving's --batching_parameters_file: its BatchingParameters text proto, read and checked.

The message is TF Serving's (session_bundle_config.proto), checked with its rules and wording
(batching_session.cc, shared_batch_scheduler.h); fields the file leaves out take
SharedBatchScheduler's defaults. serving/batching/scheduler.py schedules batches with the result.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from google.protobuf import wrappers_pb2

from serving import text_proto


class BatchingConfigError(ValueError):
    """A --batching_parameters_file that does not parse or breaks TF Serving's rules."""


# TF Serving's BatchingParameters message (session_bundle_config.proto, which the pip package lacks).
BatchingParametersProto = text_proto.message_class(
    "serving/batching_parameters.proto", "tensorflow.serving.BatchingParameters",
    {"BatchingParameters": [("max_batch_size", 1, ".google.protobuf.Int64Value"),
                            ("batch_timeout_micros", 2, ".google.protobuf.Int64Value"),
                            ("max_enqueued_batches", 3, ".google.protobuf.Int64Value"),
                            ("num_batch_threads", 4, ".google.protobuf.Int64Value"),
                            ("thread_pool_name", 5, ".google.protobuf.StringValue"),
                            ("allowed_batch_sizes", 6, "repeated int64"),
                            ("pad_variable_length_inputs", 7, "bool")]},
    dependencies=[wrappers_pb2.DESCRIPTOR])


@dataclasses.dataclass(frozen=True)
class BatchingParameters:
    """The resolved settings; defaults are SharedBatchScheduler's where the file leaves a field out."""

    max_batch_size: int = 1000
    batch_timeout_micros: int = 0
    max_enqueued_batches: int = 10
    num_batch_threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    allowed_batch_sizes: tuple[int, ...] = ()
    pad_variable_length_inputs: bool = False


def parse_batching_parameters(text: str, source: str = "batching parameters") -> BatchingParameters:
    """Parses and checks a BatchingParameters text proto.

    Raises:
        BatchingConfigError: the text does not parse, or a value breaks TF Serving's rules.
    """
    return _resolved(text_proto.parse_text_proto(text, BatchingParametersProto, BatchingConfigError, source), source)


def read_batching_parameters(path: str | os.PathLike) -> BatchingParameters:
    """Reads a --batching_parameters_file; BatchingConfigError names the file and what is wrong."""
    proto = text_proto.read_text_proto(path, BatchingParametersProto, BatchingConfigError,
                                       what="--batching_parameters_file")
    return _resolved(proto, str(path))


def _resolved(proto: Any, source: str) -> BatchingParameters:
    """The settings a parsed BatchingParameters stands for, checked with TF Serving's rules."""
    defaults = BatchingParameters()
    values = {name: getattr(proto, name).value if proto.HasField(name) else getattr(defaults, name)
              for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads")}
    parameters = BatchingParameters(**values, allowed_batch_sizes=tuple(proto.allowed_batch_sizes),
                                    pad_variable_length_inputs=proto.pad_variable_length_inputs)
    problems = _problems(parameters)
    if problems:
        raise BatchingConfigError(f"{source}: " + "; ".join(problems))
    return parameters


def _problems(parameters: BatchingParameters) -> list[str]:
    """TF Serving's checks (batching_session.cc, shared_batch_scheduler.h), in its words where it has them."""
    problems = []
    for name in ("max_batch_size", "max_enqueued_batches", "num_batch_threads"):
        if getattr(parameters, name) < 1:
            problems.append(f"{name} must be positive; was {getattr(parameters, name)}")
    if parameters.batch_timeout_micros < 0:
        problems.append(f"batch_timeout_micros must be non-negative; was {parameters.batch_timeout_micros}")
    sizes = parameters.allowed_batch_sizes
    if any(later <= earlier for earlier, later in zip(sizes, sizes[1:])):
        problems.append("allowed_batch_sizes entries must be monotonically increasing")
    if sizes and sizes[-1] != parameters.max_batch_size:
        problems.append(f"Last entry in allowed_batch_sizes must match max_batch_size; last entry was {sizes[-1]}; "
                        f"expected {parameters.max_batch_size}")
    return problems
