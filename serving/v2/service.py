"""What both v2 front ends answer, whatever the wire: health, metadata, and infer as a TF Serving Predict.

An inference request names a model, optionally a version (digits; anything else is taken as a version label,
as TF Serving's labels), its inputs (name, datatype, shape, values) and the outputs wanted. Its inputs are
checked against the signature (names, datatypes, the element limit) before any value is decoded; it then
becomes the PredictRequest a TF Serving client would send, answered by PredictionService.Predict, so the
limits, batching, metrics (rpc "Predict"), the request log and every status are Predict's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.metadata
import time
from typing import Any, Awaitable, Callable

import grpc
import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import model_pb2, predict_pb2

from serving.errors import InvalidArgument, NotFound, ServingError, short
from serving.manager.model_manager import ModelManager
from serving.prediction_service import INLINE_BYTES, off_loop, request_bytes
from serving.rest.json_codec import INT64_MAX
from serving.servable import tensors as tf_tensors
from serving.v2 import tensors

SERVER_NAME = "mixed-precision-pipeline"  # the distribution pyproject.toml names; its version is read from it
PLATFORM = "tensorflow_savedmodel"  # Triton's name for the platform
DEFAULT_SIGNATURE = "serving_default"

Predict = Callable[[predict_pb2.PredictRequest, Any], Awaitable[predict_pb2.PredictResponse]]
# Failures before Predict saw the request: (rpc, request, status, seconds), PredictionService.count_unanswered.
Count = Callable[[str, Any, grpc.StatusCode, float], None]


@dataclasses.dataclass
class Input:
    """One input tensor as the client declared it; `tensor_proto()` decodes it into a serialized TensorProto,
    once every input has been checked."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    tensor_proto: Callable[[], bytes]


@dataclasses.dataclass
class Request:
    model_name: str
    model_version: str
    inputs: list[Input]
    outputs: list[str]  # the outputs wanted, in the order wanted; empty: all, by name
    signature_name: str = ""
    id: str = ""


@dataclasses.dataclass
class Output:
    """One output tensor as Predict answered it (its values in tensor_content where the dtype allows)."""

    name: str
    datatype: str
    shape: list[int]
    proto: Any  # the TensorProto

    def array(self) -> np.ndarray:
        return tf_tensors.to_ndarray(self.proto, self.name)

    def binary(self) -> bytes:
        """The values' bytes (serving/v2/tensors.py from_binary's layout): tensor_content as it is, for numbers."""
        if self.proto.tensor_content and self.proto.dtype != types_pb2.DT_STRING:
            return self.proto.tensor_content  # little-endian, row-major; BOOL one byte each
        return tensors.to_binary(self.array())


@dataclasses.dataclass
class Response:
    model_name: str
    model_version: str
    id: str
    outputs: list[Output]


def model_spec(name: str, version: str) -> model_pb2.ModelSpec:
    """The ModelSpec of a v2 model name and version ("": the latest; digits: that version; else a label)."""
    if not name:
        raise InvalidArgument("the request names no model")
    spec = model_pb2.ModelSpec(name=name)
    if version.isascii() and version.isdigit():
        if int(version) > INT64_MAX:
            raise InvalidArgument(f"model version {short(version)} is out of range")
        spec.version.value = int(version)
    elif version:
        spec.version_label = version
    return spec


