"""errors.status_for: every failure kind maps to TF Serving's gRPC code with a one-line message."""

from __future__ import annotations

import grpc
import pytest
import tensorflow as tf

from serving.runner import InputError, RunnerClosed, SignatureNotFound
from serving import errors


@pytest.mark.parametrize("error, code, message", [
    (errors.NotFound("Servable not found for request: Latest(m)"), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request: Latest(m)"),
    (InputError("input 'x': expected dtype float32, got float64"), grpc.StatusCode.INVALID_ARGUMENT,
     "input 'x': expected dtype float32, got float64"),
    (SignatureNotFound('Serving signature key "s" not found.'), grpc.StatusCode.FAILED_PRECONDITION,
     'Serving signature key "s" not found.'),
    (tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [3] vs. [2]\n\t [[{{node add}}]]"),
     grpc.StatusCode.INVALID_ARGUMENT, "Incompatible shapes: [3] vs. [2]"),
    (tf.errors.ResourceExhaustedError(None, None, "OOM"), grpc.StatusCode.RESOURCE_EXHAUSTED, "OOM"),
    (errors.Unimplemented("Unsupported signature method_name: tensorflow/serving/predict"),
     grpc.StatusCode.UNIMPLEMENTED, "Unsupported signature method_name: tensorflow/serving/predict"),
    (errors.Internal("Expected prediction signature method_name to be one of {...}. Was: custom"),
     grpc.StatusCode.INTERNAL, "Expected prediction signature method_name to be one of {...}. Was: custom"),
    (RunnerClosed("model m version 1 was unloaded"), grpc.StatusCode.UNAVAILABLE, "model m version 1 was unloaded"),
    (ZeroDivisionError("division by zero"), grpc.StatusCode.INTERNAL, "ZeroDivisionError: division by zero"),
])
def test_status_for(error, code, message):
    assert errors.status_for(error) == (code, message)
