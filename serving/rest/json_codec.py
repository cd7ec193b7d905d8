"""TF Serving's REST JSON, both ways: request bodies into the request protos a gRPC client would send, and
outputs into JSON, as util/json_tensor.cc reads and writes them ("instances" row format, "inputs"
columnar format, {"b64": ...} for binary strings, "examples"/"context" as tf.Examples).

Every malformed body is InvalidArgument with one line: a JSON body nested deeper than MAX_JSON_DEPTH, with
a number longer than MAX_JSON_NUMBER_CHARS or with more than MAX_JSON_VALUES values (serving/limits.py) is
refused before it is parsed, in one pass at C speed: parsing is what costs (a Python object per value,
holding the interpreter all along).

orjson parses and writes JSON; the json module takes over wherever the two would differ, so that what is
accepted, how it is read and what the errors say stay the json module's. It parses what orjson refuses
(NaN and Infinity, which TF Serving's parser accepts too; numbers beyond float64; lone surrogates; UTF-16
and byte-order marks; every malformed body, for json's error message) and bodies with an integer of 19 or
more digits (orjson reads those beyond 64 bits as floats). It writes (`dumps`) payloads with non-finite
floats, as the bare NaN, Infinity and -Infinity that TF Serving writes (orjson writes null). No request
runs TensorFlow here.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import numpy as np
import orjson
from google.protobuf import json_format
from tensorflow.core.example import example_pb2
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import predict_pb2

from serving.servable import tensors
from serving.errors import InvalidArgument, Unimplemented
from serving.limits import MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS, MAX_JSON_VALUES

INT64_MAX = 2**63 - 1
_OPENERS, _CLOSERS = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
_BFLOAT16 = tensors.numpy_dtype(types_pb2.DT_BFLOAT16)


# A JSON string (escapes included), removed before brackets and numbers are measured. Possessive loops and an
# unterminated string running to the end of the body (with or without a last lone backslash) make every '"'
# start a match that never backtracks and is never retried: one pass over the body, whatever it holds. (Without
# them a body of 64 KiB of '"\\' pairs took 12 s, quadratically.)
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)

# Outside strings, runs of characters are measured as runs of b"0" in a translation: a substring search
# runs at C speed, where a regex like [-+0-9.eE]{1001,} retries at every character of every number.
_NUMBER_CHARS = bytes(48 if byte in b"-+0123456789.eE" else 32 for byte in range(256))
# Digits as b"0", the rest of a number's characters (. e E) as b".", anything else as b" ": an integer part
# (of an integer or a float) is then a run of b"0" after a b" " or at the start; a fraction or an exponent
# follows a b".", and the signs, as b" ", let an exponent count as an integer part (a harmless false alarm).
_INTEGER_PARTS = bytes(48 if byte in b"0123456789" else 46 if byte in b".eE" else 32 for byte in range(256))
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_LONG_NUMBER = b"0" * (MAX_JSON_NUMBER_CHARS + 1)
_LONG_INTEGER = b"0" * 19  # 2**63 has 19 digits: orjson reads every shorter integer as an int


def as_dict(message: Any) -> dict:
    """A response proto as TF Serving's REST API writes it: every field, with its proto name."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True)


def parse_body(body: bytes) -> dict:
    """The JSON object of a request body, refused (InvalidArgument) before parsing if it nests too deep
    or holds a number too long to be one: what a parser would spend stack or CPU on."""
    structure = _check_json_size(body)
    try:
        request = _loads(body or b"{}", structure)  # accepts NaN, Infinity and -Infinity, as TF Serving's parser does
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        raise InvalidArgument(f"JSON Parse error: {_first_line(error)}") from None
    if not isinstance(request, dict):
        raise InvalidArgument("JSON Value: " + _excerpt(request) + " Is not an object")
    return request


def _loads(body: bytes, structure: bytes) -> Any:
    """json.loads(body), by orjson where the two agree: see the module's docstring."""
    integer_parts = structure.translate(_INTEGER_PARTS)
    if not integer_parts.startswith(_LONG_INTEGER) and b" " + _LONG_INTEGER not in integer_parts:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