class InferenceService:
    """Answers the protocol's calls from the manager's models.

    Args:
        manager: the loaded models.
        predict: runs a PredictRequest as the front end's PredictionService does (its deadline included), its
            outputs best in tensor_content (PredictionService.answering_in_tensor_content), which binary outputs
            send on as they are.
        executor: where a large request (above INLINE_BYTES on the wire) is decoded.
        count_unanswered: counts a request refused before Predict saw it.
    """

    def __init__(self, manager: ModelManager, predict: Predict,
                 executor: concurrent.futures.Executor | None = None, count_unanswered: Count | None = None) -> None:
        self._manager, self._predict, self._executor, self._count = manager, predict, executor, count_unanswered
        self.draining = False  # set as the server drains: not ready from then on

    @staticmethod
    def server_metadata() -> dict:
        return {"name": SERVER_NAME, "version": importlib.metadata.version(SERVER_NAME),
                "extensions": ["binary_tensor_data"]}

    def server_ready(self) -> bool:
        """Ready while not draining and every configured model has a version loaded."""
        names = self._manager.model_names
        return not self.draining and bool(names) and all(self._manager.versions(name) for name in names)

    def model_ready(self, name: str, version: str) -> bool:
        """Whether the version (the latest: "") is loaded; NotFound for a model the server does not serve."""
        self._known(name)
        try:
            self._manager.resolve(model_spec(name, version))
        except ServingError:
            return False
        return not self.draining

    def model_metadata(self, name: str, version: str) -> dict:
        """The model's versions and the default signature's inputs and outputs."""
        self._known(name)
        _, runner = self._manager.resolve(model_spec(name, version))
        signature = _signature(runner, "")
        return {"name": name, "versions": [str(v) for v in sorted(self._manager.versions(name))],
                "platform": PLATFORM, "inputs": _tensors_metadata(signature.inputs),
                "outputs": _tensors_metadata(signature.outputs)}

    async def infer(self, request: Request, context: Any) -> Response:
        """Runs the request as a Predict; a failure before Predict saw it is counted here."""
        start, predict_request = time.monotonic(), predict_pb2.PredictRequest()
        try:
            version = await self._prepare(request, predict_request)
        except ServingError as error:
            self.count_refused(request.model_name, request.model_version, error.code, time.monotonic() - start,
                               predict_request)
            raise
        predict_response = await self._predict(predict_request, context)  # Predict accounts for it from here on

        outputs = []
        for name in request.outputs or sorted(predict_response.outputs):
            proto = predict_response.outputs[name]
            shape = [dim.size for dim in proto.tensor_shape.dim]
            outputs.append(Output(name, tensors.datatype_name(proto.dtype), shape, proto))
        return Response(request.model_name, str(version), request.id, outputs)

    async def _prepare(self, request: Request, predict_request: predict_pb2.PredictRequest) -> int:
        """Fills predict_request from the checked request; returns the version it runs."""
        predict_request.model_spec.CopyFrom(model_spec(request.model_name, request.model_version))
        version, runner = self._manager.resolve(predict_request.model_spec)
        signature = _signature(runner, request.signature_name)
        predict_request.model_spec.version.value = version  # the version whose signature was checked
        predict_request.model_spec.signature_name = request.signature_name
        _check_inputs(request.inputs, signature.inputs, request.signature_name or DEFAULT_SIGNATURE)
        predict_request.output_filter.extend(request.outputs)

        def fill() -> None:
            for tensor in request.inputs:
                predict_request.inputs[tensor.name].ParseFromString(tensor.tensor_proto())

        fill() if request_bytes.get() <= INLINE_BYTES else await off_loop(self._executor, fill)
        return version

    def count_refused(self, name: str, version: str, code: grpc.StatusCode, seconds: float,
                      predict_request: predict_pb2.PredictRequest | None = None) -> None:
        """Counts an infer refused before Predict saw it (in metrics, as a Predict of that model)."""
        if self._count is None:
            return
        if predict_request is None or not predict_request.HasField("model_spec"):
            predict_request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name=name))
            if version.isascii() and version.isdigit() and int(version) <= INT64_MAX:
                predict_request.model_spec.version.value = int(version)
        self._count("Predict", predict_request, code, seconds)

    def _known(self, name: str) -> None:
        if name not in self._manager.model_names:
            raise NotFound(f"model '{short(name)}' is not served here")


def _signature(runner: Any, name: str) -> Any:
    signature = runner.signature_defs.get(name or DEFAULT_SIGNATURE)
    if signature is None:
        raise InvalidArgument(f"the model has no signature '{short(name or DEFAULT_SIGNATURE)}'; it has "
                              f"{short(str(sorted(runner.signature_defs)), 200)} (parameter signature_name)")
    return signature


def _check_inputs(inputs: list[Input], expected: Any, signature_name: str) -> None:
    """Names known and unique, datatypes the signature's, element count within the limit: before any decoding."""
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in inputs:
        if tensor.name in shapes:
            raise InvalidArgument(f"input '{short(tensor.name)}' is given twice")
        if tensor.name not in expected:
            raise InvalidArgument(f"input '{short(tensor.name)}' is not an input of signature '{signature_name}', "
                                  f"which takes {short(str(sorted(expected)), 200)}")
        wanted = expected[tensor.name].dtype
        if tensors.dtype_of(tensor.datatype, tensor.name) != wanted:
            raise InvalidArgument(f"input '{short(tensor.name)}': datatype {tensor.datatype} does not match the "
                                  f"model's {_metadata_datatype(wanted)}")
        shapes[tensor.name] = tensor.shape
    tensors.check_elements(shapes)


def _metadata_datatype(dtype: int) -> str:
    try:
        return tensors.datatype_name(dtype)
    except InvalidArgument:  # a dtype the protocol has no name for: TF's own
        return tf_tensors.type_string(dtype).upper()


def _tensors_metadata(infos: Any) -> list[dict]:
    return [{"name": name, "datatype": _metadata_datatype(info.dtype),
             "shape": [-1] if info.tensor_shape.unknown_rank else [dim.size for dim in info.tensor_shape.dim]}
            for name, info in sorted(infos.items())]
