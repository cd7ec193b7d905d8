"""What a signature's ParseExample op requires of a tf.Example, read from the graph, so that a Classify,
Regress or MultiInference request the op would refuse is answered before it is merged into a batch.

A merged batch that fails costs every request in it a rerun (serving/batching/scheduler.py splits it until
the request at fault is alone): with 11% malformed Classify requests among 8 busy clients, good throughput
fell to 0.60x of clean, and running each malformed request on its own instead still cost 0.63-0.71x, as a
failed model run costs about what a good one does (issue 31 #1). Answered here, from the protos the request
arrived as, the same client gets the same INVALID_ARGUMENT in the op's own words
(tests/serving/servable/test_example_parsing.py compares them) and nobody else pays for it.

The check errs one way only: whatever it lets through goes to the op, and a batch it fails is split as
before. It knows the dense features of the one ParseExample op of a signature (TensorFlow's rules,
tensorflow/core/util/example_proto_fast_parsing.cc): one without a default must be present; a present one
must hold the list its dtype needs (float_list, int64_list, bytes_list); a fixed-shape one exactly as many
values as its shape has elements. Sparse and ragged features, variable-length counts and signatures with
several parsers are left to the op. Where an example has several problems, this names the first it finds,
which may not be the one the op would name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import tensor_util

# The input of a Classify/Regress signature (tensorflow/cc/saved_model/signature_constants.h).
EXAMPLES_INPUT = "inputs"
PARSE_OPS = ("ParseExample", "ParseExampleV2")
_DTYPE_NAME = {types_pb2.DT_FLOAT: "float", types_pb2.DT_INT64: "int64", types_pb2.DT_STRING: "string"}
_DTYPE = {"float_list": "float", "int64_list": "int64", "bytes_list": "string"}  # a Feature's list -> its dtype
_VALUES = {"float_list": "float", "int64_list": "int64", "bytes_list": "bytes"}  # how the op's message names them


@dataclasses.dataclass(frozen=True)
class DenseFeature:
    dtype: str  # TensorFlow's name for it: float, int64 or string
    shape: tuple[int, ...]  # the dense shape of one example's value; a first dim of -1: variable length
    required: bool  # no default: an example without it is refused


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
    """The dense features one ParseExample op reads, with their dtypes, shapes and whether they have a default."""

    dense: Mapping[str, DenseFeature]

    def problem(self, features: Sequence[feature_pb2.Features], index: int) -> str | None:
        """Why the op would refuse example `index` made of these Features (the later ones overriding the earlier
        key by key: a context, then the example, serving/servable/examples.py), in the op's words; None if it
        would not, or if this check cannot tell (a variable-length feature's count is left to the op)."""
        where = f"Name: <unknown>, Key: {{key}}, Index: {index}.  "
        for key, dense in self.dense.items():
            feature = _effective(features, key)
            kind = feature.WhichOneof("kind") if feature is not None else None
            if kind is None:
                if dense.required:
                    return (f"Name: <unknown>, Feature: {key} (data type: {dense.dtype}) is required but could not "
                            "be found.")
                continue
            if _DTYPE[kind] != dense.dtype:
                return where.format(key=key) + (f"Data types don't match. Data type: {_DTYPE[kind]} but expected "
                                                f"type: {dense.dtype}")
            count = len(getattr(feature, kind).value)
            expected = math.prod(dense.shape)
            if dense.shape and dense.shape[0] == -1 or count == expected:
                continue
            if kind == "bytes_list" and count > expected:  # the op fills a fixed slice of strings and overflows it
                return where.format(key=key) + "Can't parse serialized Example."
            return where.format(key=key) + (f"Number of {_VALUES[kind]} values != expected.  Values size: {count} "
                                            f"but output shape: [{','.join(map(str, dense.shape))}]")
        return None

    def first_problem(self, examples: Sequence[example_pb2.Example],
                      context: example_pb2.Example | None = None) -> str | None:
        """The op's error for the first example it would refuse (each merged with the context, if any), or None."""
        base = [context.features] if context is not None else []
        for index, example in enumerate(examples):
            if problem := self.problem([*base, example.features], index):
                return problem
        return None


def takes_examples(definition: meta_graph_pb2.SignatureDef) -> bool:
    """Whether a signature has the Classify/Regress form's input: one DT_STRING 'inputs' (serialized tf.Examples)."""
    return list(definition.inputs) == [EXAMPLES_INPUT] and definition.inputs[EXAMPLES_INPUT].dtype == types_pb2.DT_STRING


def read_spec(graph_def: graph_pb2.GraphDef, serialized_input: str | None = None) -> ExampleSpec | None:
    """The spec of the one ParseExample op in a graph (and the functions in its library), or None when there is
    none, more than one, or one whose keys are not constants.

    serialized_input: for a TF1 graph that holds every signature, the signature's input tensor name: only an
    op that parses that tensor (through Identity ops) counts. None: the graph is one signature's function.
    """
    scopes = [list(graph_def.node)] + [list(function.node_def) for function in graph_def.library.function]
    found = []
    for nodes in scopes:
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if node.op in PARSE_OPS and (serialized_input is None
                                         or _source(by_name, node.input[0]) == _node_name(serialized_input)):
                found.append((node, by_name))
    if len(found) != 1:
        return None
    try:
        return _spec(*found[0])
    except (KeyError, ValueError, TypeError, IndexError):
        return None


def _spec(node: node_def_pb2.NodeDef, by_name: Mapping[str, node_def_pb2.NodeDef]) -> ExampleSpec:
    attr = node.attr
    dense_types = list(attr["Tdense"].list.type)
    shapes = [tuple(dim.size for dim in shape.dim) for shape in attr["dense_shapes"].list.shape]
    if node.op == "ParseExampleV2":  # serialized, names, sparse_keys, dense_keys, ragged_keys, dense_defaults...
        dense_keys = _strings(by_name, node.input[3])
        defaults = node.input[5:5 + len(dense_types)]
    else:  # ParseExample: serialized, names, one scalar per sparse key, per dense key, then the dense defaults
        sparse_count, dense_count = attr["Nsparse"].i, attr["Ndense"].i
        dense_keys = [_strings(by_name, name)[0] for name in node.input[2 + sparse_count:2 + sparse_count + dense_count]]
        defaults = node.input[2 + sparse_count + dense_count:2 + sparse_count + 2 * dense_count]
    if not len(dense_keys) == len(dense_types) == len(shapes) == len(defaults):
        raise ValueError("inconsistent ParseExample attributes")
    return ExampleSpec({key: DenseFeature(_DTYPE_NAME[dtype], shape, _is_empty_constant(by_name, default))
                        for key, dtype, shape, default in zip(dense_keys, dense_types, shapes, defaults)})


def _node_name(input_name: str) -> str:
    """'node:0', 'node:output:0' (inside a function) or '^node' -> 'node'."""
    return input_name.lstrip("^").split(":")[0]


def _source(by_name: Mapping[str, node_def_pb2.NodeDef], input_name: str) -> str:
    """The node an input comes from, looking through Identity ops."""
    name = _node_name(input_name)
    while name in by_name and by_name[name].op == "Identity" and by_name[name].input:
        name = _node_name(by_name[name].input[0])
    return name


def _constant(by_name: Mapping[str, node_def_pb2.NodeDef], input_name: str):
    node = by_name[_source(by_name, input_name)]
    if node.op != "Const":
        raise ValueError(f"{node.name} is not a constant")
    return tensor_util.MakeNdarray(node.attr["value"].tensor)


def _strings(by_name: Mapping[str, node_def_pb2.NodeDef], input_name: str) -> list[str]:
    return [key.decode() if isinstance(key, bytes) else str(key) for key in _constant(by_name, input_name).reshape(-1)]


def _is_empty_constant(by_name: Mapping[str, node_def_pb2.NodeDef], input_name: str) -> bool:
    """A dense default that is an empty constant means the feature is required; anything else is a default."""
    try:
        return _constant(by_name, input_name).size == 0
    except (KeyError, ValueError):
        return False


def _effective(features: Sequence[feature_pb2.Features], key: str) -> feature_pb2.Feature | None:
    for layer in reversed(features):
        if key in layer.feature:
            return layer.feature[key]
    return None
