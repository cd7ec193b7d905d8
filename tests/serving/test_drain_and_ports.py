"""The server's shutdown and ports (serving/app.py, serving/server.py, serving/rest/server.py): SIGTERM with many calls in flight answers every one of them (none
CANCELLED), and a taken port is an error unless both servers ask to share it.

(Draining with one call held in flight, health NOT_SERVING and new calls refused: test_server_tfserving.py.)
"""

from __future__ import annotations

import collections
import signal

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from server_helpers import serving
from serving.manager.model_manager import ModelManager

pytestmark = pytest.mark.timeout(180)
CLIENTS = 48


def test_a_taken_port_is_an_error_unless_both_servers_share_it_on_purpose():
    manager = ModelManager(file_system_poll_wait_seconds=0)
    with serving(manager) as first:
        port = first.server.grpc_port
        with pytest.raises(RuntimeError) as error:  # gRPC's own default (SO_REUSEPORT) would share the port
            with serving(manager, port=port):
                pass
        assert str(error.value).startswith(f"cannot listen on 127.0.0.1:{port}: Failed to bind")
    with serving(manager, reuse_port=True) as first, serving(manager, port=first.server.grpc_port,
                                                              reuse_port=True) as second:
        assert second.server.grpc_port == first.server.grpc_port


def test_the_rest_port_is_shared_only_on_purpose_too():
    manager = ModelManager(file_system_poll_wait_seconds=0)
    with serving(manager, rest_api_port=-1) as first:
        port = first.server.rest_port
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port} for the REST API"):
            with serving(manager, rest_api_port=port):
                pass
    with serving(manager, rest_api_port=-1, reuse_port=True) as first, serving(
            manager, rest_api_port=first.server.rest_port, reuse_port=True) as second:
        assert second.server.rest_port == first.server.rest_port


def test_sigterm_with_48_calls_in_flight_answers_every_one(tmp_path, start_server):
    """The calls, ~2.5 MB each, are still arriving when SIGTERM comes: before the drain, gRPC answered
    CANCELLED to those it had not handed to the server yet (10 of 48 on 2 cores). Now each one is either
    answered (accepted before SIGTERM) or refused UNAVAILABLE (retryable)."""

    class Sum(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.reduce_sum(x, axis=1)}

    model = Sum()
    tf.saved_model.save(model, str(tmp_path / "sum" / "1"), signatures={"serving_default": model.serve})
    server = start_server("--model_name=sum", f"--model_base_path={tmp_path / 'sum'}", "--grace_period_s=60",
                          log_dir=tmp_path)
    request = predict_pb2.PredictRequest(model_spec={"name": "sum"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((10000, 64), np.float32)))
    payload = request.SerializeToString()
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    channels = [grpc.insecure_channel(server.address, options=unlimited) for _ in range(CLIENTS)]
    try:
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=30)
        calls = [channel.unary_unary("/tensorflow.serving.PredictionService/Predict") for channel in channels]
        in_flight = [call.future(payload, timeout=60) for call in calls]
        server.process.send_signal(signal.SIGTERM)
        codes = collections.Counter("OK" if call.exception() is None else call.exception().code().name
                                    for call in in_flight)
        assert server.process.wait(60) == 0, server.stderr_tail()
    finally:
        for channel in channels:
            channel.close()
        server.stop()
    assert codes["CANCELLED"] == 0, codes
    assert set(codes) <= {"OK", "UNAVAILABLE"} and sum(codes.values()) == CLIENTS, codes
