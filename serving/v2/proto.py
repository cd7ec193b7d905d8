"""The messages of gRPC's inference.GRPCInferenceService, built from their description here at import.

The schema is open-inference-protocol's specification/protocol/open_inference_grpc.proto, field for field
(Triton's grpc_service.proto has the same messages and numbers, and more RPCs). No protoc runs: the project's
protobuf 7 has no matching grpcio-tools, and tritonclient's generated modules pin protobuf < 7
(docs/serving.md#kserve-v2). The messages live in a descriptor pool of their own, so they never clash with
another copy of the same protos in the process.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = "GRPCInferenceService"
_Field = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"bool": _Field.TYPE_BOOL, "string": _Field.TYPE_STRING, "bytes": _Field.TYPE_BYTES,
            "int32": _Field.TYPE_INT32, "int64": _Field.TYPE_INT64, "uint32": _Field.TYPE_UINT32,
            "uint64": _Field.TYPE_UINT64, "float": _Field.TYPE_FLOAT, "double": _Field.TYPE_DOUBLE}
_PARAMETERS = "map<string, InferParameter>"
_TENSOR = [("name", 1, "string"), ("datatype", 2, "string"), ("shape", 3, "repeated int64")]

# message name -> its fields (name, number, type); "Outer.Inner" is a nested message.
MESSAGES: dict[str, list[tuple[str, int, str]]] = {
    "ServerLiveRequest": [], "ServerLiveResponse": [("live", 1, "bool")],
    "ServerReadyRequest": [], "ServerReadyResponse": [("ready", 1, "bool")],
    "ModelReadyRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelReadyResponse": [("ready", 1, "bool")],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [("name", 1, "string"), ("version", 2, "string"),
                               ("extensions", 3, "repeated string")],
    "ModelMetadataRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelMetadataResponse": [("name", 1, "string"), ("versions", 2, "repeated string"), ("platform", 3, "string"),
                              ("inputs", 4, "repeated ModelMetadataResponse.TensorMetadata"),
                              ("outputs", 5, "repeated ModelMetadataResponse.TensorMetadata"),
                              ("properties", 6, "map<string, string>")],
    "ModelMetadataResponse.TensorMetadata": _TENSOR,
    "ModelInferRequest": [("model_name", 1, "string"), ("model_version", 2, "string"), ("id", 3, "string"),
                          ("parameters", 4, _PARAMETERS),
                          ("inputs", 5, "repeated ModelInferRequest.InferInputTensor"),
                          ("outputs", 6, "repeated ModelInferRequest.InferRequestedOutputTensor"),
                          ("raw_input_contents", 7, "repeated bytes")],
    "ModelInferRequest.InferInputTensor": [*_TENSOR, ("parameters", 4, _PARAMETERS),
                                           ("contents", 5, "InferTensorContents")],
    "ModelInferRequest.InferRequestedOutputTensor": [("name", 1, "string"), ("parameters", 2, _PARAMETERS)],
    "ModelInferResponse": [("model_name", 1, "string"), ("model_version", 2, "string"), ("id", 3, "string"),
                           ("parameters", 4, _PARAMETERS),
                           ("outputs", 5, "repeated ModelInferResponse.InferOutputTensor"),
                           ("raw_output_contents", 6, "repeated bytes")],
    "ModelInferResponse.InferOutputTensor": [*_TENSOR, ("parameters", 4, _PARAMETERS),
                                             ("contents", 5, "InferTensorContents")],
    # oneof parameter_choice: every field below is in it.
    "InferParameter": [("bool_param", 1, "bool"), ("int64_param", 2, "int64"), ("string_param", 3, "string"),
                       ("double_param", 4, "double"), ("uint64_param", 5, "uint64")],
    "InferTensorContents": [("bool_contents", 1, "repeated bool"), ("int_contents", 2, "repeated int32"),
                            ("int64_contents", 3, "repeated int64"), ("uint_contents", 4, "repeated uint32"),
                            ("uint64_contents", 5, "repeated uint64"), ("fp32_contents", 6, "repeated float"),
                            ("fp64_contents", 7, "repeated double"), ("bytes_contents", 8, "repeated bytes")],
}
_ONEOFS = {"InferParameter": "parameter_choice"}
# rpc -> (request, response)
RPCS = {name: (name + "Request", name + "Response")
        for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer")}


def _set_type(field: _Field, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type, field.type_name = _Field.TYPE_MESSAGE, f".{PACKAGE}.{type_name}"


def _add_field(message: descriptor_pb2.DescriptorProto, path: str, name: str, number: int, spec: str) -> None:
    field = message.field.add(name=name, number=number, label=_Field.LABEL_OPTIONAL)
    if spec.startswith("map<"):  # a repeated nested XxxEntry {key = 1; value = 2} marked map_entry
        key, value = (part.strip() for part in spec[4:-1].split(","))
        entry = message.nested_type.add(name="".join(part.capitalize() for part in name.split("_")) + "Entry")
        entry.options.map_entry = True
        _add_field(entry, f"{path}.{entry.name}", "key", 1, key)
        _add_field(entry, f"{path}.{entry.name}", "value", 2, value)
        field.label, field.type = _Field.LABEL_REPEATED, _Field.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{path}.{entry.name}"
        return
    if spec.startswith("repeated "):
        field.label, spec = _Field.LABEL_REPEATED, spec[len("repeated "):]
    _set_type(field, spec)


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The .proto file the service is defined in, as protoc would describe it."""
    file = descriptor_pb2.FileDescriptorProto(name="open_inference_grpc.proto", package=PACKAGE, syntax="proto3")
    built: dict[str, descriptor_pb2.DescriptorProto] = {}
    for path, fields in MESSAGES.items():  # outer messages come before their nested ones
        outer, _, inner = path.rpartition(".")
        message = built[outer].nested_type.add(name=inner) if outer else file.message_type.add(name=path)
        built[path] = message
        for name, number, spec in fields:
            _add_field(message, path, name, number, spec)
        if path in _ONEOFS:
            message.oneof_decl.add(name=_ONEOFS[path])
            for field in message.field:
                field.oneof_index = 0
    service = file.service.add(name=SERVICE)
    for rpc, (request, response) in RPCS.items():
        service.method.add(name=rpc, input_type=f".{PACKAGE}.{request}", output_type=f".{PACKAGE}.{response}")
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(file_descriptor())


def message_class(name: str) -> type:
    """The message class of a message of the service ("ModelInferRequest", ...)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ModelInferRequest = message_class("ModelInferRequest")
ModelInferResponse = message_class("ModelInferResponse")
InferTensorContents = message_class("InferTensorContents")