def _check_json_size(body: bytes) -> bytes:
    """Number length, value count and nesting depth, measured outside strings at C speed (regex, translate,
    count, find and numpy); returns the body without its strings."""
    structure = _JSON_STRING.sub(b"", body)
    numbers = structure.translate(_NUMBER_CHARS)
    start = numbers.find(_LONG_NUMBER)  # where the first run longer than the limit starts
    if start >= 0:
        end = numbers.find(b" ", start)
        raise InvalidArgument(f"JSON Parse error: a number of {(len(numbers) if end < 0 else end) - start} "
                              f"characters; at most {MAX_JSON_NUMBER_CHARS} are allowed")
    brackets = structure.translate(None, _NOT_BRACKETS)
    containers = brackets.count(b"[") + brackets.count(b"{")
    values = structure.count(b",") + containers + 1  # a value is a container's first or follows a comma
    if values > MAX_JSON_VALUES:
        raise InvalidArgument(f"JSON body of about {values} values (numbers, strings, arrays and objects); at most "
                              f"{MAX_JSON_VALUES} are allowed per REST request: send larger requests over gRPC, or "
                              "as fewer, longer rows")
    if containers <= MAX_JSON_DEPTH:
        return structure
    depth, chunk = 0, 1 << 20
    for start in range(0, len(brackets), chunk):
        codes = np.frombuffer(brackets, np.uint8, count=min(chunk, len(brackets) - start), offset=start)
        steps = np.isin(codes, _OPENERS).astype(np.int32) - np.isin(codes, _CLOSERS)
        levels = np.cumsum(steps) + depth
        if levels.max(initial=0) > MAX_JSON_DEPTH:
            raise InvalidArgument(f"JSON Parse error: arrays and objects nested deeper than {MAX_JSON_DEPTH} levels")
        depth = int(levels[-1])
    return structure


def dumps(payload: Any, pretty: bool = False) -> bytes:
    """A response body: payload as JSON in UTF-8, compact (pretty: indented by two spaces).

    The values are json.dumps's: an int in full, a float as the shortest text that reads back as the same
    float64 (a float32 output is widened first, by tolist(): 0.1 is 0.10000000149011612), and NaN,
    Infinity and -Infinity as those bare tokens, as TF Serving writes them. orjson writes the payload
    unless the json module must: a payload with a non-finite float (orjson writes null, and no payload
    here has a null otherwise: a false alarm costs only time) or with what orjson refuses (an integer
    beyond 64 bits, a lone surrogate, a numpy scalar). The text can differ from json.dumps's, never the
    values: orjson writes 1e-05 and 1.5e-07 as 0.00001 and 1.5e-7, and non-ASCII text unescaped.
    """
    try:
        body = orjson.dumps(payload, option=orjson.OPT_INDENT_2 if pretty else 0)
        if b"null" not in body:
            return body
    except orjson.JSONEncodeError:
        pass
    return json.dumps(payload, indent=2 if pretty else None, separators=None if pretty else (",", ":")).encode()


