"""Request failures and their gRPC status codes, in one place; the runner's exception classes.

Servicer methods raise; `status_for` is the one mapping from an exception to (code, message), and
`call_with_status` the one place that catches a request's failure: `handles_errors` builds gRPC
servicer methods on it (`context.abort(code, message)`), serving/rest/server.py its HTTP answers, so a bad
request costs the caller one status and the server keeps running. Codes follow TF Serving, and
differ between RPCs where TF Serving's do (serving/servable/inference.py cites the source for each): unknown
model or version NOT_FOUND; unknown signature FAILED_PRECONDITION in Predict but INVALID_ARGUMENT in
Classify/Regress/MultiInference; bad inputs or a signature of the wrong shape INVALID_ARGUMENT; a
MultiInference task method other than classify/regress UNIMPLEMENTED; a Predict signature with a
foreign method_name (only with --enable_signature_method_name_check) INTERNAL; a version unloaded
while the request waited UNAVAILABLE (retryable).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from typing import Any, Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1024  # a status message longer than this is cut (status_for)
# google.rpc.Code values (TF's error codes and GetModelStatus' error_code are the same numbers) -> gRPC codes.
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def code_name(value: int) -> str:
    """The name of a status code value, e.g. "NOT_FOUND" for 5; the number itself for one gRPC does not know."""
    code = STATUS_CODES.get(value)
    return code.name if code is not None else str(value)


def first_line(text: str | None, default: str) -> str:
    """text's first non-blank line (TF appends node traces to its messages), or default if there is none."""
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else default


def op_error_text(message: str | None, default: str) -> str:
    """What a TensorFlow op error says went wrong, in one line: in a graph's error the paragraph above its node
    trace ("Graph execution error:" and "Detected at node ..." come first), without the {{function_node ...}}
    prefix, the [Op:...] suffix and an Assert's "assertion failed: [...]" wrapper."""
    paragraphs = [part.strip() for part in (message or "").strip().split("\n\n") if part.strip()]
    text = next((part for part in paragraphs if "[[{{" in part), paragraphs[0] if paragraphs else "")
    # A loaded SavedModel's functions have no Python stack: the node trace and the message share a paragraph.
    text = re.sub(r"^Detected at node .*\n<stack traces unavailable>\n", "", text)
    text = first_line(text, default)
    text = re.sub(r"^(\{\{function_node [^}]*\}\}\s*)+", "", text)
    text = re.sub(r"\s*\[Op:[^\]]*\]$", "", text).strip()
    asserted = re.fullmatch(r"assertion failed: \[(.*)\]", text)
    return (asserted.group(1) if asserted else text) or default


class RunnerError(Exception):
    """Base class for everything the runner (serving/servable/runner.py) refuses to do."""


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
    """A request the server refuses; `code` is the gRPC status it answers with (the class's, or the one given)."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


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


def require_model_spec(request: Any) -> Any:
    """request.model_spec; a request without one is INVALID_ARGUMENT "Missing ModelSpec", as TF Serving words it."""
    if not request.HasField("model_spec"):
        raise InvalidArgument("Missing ModelSpec")
    return request.model_spec


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and one-line message for an exception raised while serving a request.

    The message is at most MAX_MESSAGE_CHARS long: messages echo what clients sent, and gRPC turns a
    status whose details outgrow its metadata limit into RESOURCE_EXHAUSTED, hiding the real code.
    """
    code, message = _status(error)
    return code, short(message, MAX_MESSAGE_CHARS)


def _status(error: Exception) -> tuple[grpc.StatusCode, str]:
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
        return (STATUS_CODES.get(error.error_code, grpc.StatusCode.UNKNOWN),
                op_error_text(error.message, type(error).__name__))
    _log_server_fault(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


TRACEBACK_INTERVAL_S = 60.0  # a server fault logs its traceback at most this often; the rest one line each
_last_traceback = [-TRACEBACK_INTERVAL_S]
_traceback_lock = threading.Lock()


def _log_server_fault(error: Exception) -> None:
    """Logs a genuine server fault: with its traceback at most once a minute, so a request that keeps
    hitting the same bug cannot fill the log; one line otherwise."""
    now = time.monotonic()
    with _traceback_lock:
        due = now - _last_traceback[0] >= TRACEBACK_INTERVAL_S
        if due:
            _last_traceback[0] = now
    if due:
        log.exception("unexpected error while serving a request")
    else:
        log.error("unexpected error while serving a request: %s: %s (traceback logged at most every %.0f s)",
                  type(error).__name__, first_line(str(error), ""), TRACEBACK_INTERVAL_S)


async def call_with_status(function: Callable[..., Awaitable[Any]], *args: Any) -> tuple[Any, grpc.StatusCode, str]:
    """await function(*args) as (result, OK, ""), or (None, code, message) for the exception it raised (status_for).

    The one place a request's failure is caught: gRPC servicers (handles_errors) and REST answers alike.
    A cancelled call (the client went away) is not a failure: asyncio.CancelledError is no Exception, so
    it goes on up.
    """
    try:
        return await function(*args), grpc.StatusCode.OK, ""
    except Exception as error:  # noqa: BLE001 - every failure must become a status, never a dead server
        code, message = status_for(error)
        return None, code, message


# on_answer(servicer, rpc name, request, response (None on failure), status code, seconds taken).
OnAnswer = Callable[[Any, str, Any, Any, grpc.StatusCode, float], None]


def handles_errors(method: Callable[..., Any] | None = None, *,
                   on_answer: OnAnswer | None = None) -> Callable[..., Any]:
    """Wraps a coroutine servicer method so that any exception becomes a status (context.abort), never a
    dead server. The context is grpc.aio's, or the REST front end's, whose abort raises a ServingError.

    Use as @handles_errors, or as @handles_errors(on_answer=hook) to have hook called once per request,
    whatever its outcome, before the status goes back (e.g. to count it).
    """
    if method is None:
        return functools.partial(handles_errors, on_answer=on_answer)
    rpc = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        start = time.monotonic()
        try:
            response, code, message = await call_with_status(method, self, request, context)
        except asyncio.CancelledError:  # the client went away, or its deadline passed: counted, then gone
            if on_answer is not None:
                on_answer(self, rpc, request, None, cancelled_code(context), time.monotonic() - start)
            raise
        if on_answer is not None:
            on_answer(self, rpc, request, response, code, time.monotonic() - start)
        if code != grpc.StatusCode.OK:
            await context.abort(code, message)
        return response

    return wrapper


def cancelled_code(context: Any) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED for a call whose deadline has passed (grpc.aio's time_remaining), else CANCELLED."""
    time_remaining = getattr(context, "time_remaining", None)
    remaining = time_remaining() if callable(time_remaining) else None
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED


def short(text: str, limit: int = 80) -> str:
    """text cut to `limit` characters, for messages that echo what a client sent (a name, a path, a value)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."
