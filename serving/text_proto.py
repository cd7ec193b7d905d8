"""TF Serving's text-proto config files that the pip packages have no classes for, and their one reader.

--batching_parameters_file (BatchingParameters), --monitoring_config_file (MonitoringConfig) and
--ssl_config_file (SSLConfig) are text protos of messages that tensorflow-serving-api does not ship;
`message_class` builds such a class from its field list, and `read_text_proto` reads a file into it,
with one wording for a file that cannot be read or parsed. Each config module keeps its own checks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, TypeVar

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message

_Field = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"bool": _Field.TYPE_BOOL, "int64": _Field.TYPE_INT64, "string": _Field.TYPE_STRING}

M = TypeVar("M", bound=Message)


def message_class(file_name: str, full_name: str, messages: dict[str, Sequence[tuple[str, int, str]]],
                  dependencies: Sequence[FileDescriptor] = ()) -> type[Message]:
    """The class of message full_name ("package.Name"), from a proto3 file of the given messages.

    Args:
        file_name: the .proto file's name in its own descriptor pool, e.g. "serving/ssl_config.proto".
        messages: {message name: [(field name, field number, type)]}, in full_name's package. A type is
            "bool", "int64" or "string", or a message's full name with a leading dot
            (".google.protobuf.Int64Value"); "repeated " before it makes the field repeated.
        dependencies: the files those message types come from (e.g. wrappers_pb2.DESCRIPTOR).
    """
    package = full_name.rpartition(".")[0]
    file = descriptor_pb2.FileDescriptorProto(name=file_name, package=package, syntax="proto3",
                                              dependency=[dependency.name for dependency in dependencies])
    for name, fields in messages.items():
        message = file.message_type.add(name=name)
        for field_name, number, type_name in fields:
            repeated = type_name.startswith("repeated ")
            type_name = type_name.removeprefix("repeated ")
            field = message.field.add(name=field_name, number=number,
                                      label=_Field.LABEL_REPEATED if repeated else _Field.LABEL_OPTIONAL)
            if type_name in _SCALARS:
                field.type = _SCALARS[type_name]
            else:
                field.type, field.type_name = _Field.TYPE_MESSAGE, type_name
    pool = descriptor_pool.DescriptorPool()
    for dependency in dependencies:
        pool.AddSerializedFile(dependency.serialized_pb)
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def parse_text_proto(text: str, message_class: type[M], error_class: type[Exception], source: str,
                     hint: str = "") -> M:
    """text parsed into a new message_class.

    Raises:
        error_class: "{source}: {the parser's complaint}", followed by " ({hint})" if a hint is given.
    """
    message = message_class()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as error:
        raise error_class(f"{source}: {error}" + (f" ({hint})" if hint else "")) from None
    return message


def read_text_proto(path: str | os.PathLike, message_class: type[M], error_class: type[Exception],
                    what: str = "", hint: str = "") -> M:
    """The text proto file at path, parsed into a new message_class.

    Args:
        what: the flag that named the file, for the message of a file that cannot be read
            ("cannot read --monitoring_config_file PATH: No such file or directory"); "" leaves it out.
        hint: added to the message of a file that does not parse (parse_text_proto).

    Raises:
        error_class: the file cannot be read, is not text, or does not parse; the message names the file.
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not a text file"
        raise error_class(f"cannot read {what + ' ' if what else ''}{path}: {reason}") from None
    return parse_text_proto(text, message_class, error_class, str(path), hint)
