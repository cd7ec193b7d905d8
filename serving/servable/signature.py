"""A signature's rules, read once when a version loads, and the checked call that the runner trusts.

`Signature` holds what a request is checked against as plain Python (reading the SignatureDef proto
costs microseconds a field, on every request): input names, dtypes and dims, output names, defaults,
and whether every input has a batch dimension. Its checks are the one rule set for every way into a
model: a Predict request's TensorProtos (serving/servable/inference.py checks names and dtypes before
it decodes anything), numpy arrays from in-process callers (Runner.call), and the batcher, which only
ever sees `ModelCall`s made by these checks. Messages are TF Serving's, cited at each.

The dtypes are the graph's: a TF1 SignatureDef may misstate them, and TF Serving feeds by tensor name,
so what the graph takes is what a request must send. TF1 signatures are not shape-checked (TF Serving
has no such check; the graph's ops decide); TF2 ones are, as their concrete functions would refuse
another shape anyway, with a worse message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from tensorflow.core.framework import tensor_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from serving.errors import InputError, short
from serving.servable import tensors
from serving.servable.example_parsing import ExampleSpec


class InputSpec(NamedTuple):
    dtype: int  # the graph's DataType
    dims: tuple[int, ...] | None  # -1 for a dim of any size; None: unknown rank


@dataclasses.dataclass(frozen=True)
class Signature:
    """One runnable signature of a loaded version."""

    name: str
    definition: meta_graph_pb2.SignatureDef  # as saved_model.pb has it (metadata, tensor names)
    inputs: dict[str, InputSpec]
    outputs: tuple[str, ...]  # sorted
    defaults: dict[str, tensor_pb2.TensorProto]
    checks_shapes: bool  # TF2: shapes are checked; TF1: the graph's ops decide
    batched: bool  # every input has a dim 0 of any size, so requests can be merged along it
    examples: ExampleSpec | None = None  # what its ParseExample op requires of a tf.Example, if it has one

    @classmethod
    def read(cls, name: str, definition: meta_graph_pb2.SignatureDef, input_dtypes: Mapping[str, int],
             checks_shapes: bool, examples: ExampleSpec | None = None) -> "Signature":
        """The rules of one SignatureDef; input_dtypes are the graph's, by input name; examples: the spec of the
        ParseExample op its serialized tf.Examples go through (serving/servable/example_parsing.py)."""
        inputs = {key: InputSpec(input_dtypes[key], None if info.tensor_shape.unknown_rank
                                 else tuple(dim.size for dim in info.tensor_shape.dim))
                  for key, info in definition.inputs.items()}
        batched = bool(inputs) and all(spec.dims and spec.dims[0] == -1 for spec in inputs.values())
        return cls(name, definition, inputs, tuple(sorted(definition.outputs)), dict(definition.defaults),
                   checks_shapes, batched, examples)

    @property
    def method_name(self) -> str:
        return self.definition.method_name

    def check_input_names(self, names: Collection[str], *, with_defaults: bool = False) -> None:
        """Raises InputError unless names are the signature's inputs, in TF Serving's words.

        with_defaults: inputs the SignatureDef has `defaults` for may be left out (Predict requests).
        The three checks, in TF Serving's order: predict_util.cc VerifyRequestInputsSize ("Sent
        extra: {...}. Missing but required: {...}."), then tensorflow/cc/saved_model/util.cc
        GetInputValues (an input neither sent nor defaulted; a name the signature lacks).
        """
        sent, expected = set(names), set(self.inputs)
        defaults = set(self.defaults) if with_defaults else set()
        if len(sent) > len(expected) or (len(sent) < len(expected) and not defaults):
            raise InputError(f"input size does not match signature: {len(sent)}!={len(expected)} "
                             f"len({_set(sent)}) != len({_set(expected)}). Sent extra: {_set(sent - expected)}. "
                             f"Missing but required: {_set(expected - sent)}.")
        missing = sorted(expected - sent - defaults)
        if missing:
            feed = self.definition.inputs[missing[0]].name
            raise InputError(f"Signature input alias: {missing[0]}(feed name: {feed}) not found in request and no "
                             f"default value provided. Inputs expected to be in the request {_set(sent)}, or default "
                             f"input alias set: {','.join(sorted(defaults))}")
        if not sent <= expected:
            raise InputError(f"Inputs contains invalid name. Used request inputs: {_set(sent & expected)[1:-1]}, "
                             f"request input: {_set(sent)[1:-1]}")

    def check_input_dtypes(self, dtypes: Mapping[str, int | str]) -> None:
        """Raises InputError if an input's dtype (a DataType value, or "object") is not the graph's.

        The wording is TF's executor's, which TF Serving passes through (predict_util_test.cc
        PredictionInvalidTensor: "Expects arg[0] to be float but bool is provided"); arg[i] counts the
        signature's inputs in name order, and the input's name follows.
        """
        for index, name in enumerate(sorted(self.inputs)):
            if name in dtypes and dtypes[name] != self.inputs[name].dtype:
                raise InputError(f"Expects arg[{index}] to be {_type(self.inputs[name].dtype)} but "
                                 f"{_type(dtypes[name])} is provided (input '{name}')")

    def check_output_filter(self, output_filter: Sequence[str]) -> tuple[str, ...]:
        """The output names to fetch, in the order asked for; all of them (sorted) when the filter is empty.

        Raises:
            InputError: an unknown or repeated name, in predict_util.cc PreProcessPrediction's words.
        """
        if not output_filter:
            return self.outputs
        seen: set[str] = set()
        for name in output_filter:
            if name not in self.definition.outputs:
                raise InputError(f"output tensor alias not found in signature: {short(name)} Outputs "
                                 f"expected to be in the set {_set(self.outputs)}.")
            if name in seen:
                raise InputError(f"duplicate output tensor alias: {short(name)}")
            seen.add(name)
        return tuple(output_filter)

    def check_shapes(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Raises InputError for an array whose rank or fixed dims the signature does not take (TF2 only)."""
        if not self.checks_shapes:
            return
        for name, array in arrays.items():
            dims = self.inputs[name].dims
            if not fits(array.shape, dims):
                raise InputError(f"input '{name}': expected shape {_dims_text(dims)}, got {list(array.shape)}")


class ModelCall(NamedTuple):
    """A checked call of one signature: inputs of its names, dtypes and shapes, and the outputs to fetch.

    Made only by the checks above (Runner.call, inference.prepare_*), so Runner.run and the batcher
    run it without looking again.
    """

    signature: Signature
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]


def fits(shape: Sequence[int], dims: tuple[int, ...] | None) -> bool:
    """Rank and fixed dims match (-1 dims take any size; an unknown rank takes anything)."""
    if dims is None:
        return True
    return len(shape) == len(dims) and all(want < 0 or want == got for want, got in zip(dims, shape))


def _type(dtype: int | str) -> str:
    """TF's DataTypeString ("float", "string", "half", ...) for a DataType value; other names as they are."""
    return dtype if isinstance(dtype, str) else tensors.type_string(dtype)


def _set(names: Collection[str], most: int = 16) -> str:
    """A set of names as TF Serving prints one, {a,b}; names come from clients, so each is cut short and at most
    `most` are listed."""
    shown = sorted(names)[:most]
    more = f",... ({len(names) - most} more)" if len(names) > most else ""
    return "{" + ",".join(short(name) for name in shown) + more + "}"


def _dims_text(dims: tuple[int, ...] | None) -> str:
    return "any shape" if dims is None else str(list(dims))
