"""A small TF Serving client: the one place that builds Predict/Classify/Regress requests.

The requests work against any TF Serving (ours or tensorflow_model_server). The pipeline's parity gate,
its warmup file, `pipeline predict` and the bench build their requests here; decoding responses uses
serving/servable/tensors.py, the server's own codec.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import grpc
import numpy as np
from tensorflow_serving.apis import classification_pb2, predict_pb2, prediction_service_pb2_grpc, regression_pb2

from serving.servable import tensors
from serving.limits import UNLIMITED_MESSAGES
from serving.servable.saved_model import DEFAULT_SIGNATURE

DEFAULT_TIMEOUT_S = 30.0
# Responses carry a whole batch: lift gRPC's 4 MB limits as TF Serving's server does.
CHANNEL_OPTIONS = list(UNLIMITED_MESSAGES)


def predict_request(model_name: str, inputs: dict[str, np.ndarray], signature_name: str = DEFAULT_SIGNATURE,
                    version: int | None = None) -> predict_pb2.PredictRequest:
    """A PredictRequest carrying numpy arrays as TensorProtos."""
    request = predict_pb2.PredictRequest()
    _fill_model_spec(request, model_name, signature_name, version)
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tensors.to_tensor_proto(np.asarray(array)))
    return request


def float_examples(rows: np.ndarray, feature_name: str) -> list:
    """Feature rows as tf.Examples with one float_list feature per row (what a classification or
    regression signature over float features parses)."""
    from tensorflow.core.example import example_pb2, feature_pb2

    return [example_pb2.Example(features=feature_pb2.Features(feature={
        feature_name: feature_pb2.Feature(float_list=feature_pb2.FloatList(value=np.asarray(row).reshape(-1)))}))
        for row in rows]


def classify_request(model_name: str, examples: list, signature_name: str,
                     version: int | None = None) -> classification_pb2.ClassificationRequest:
    return _examples_request(classification_pb2.ClassificationRequest(), model_name, examples, signature_name,
                             version)


def regress_request(model_name: str, examples: list, signature_name: str,
                    version: int | None = None) -> regression_pb2.RegressionRequest:
    return _examples_request(regression_pb2.RegressionRequest(), model_name, examples, signature_name, version)


def _examples_request(request, model_name: str, examples: list, signature_name: str, version: int | None):
    """A Classify or Regress request: the two carry tf.Examples in the same Input field."""
    _fill_model_spec(request, model_name, signature_name, version)
    request.input.example_list.examples.extend(examples)
    return request


def _fill_model_spec(request, model_name: str, signature_name: str, version: int | None) -> None:
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    if version is not None:
        request.model_spec.version.value = version


@contextlib.contextmanager
def _channel(channel_or_address: grpc.Channel | str) -> Iterator[grpc.Channel]:
    """Uses a caller's channel as is, or opens (and closes) one to an address."""
    if isinstance(channel_or_address, str):
        with grpc.insecure_channel(channel_or_address, options=CHANNEL_OPTIONS) as channel:
            yield channel
    else:
        yield channel_or_address


def predict_rows(channel_or_address: grpc.Channel | str, model_name: str, input_name: str, x: np.ndarray,
                 batch_size: int, timeout: float = DEFAULT_TIMEOUT_S,
                 version: int | None = None, signature_name: str = DEFAULT_SIGNATURE) -> dict[str, np.ndarray]:
    """Sends x (rows of any dtype: float32 features, an object array of encoded images, ...) through a signature in
    Predict calls of batch_size rows, each with a deadline of timeout seconds; returns each output concatenated
    over the batches.

    Raises:
        grpc.RpcError: the server refused a batch (its status code and message are on the error).
    """
    parts: dict[str, list[np.ndarray]] = {}
    with _channel(channel_or_address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for start in range(0, len(x), batch_size):
            request = predict_request(model_name, {input_name: x[start:start + batch_size]}, signature_name, version)
            response = stub.Predict(request, timeout=timeout)
            for name, proto in response.outputs.items():
                parts.setdefault(name, []).append(tensors.to_ndarray(proto, name))
    return {name: np.concatenate(arrays) for name, arrays in parts.items()}
