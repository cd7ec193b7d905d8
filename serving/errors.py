"""Request failures and their gRPC status codes, in one place; the runner's exception classes.

Servicer methods raise; `handles_errors` turns the exception into `context.abort(code, message)`, so
a bad request costs the caller one status and the server keeps running. Codes follow TF Serving, and
differ between RPCs where TF Serving's do (serving/inference.py cites the source for each): unknown
model or version NOT_FOUND; unknown signature FAILED_PRECONDITION in Predict but INVALID_ARGUMENT in
Classify/Regress/MultiInference; bad inputs or a signature of the wrong shape INVALID_ARGUMENT; a
MultiInference task method other than classify/regress UNIMPLEMENTED; a Predict signature with a
foreign method_name (only with --enable_signature_method_name_check) INTERNAL; a version unloaded
while the request waited UNAVAILABLE (retryable).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import grpc

log = logging.getLogger(__name__)

_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class RunnerError(Exception):
    """Base class for everything the runner (serving/runner.py) refuses to do."""


class InputError(RunnerError, ValueError):
    """The request does not fit the model: input names, dtype, shape, unknown output names, or the
    model's own ops rejected it (TensorFlow's INVALID_ARGUMENT, e.g. incompatible shapes in a MatMul)."""


class SignatureNotFound(RunnerError, KeyError):
    """The model has no signature of that name; the message lists the ones it has."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else ""


class LoadError(RunnerError):
    """A version could not be loaded; the message is one line, fit for GetModelStatus."""


class SavedModelNotFound(LoadError, FileNotFoundError):
    """No SavedModel at the path, and no numeric version directory under it."""


class PolicyMismatch(LoadError):
    """pipeline.json names a compute dtype that the serving graph does not compute in."""


class RunnerClosed(RunnerError):
    """predict() after close(): the version has been unloaded."""


class ServingError(Exception):
    """A request the server refuses; `code` is the gRPC status it answers with."""

    code = grpc.StatusCode.UNKNOWN


class NotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServingError):
    """Retry later, e.g. a full batch queue (TF Serving answers UNAVAILABLE too)."""

    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServingError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(ServingError):
    code = grpc.StatusCode.INTERNAL


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and one-line message for an exception raised while serving a request."""
    if isinstance(error, ServingError):
        return error.code, str(error)
    if isinstance(error, InputError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, SignatureNotFound):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, RunnerClosed):  # the version was unloaded under the request: retryable
        return grpc.StatusCode.UNAVAILABLE, str(error)
    import tensorflow as tf  # lazy: this module stays light, so the CLI can import its exception classes before TF

    if isinstance(error, tf.errors.OpError):  # TF's error codes are gRPC's, value for value
        lines = (error.message or "").strip().splitlines()  # the rest is TF's node trace
        return _CODES_BY_VALUE.get(error.error_code, grpc.StatusCode.UNKNOWN), lines[0] if lines else type(error).__name__
    log.exception("unexpected error while serving a request")
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def handles_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a servicer method so that any exception becomes a gRPC status, never a dead server."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as error:  # noqa: BLE001 - every failure must become a status
            code, message = status_for(error)
        context.abort(code, message)

    return wrapper
