"""errors.py: every failure kind maps to TF Serving's gRPC code with a one-line message, and the one wrapper
that turns a servicer's exception into that status."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import tensorflow as tf

from serving.servable.runner import InputError, RunnerClosed, SignatureNotFound
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
    # A loaded SavedModel's graph error: no Python stack, so the node trace shares the message's paragraph.
    (tf.errors.InvalidArgumentError(None, None, "Graph execution error:\n\nDetected at node ParseExample/ParseExampleV2 "
                                    "defined at (most recent call last):\n<stack traces unavailable>\nName: <unknown>, "
                                    "Key: features, Index: 0.  Number of float values != expected.\n\t [[{{node "
                                    "ParseExample/ParseExampleV2}}]] [Op:__inference_signature_wrapper_classify_78]"),
     grpc.StatusCode.INVALID_ARGUMENT, "Name: <unknown>, Key: features, Index: 0.  Number of float values != expected."),
    # A function traced in this process: its Python stack comes first, in paragraphs of its own.
    (tf.errors.InvalidArgumentError(None, None, "Graph execution error:\n\nDetected at node add defined at (most "
                                    "recent call last):\n  File \"model.py\", line 3, in call\n\nIncompatible shapes: "
                                    "[3] vs. [2]\n\t [[{{node add}}]] [Op:__inference_call_5]"),
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


def test_a_serving_error_can_carry_any_code():
    error = errors.ServingError("Reload failed", grpc.StatusCode.FAILED_PRECONDITION)
    assert errors.status_for(error) == (grpc.StatusCode.FAILED_PRECONDITION, "Reload failed")
    assert errors.status_for(errors.ServingError("x")) == (grpc.StatusCode.UNKNOWN, "x")
    assert errors.NotFound("gone").code == grpc.StatusCode.NOT_FOUND


def test_code_names_first_lines_and_short_client_strings():
    assert errors.short("a" * 10) == "a" * 10 and errors.short("a" * 500) == "a" * 77 + "..."
    assert errors.code_name(5) == "NOT_FOUND" and errors.code_name(99) == "99"
    assert errors.first_line("\n  first\nsecond", "default") == "first"
    assert errors.first_line(None, "default") == errors.first_line(" \n", "default") == "default"


def test_call_with_status_answers_ok_or_the_status_for_the_failure():
    async def add(a, b):
        return a + b

    async def fail():
        raise errors.Unavailable("queue full")

    assert asyncio.run(errors.call_with_status(add, 1, 2)) == (3, grpc.StatusCode.OK, "")
    assert asyncio.run(errors.call_with_status(fail)) == (None, grpc.StatusCode.UNAVAILABLE, "queue full")


def test_a_cancelled_call_is_no_failure_and_goes_on_up():
    async def cancelled():
        raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(errors.call_with_status(cancelled))


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code, message):
        raise _Aborted(code, message)


def test_handles_errors_aborts_with_the_status_and_tells_on_answer_every_outcome():
    answers = []

    class Servicer:
        @errors.handles_errors(on_answer=lambda servicer, *answer: answers.append(answer[:4]))
        async def Get(self, request, context):
            if request == "bad":
                raise errors.InvalidArgument("bad request")
            return request.upper()

        @errors.handles_errors
        async def Plain(self, request, context):
            raise SignatureNotFound("no signature s")

    servicer = Servicer()
    assert asyncio.run(servicer.Get("ok", _Context())) == "OK"
    with pytest.raises(_Aborted) as aborted:
        asyncio.run(servicer.Get("bad", _Context()))
    assert aborted.value.args == (grpc.StatusCode.INVALID_ARGUMENT, "bad request")
    assert answers == [("Get", "ok", "OK", grpc.StatusCode.OK), ("Get", "bad", None, grpc.StatusCode.INVALID_ARGUMENT)]
    with pytest.raises(_Aborted) as aborted:
        asyncio.run(servicer.Plain("x", _Context()))
    assert aborted.value.args == (grpc.StatusCode.FAILED_PRECONDITION, "no signature s")
    assert Servicer.Get.__name__ == "Get"


def test_a_server_fault_logs_its_traceback_at_most_once_a_minute(monkeypatch, caplog):
    monkeypatch.setattr(errors, "_last_traceback", [-errors.TRACEBACK_INTERVAL_S])
    with caplog.at_level("ERROR", logger="serving.errors"):
        for _ in range(3):
            assert errors.status_for(ZeroDivisionError("division by zero"))[0] == grpc.StatusCode.INTERNAL
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(caplog.records) == 3 and len(with_traceback) == 1
    assert "ZeroDivisionError: division by zero (traceback logged at most every 60 s)" in caplog.records[2].message