def text(value: str, what: str) -> str:
    """value, if a proto string field can hold it (JSON and URLs can carry lone surrogates); else InvalidArgument."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} {_excerpt(value)} is not valid UTF-8 text") from None
    return value


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def signature_name(body: dict) -> str:
    name = body.get("signature_name", "")
    if not isinstance(name, str):
        raise InvalidArgument(f"'signature_name' key must be a string value. Got: {_excerpt(name)}")
    return text(name, "'signature_name'")


def predict_inputs(body: dict, signature: Any, request: predict_pb2.PredictRequest) -> bool:
    """Fills request.inputs from "instances" (row format, returns True) or "inputs" (columnar, False)."""
    if ("instances" in body) == ("inputs" in body):
        raise InvalidArgument("Missing 'inputs' or 'instances' key" if "instances" not in body else
                              "Not formatted correctly expecting only one of 'inputs' or 'instances' keys exists")
    dtypes = {name: info.dtype for name, info in signature.inputs.items()}
    if "instances" in body:
        instances = body["instances"]
        if not isinstance(instances, list) or not instances:
            raise InvalidArgument("Expecting 'instances' to be an list/array of at least one element")
        if all(isinstance(row, dict) and not _is_b64(row) for row in instances):
            names = set(instances[0])
            if any(set(row) != names for row in instances):
                raise InvalidArgument("Failed to process element: all objects in 'instances' must have the same "
                                      f"keys; the first has {sorted(names)}")
            values = {name: [row[name] for row in instances] for name in names}
        else:
            values = {_sole_input(dtypes, "instances"): instances}
    else:
        inputs = body["inputs"]
        values = inputs if isinstance(inputs, dict) and not _is_b64(inputs) else {_sole_input(dtypes, "inputs"): inputs}
    for name in values:  # every name before any value is converted
        if name not in dtypes:
            raise InvalidArgument(f"JSON object: does not have named input: {short(name)}; the signature takes "
                                  f"{sorted(dtypes)}")
    for name, value in values.items():  # tensor_content: no loop over the values, to write them or to read them
        request.inputs[name].ParseFromString(tensors.serialize_tensor_proto(to_array(value, dtypes[name], name),
                                                                            content=True))
    return "instances" in body


def _sole_input(dtypes: dict[str, int], key: str) -> str:
    if len(dtypes) != 1:
        raise InvalidArgument(f"'{key}' is not a JSON object of named inputs, but the signature takes "
                              f"{len(dtypes)} inputs: {sorted(dtypes)}")
    return next(iter(dtypes))


def to_array(value: Any, dtype: int, name: str) -> np.ndarray:
    """A JSON value as an array of the input's dtype; strings and {"b64": ...} become bytes.

    As json_tensor.cc does, values must be of the dtype's kind: numbers for a float input, integers
    for an integer input, true/false for a bool input (numpy alone would turn null into NaN and
    "1.5" into 1.5).

    Raises:
        InvalidArgument: values of another kind, out of the dtype's range, or lists of unequal lengths.
    """
    type_name = tensors.type_string(dtype)
    try:
        if dtype == types_pb2.DT_STRING:
            array = np.array(_bytes_leaves(value), dtype=object)
            if not all(isinstance(item, bytes) for item in array.flat):
                raise ValueError("lists at one level must all have the same length")
            return array
        target = tensors.numpy_dtype(dtype)
        source = np.array(value)  # numpy's own type for the JSON values: bool, int64, float64, or other
        if target == np.uint64 and source.dtype.kind in "fO" and source.size:
            source = _unsigned_64(value, source)
    except (ValueError, TypeError, RuntimeError) as error:  # RuntimeError: an object array of > 32 dimensions
        raise InvalidArgument(f"Failed to process element: input '{name}' of type {type_name}: "
                              f"{_first_line(error)}") from None
    if target.kind not in "biuf" and target != _BFLOAT16:  # json_tensor.cc AddValueToTensor
        raise Unimplemented(f"Conversion of JSON Value to type: {type_name} is not supported (input '{name}')")
    kinds, words = (("b", "true or false") if target.kind == "b" else ("iu", "integers") if target.kind in "iu"
                    else ("iuf", "numbers"))
    if source.size and source.dtype.kind not in kinds:
        raise InvalidArgument(f"Failed to process element: input '{name}' of type {type_name}: its JSON values must "
                              f"all be {words}, in lists of equal lengths")
    if target.kind in "iu" and source.size:
        info = np.iinfo(target)
        if source.min() < info.min or source.max() > info.max:
            raise InvalidArgument(f"Failed to process element: input '{name}' of type {type_name}: a value is out of "
                                  f"its range [{info.min}, {info.max}]")
    with np.errstate(over="ignore"):  # 1e300 for a float input is inf, as in TF Serving
        return source.astype(target)


def _unsigned_64(value: Any, source: np.ndarray) -> np.ndarray:
    """Integers beyond int64 (up to 2**64 - 1), which numpy reads as float64 (rounded) or objects: as uint64, exactly,
    when every value is a non-negative integer."""
    leaves = np.array(value, dtype=object).ravel()
    if all(type(leaf) is int and 0 <= leaf < 2**64 for leaf in leaves):
        return np.array(value, dtype=np.uint64)
    return source


def _bytes_leaves(value: Any) -> Any:
    if isinstance(value, list):
        return [_bytes_leaves(item) for item in value]
    if _is_b64(value):
        try:
            return base64.b64decode(value["b64"], validate=True)
        except (ValueError, TypeError):
            raise InvalidArgument(f"Unable to base64 decode: {_excerpt(value)}") from None
    if isinstance(value, str):
        return value.encode()
    raise InvalidArgument(f"JSON Value: {_excerpt(value)} not formatted correctly; expected a string or "
                          '{"b64": "..."} for a DT_STRING input')


def _is_b64(value: Any) -> bool:
    return isinstance(value, dict) and list(value) == ["b64"] and isinstance(value["b64"], str)


def _json_value(array: np.ndarray, name: str) -> Any:
    """An output as nested lists; bytes outputs named *_bytes (or not UTF-8) as {"b64": ...}."""
    if array.dtype.kind in "OSU":
        def text(item: Any) -> Any:
            if isinstance(item, list):
                return [text(i) for i in item]
            if isinstance(item, str):
                return item
            if not name.endswith("_bytes"):
                try:
                    return item.decode("utf-8")
                except UnicodeDecodeError:
                    pass
            return {"b64": base64.b64encode(item).decode()}
        return text(array.tolist())
    if array.dtype in (np.float16, _BFLOAT16):
        array = array.astype(np.float32)  # TF Serving refuses these; here they are plain numbers
    return array.tolist()


def predictions_json(outputs: dict[str, np.ndarray]) -> Any:
    """Row format: one value per row for a single output, else one {name: value} object per row."""
    if len(outputs) == 1:
        (name, array), = outputs.items()
        return {"predictions": _json_value(array, name)}
    sizes = {name: array.shape[0] if array.ndim else None for name, array in outputs.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise InvalidArgument(f"Tensors have inconsistent batch sizes for row format: {sizes}; "
                              "use the columnar format ('inputs') instead")
    columns = {name: _json_value(array, name) for name, array in outputs.items()}
    rows = next(iter(sizes.values()))
    return {"predictions": [{name: column[i] for name, column in columns.items()} for i in range(rows)]}


def outputs_json(outputs: dict[str, np.ndarray]) -> Any:
    if len(outputs) == 1:
        (name, array), = outputs.items()
        return {"outputs": _json_value(array, name)}
    return {"outputs": {name: _json_value(array, name) for name, array in outputs.items()}}


def fill_examples(body: dict, input: Any) -> None:
    """"examples" (and an optional "context") as tf.Examples: ints int64_list, numbers float_list, text bytes_list."""
    examples = body.get("examples")
    if not isinstance(examples, list):
        raise InvalidArgument("'examples' key is missing or is not an array of objects")
    if "context" in body:
        input.example_list_with_context.context.CopyFrom(_example(body["context"]))
        target = input.example_list_with_context.examples
    else:
        target = input.example_list.examples
    for example in examples:
        target.add().CopyFrom(_example(example))


def _example(features: Any) -> example_pb2.Example:
    if not isinstance(features, dict):
        raise InvalidArgument(f"Example must be JSON object but got JSON {_excerpt(features)}")
    example = example_pb2.Example()
    for name, value in features.items():
        values = value if isinstance(value, list) else [value]
        feature = example.features.feature[text(name, "feature name")]
        try:
            if all(isinstance(v, bool) or isinstance(v, int) for v in values) and values:
                feature.int64_list.value.extend(int(v) for v in values)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and values:
                feature.float_list.value.extend(float(v) for v in values)
            elif all(isinstance(v, str) or _is_b64(v) for v in values):
                feature.bytes_list.value.extend(_bytes_leaves(v) for v in values)
            else:
                raise InvalidArgument(f"feature '{name}': values must all be numbers or all strings, got "
                                      f"{_excerpt(value)}")
        except (ValueError, OverflowError) as error:  # an int beyond int64, a text with a lone surrogate
            raise InvalidArgument(f"feature '{name}': {_first_line(error)}; got {_excerpt(value)}") from None
    return example


def short(text: str) -> str:
    """text cut to 80 characters, for messages that echo what a client sent."""
    return text if len(text) <= 80 else text[:77] + "..."


def _excerpt(value: Any) -> str:
    """A value as JSON, cut to 80 characters (for a value json cannot write: its type)."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return short(text)
