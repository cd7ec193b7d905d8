"""gRPC's inference.GRPCInferenceService on the server's gRPC port: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata and ModelInfer, answered by service.py.

Inputs come in typed `contents` or, all of them or none, in `raw_input_contents` (the only way FP16 and BF16
travel); outputs always go back in `raw_output_contents`, the graph's own bits, as Triton answers. Registered
as a generic handler (the messages are built by proto.py), so the port's interceptor (serving/server.py)
admits, scopes and sizes these calls like every other.
"""

from __future__ import annotations

from typing import Any

import grpc

from serving.errors import InvalidArgument, NotFound, ServingError, handles_errors, short
from serving.v2 import proto, tensors
from serving.v2.service import InferenceService, Input, Request, Response

_Message = {name: proto.message_class(name) for rpc in proto.RPCS.values() for name in rpc}


class InferenceServicer:
    """The service's RPCs; each is a coroutine on the server's event loop."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    @handles_errors
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return _Message["ServerLiveResponse"](live=True)

    @handles_errors
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return _Message["ServerReadyResponse"](ready=self.service.server_ready())

    @handles_errors
    async def ModelReady(self, request: Any, context: Any) -> Any:
        """Ready or not; a model the server does not serve is not ready (as Triton answers; REST says 404)."""
        try:
            ready = self.service.model_ready(request.name, request.version)
        except NotFound:
            ready = False
        return _Message["ModelReadyResponse"](ready=ready)

    @handles_errors
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return _Message["ServerMetadataResponse"](**self.service.server_metadata())

    @handles_errors
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        metadata = self.service.model_metadata(request.name, request.version)
        response = _Message["ModelMetadataResponse"](name=metadata["name"], versions=metadata["versions"],
                                                     platform=metadata["platform"])
        for field in ("inputs", "outputs"):
            for tensor in metadata[field]:
                getattr(response, field).add(**tensor)
        return response

    @handles_errors
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            parsed = infer_request(request)
        except InvalidArgument as error:
            self.service.count_refused(request.model_name, request.model_version, error.code, 0.0)
            raise
        return infer_response(await self.service.infer(parsed, _Nested(context)))


class _Nested:
    """The call's context as Predict sees it inside ModelInfer: its abort raises a ServingError, which
    ModelInfer's own handler answers (a grpc.aio call is aborted once); deadline and peer are the call's."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise ServingError(message, code)

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def peer(self) -> str:
        return self._context.peer()

    def cancelled(self) -> bool:
        return self._context.cancelled()


def _parameter(parameters: Any, key: str) -> Any:
    """A parameter's value (None: not given)."""
    if key not in parameters:
        return None
    choice = parameters[key].WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameters[key], choice)


def infer_request(message: Any) -> Request:
    """The inference request a ModelInferRequest stands for."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidArgument(f"raw_input_contents has {len(raw)} entries for {len(message.inputs)} inputs; "
                              "send every input's values there, or none")
    inputs = []
    for index, tensor in enumerate(message.inputs):
        if not tensor.name:
            raise InvalidArgument(f"inputs[{index}] has no name")
        shape = tensors.checked_shape(list(tensor.shape), tensor.name)
        if raw:
            encode = lambda n=tensor.name, d=tensor.datatype, s=shape, b=raw[index]: (  # noqa: E731
                tensors.binary_tensor_proto(n, d, s, b))
        else:
            encode = lambda n=tensor.name, d=tensor.datatype, s=shape, c=tensor.contents: (  # noqa: E731
                tensors.tensor_proto(tensors.from_contents(n, d, s, c)))
        inputs.append(Input(tensor.name, tensor.datatype, shape, encode))
    if not inputs:
        raise InvalidArgument("the request has no inputs")
    signature_name = _parameter(message.parameters, "signature_name") or ""
    if not isinstance(signature_name, str):
        raise InvalidArgument("parameters.signature_name must be a string_param")
    outputs = []
    for output in message.outputs:
        if output.name in outputs:
            raise InvalidArgument(f"output '{short(output.name)}' is asked for twice")
        if "classification" in output.parameters:
            raise InvalidArgument(f"output '{short(output.name)}': the classification extension is not supported")
        outputs.append(output.name)
    return Request(message.model_name, message.model_version, inputs, outputs, signature_name, message.id)


def infer_response(response: Response) -> Any:
    """The ModelInferResponse: each output's metadata, its values in raw_output_contents."""
    message = _Message["ModelInferResponse"](model_name=response.model_name, model_version=response.model_version,
                                             id=response.id)
    for output in response.outputs:
        message.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        message.raw_output_contents.append(output.binary())
    return message


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Registers the service's six RPCs on a grpc.aio server."""
    handlers = {rpc: grpc.unary_unary_rpc_method_handler(getattr(servicer, rpc),
                                                         request_deserializer=_Message[request].FromString,
                                                         response_serializer=_Message[response].SerializeToString)
                for rpc, (request, response) in proto.RPCS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(f"{proto.PACKAGE}.{proto.SERVICE}",
                                                                          handlers),))
