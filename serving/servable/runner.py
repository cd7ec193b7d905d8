"""The one inference path: load a SavedModel version, check a request against a signature, run it.

The gRPC server and local predict both call Runner, so a request is validated and computed the same
way whichever door it comes through. Input names and dtypes are checked before the model runs: a
float64 array sent to a float32 input is an error, not a silent cast, so a client learns about the
mismatch instead of getting numbers computed from something it did not send. The checks are public
(check_input_names, check_input_dtypes, check_output_filter) so that a server can run them on a
request before it decodes its tensors; their messages are TF Serving's (cited at each).

Two backends, chosen by the SavedModel's format, as TF Serving would run each:
  TF2 (an object graph: our exports, tf.saved_model.save): the signatures' concrete functions, which
      also check each input's shape against the signature.
  TF1 (no object graph: SavedModelBuilder exports): the graph in its own tf.Graph and Session, fed
      and fetched by the SignatureDef's tensor names the way TF Serving's C++ Session::Run is. There
      is no shape check (TF Serving has none; the graph's ops decide), the graph's own tensors decide
      the dtypes (some SignatureDefs misstate them), and state such as variables lives as long as the
      Runner. tf.saved_model.load cannot load every TF1 model (ref variables, SignatureDefs that
      misstate shapes), which is why these do not go through it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2

from serving.servable import saved_model
from serving.errors import (InputError, LoadError, PolicyMismatch, RunnerClosed, RunnerError, SavedModelNotFound,  # noqa: F401 - re-exported
                            SignatureNotFound)
from serving.servable.saved_model import DEFAULT_SIGNATURE, SERVING_TAG
from serving.servable.tensors import type_string

log = logging.getLogger(__name__)

__all__ = ["Runner", "RunnerError", "InputError", "SignatureNotFound", "LoadError", "SavedModelNotFound",
           "PolicyMismatch", "RunnerClosed", "DEFAULT_SIGNATURE", "SERVING_TAG"]


class Runner:
    """One loaded model version: its signatures, its pipeline metadata, and predict()."""

    def __init__(self, *, path: Path, model_name: str, model: "_FunctionModel | _SessionModel",
                 signature_defs: dict[str, meta_graph_pb2.SignatureDef], metadata: dict[str, Any] | None):
        self.path = path
        self.version = saved_model.parse_version(path.name)
        self.model_name = model_name
        self.metadata = metadata
        self.policy = saved_model.serving_policy(metadata).get("name", "unknown")  # what the graph computes in
        self.signature_defs = signature_defs
        self.compute_ops = model.compute_ops
        self._model = model
        self._idle = threading.Condition()  # guards _in_flight and _closed
        self._in_flight = 0
        self._closed = False

    @classmethod
    def load(cls, path: str | os.PathLike, *, model_name: str | None = None) -> "Runner":
        """Loads a version directory, or the latest numeric version under a model base path.

        Args:
            path: `<base>/<model_name>/<version>` or `<base>/<model_name>`.
            model_name: the name to report; defaults to pipeline.json's, then the directory name.

        Raises:
            SavedModelNotFound: no SavedModel at path and no numeric version under it (a FileNotFoundError too).
            PolicyMismatch: pipeline.json's compute dtype disagrees with the graph's MatMul/Conv ops.
            LoadError: anything else that stops the version from loading, in one line.
        """
        path = saved_model.version_path(Path(path))
        try:
            meta_graph = saved_model.serving_meta_graph(path)
            metadata = saved_model.read_pipeline_json(path)
            model = (_SessionModel if saved_model.is_tf1(meta_graph) else _FunctionModel)(path, meta_graph)
        except RunnerError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever TF raises, the caller gets one line
            raise LoadError(f"{path}: {_first_line(error)}") from error
        problem = saved_model.policy_problem(saved_model.serving_policy(metadata), model.compute_ops)
        if problem:
            model.close()
            raise PolicyMismatch(f"{path}: {problem}; refusing to load it")
        name = model_name or (metadata or {}).get("model_name") or _default_model_name(path)
        runner = cls(path=path, model_name=name, model=model, signature_defs=saved_model.copy_signature_defs(meta_graph),
                     metadata=metadata)
        log.info("%s", runner.describe())
        return runner

    @property
    def signature_names(self) -> list[str]:
        """Signatures that predict() can run (a TF2 model's init op is listed in signature_defs only)."""
        return self._model.signature_names

    def predict(self, inputs: Mapping[str, np.ndarray], signature_name: str = DEFAULT_SIGNATURE,
                output_filter: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Runs one signature on numpy inputs and returns its outputs in the model's own dtypes.

        Safe to call from many threads at once. A TF1 model's state (variables) is shared by all calls.

        Args:
            inputs: one array per signature input, with exactly the model's dtype (strings: bytes or
                str arrays, e.g. serialized tf.Examples as np.array([b"...", ...], dtype=object)).
            signature_name: which signature to run; "" means serving_default.
            output_filter: output names to return; empty returns all of them.

        Raises:
            SignatureNotFound: the model has no such signature.
            InputError: missing or unknown input, wrong dtype, a shape the signature cannot take (TF2
                models), an unknown output name, or the model's ops rejecting the values (TF1 and TF2).
            RunnerClosed: close() was called.
        """
        signature_name = signature_name or DEFAULT_SIGNATURE
        signature = self.signature(signature_name)
        arrays = self._check_inputs(signature_name, signature, inputs)
        wanted = self.check_output_filter(signature_name, output_filter)
        with self._idle:  # counts a predict() in flight, so that close() can wait for it
            if self._closed:
                raise RunnerClosed(f"model {self.model_name} version {self.version} has been unloaded")
            self._in_flight += 1
        try:
            return self._model.call(signature_name, signature, arrays, wanted)
        except tf.errors.InvalidArgumentError as error:  # TF Serving passes this status through
            raise InputError(f"signature '{signature_name}': {_first_line(error)}") from error
        finally:
            with self._idle:
                self._in_flight -= 1
                if self._closed:  # only close() waits for the count
                    self._idle.notify_all()

    def close(self) -> None:
        """Unloads this version: refuses new predict() calls, waits for running ones, then closes a
        TF1 model's Session (a TF2 model has nothing to close). Calling it again does nothing."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._in_flight == 0)
        self._model.close()

    def describe(self) -> str:
        """One line for the log: model, version, policy and the serving signature's inputs and outputs."""
        policy = saved_model.serving_policy(self.metadata)
        dtypes = f" (compute {policy.get('compute_dtype')}, variables {policy.get('variable_dtype')})" if policy else ""
        ops = saved_model.describe_ops(self.compute_ops)
        names = self.signature_names
        shown = DEFAULT_SIGNATURE if DEFAULT_SIGNATURE in names else (names[0] if names else None)
        text = f"loaded model {self.model_name} version {self.version} from {self.path}: policy {self.policy}{dtypes}"
        text += f", MatMul/Conv ops {ops}, {self._model.kind}"
        if shown:
            sig = self.signature_defs[shown]
            text += f"; {shown}: {_describe_tensors(sig.inputs)} -> {_describe_tensors(sig.outputs)}"
        others = [name for name in names if name != shown]
        if others:
            text += f" (+ signatures {', '.join(others)})"
        return text

    def signature(self, name: str) -> meta_graph_pb2.SignatureDef:
        """The SignatureDef predict() would run; SignatureNotFound lists the available ones."""
        if name not in self.signature_names:
            raise SignatureNotFound(f'Serving signature key "{name}" not found. '
                                    f"Model {self.model_name} has: {', '.join(self.signature_names) or 'none'}")
        return self.signature_defs[name]

    def check_input_names(self, signature_name: str, names: Collection[str], *, with_defaults: bool = False) -> None:
        """Raises InputError unless names are the signature's inputs, in TF Serving's words.

        with_defaults: inputs the SignatureDef has `defaults` for may be left out (Predict requests).
        The three checks, in TF Serving's order: predict_util.cc VerifyRequestInputsSize ("Sent
        extra: {...}. Missing but required: {...}."), then tensorflow/cc/saved_model/util.cc
        GetInputValues (an input neither sent nor defaulted; a name the signature lacks).
        """
        signature = self.signature(signature_name)
        sent, expected = set(names), set(signature.inputs)
        defaults = set(signature.defaults) if with_defaults else set()
        if len(sent) > len(expected) or (len(sent) < len(expected) and not defaults):
            raise InputError(f"input size does not match signature: {len(sent)}!={len(expected)} "
                             f"len({_set(sent)}) != len({_set(expected)}). Sent extra: {_set(sent - expected)}. "
                             f"Missing but required: {_set(expected - sent)}.")
        missing = sorted(expected - sent - defaults)
        if missing:
            raise InputError(f"Signature input alias: {missing[0]}(feed name: {signature.inputs[missing[0]].name}) not "
                             f"found in request and no default value provided. Inputs expected to be in the request "
                             f"{_set(sent)}, or default input alias set: {','.join(sorted(defaults))}")
        if not sent <= expected:
            raise InputError(f"Inputs contains invalid name. Used request inputs: {','.join(sorted(sent & expected))}, "
                             f"request input: {','.join(sorted(sent))}")

    def check_input_dtypes(self, signature_name: str, dtypes: Mapping[str, int | str]) -> None:
        """Raises InputError if an input's dtype (a DataType value, or "object") is not the model's.

        The model's dtype is its graph's (a TF1 SignatureDef may misstate it). The wording is TF's
        executor's, which TF Serving passes through (predict_util_test.cc PredictionInvalidTensor:
        "Expects arg[0] to be float but bool is provided"); arg[i] counts the signature's inputs in
        name order, and the input's name follows.
        """
        for index, name in enumerate(sorted(self.signature(signature_name).inputs)):
            if name not in dtypes:
                continue
            expected, got = self._model.input_dtype(signature_name, name), dtypes[name]
            if got != expected:
                raise InputError(f"Expects arg[{index}] to be {_type_string(expected)} but {_type_string(got)} "
                                 f"is provided (input '{name}')")

    def check_output_filter(self, signature_name: str, output_filter: Sequence[str]) -> list[str]:
        """The output names to return, in the order asked for; all of them when the filter is empty.

        Raises:
            InputError: an unknown or repeated name, in predict_util.cc PreProcessPrediction's words.
        """
        signature = self.signature(signature_name)
        if not output_filter:
            return sorted(signature.outputs)
        seen: set[str] = set()
        for name in output_filter:
            if name not in signature.outputs:
                raise InputError(f"output tensor alias not found in signature: {name} Outputs expected to be in "
                                 f"the set {_set(signature.outputs)}.")
            if name in seen:
                raise InputError(f"duplicate output tensor alias: {name}")
            seen.add(name)
        return list(output_filter)

    def _check_inputs(self, signature_name: str, signature: meta_graph_pb2.SignatureDef,
                      inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Checks names, then dtype (and, for TF2 models, shape) of each input; returns numpy arrays."""
        self.check_input_names(signature_name, inputs)
        arrays = {name: _as_array(value) for name, value in inputs.items()}
        self.check_input_dtypes(signature_name, {name: _dtype_of(array) for name, array in arrays.items()})
        for name, array in arrays.items():
            info = signature.inputs[name]
            if self._model.checks_shapes and not _shape_fits(array.shape, info.tensor_shape):
                raise InputError(f"input '{name}': expected shape {_shape_text(info.tensor_shape)}, "
                                 f"got {list(array.shape)}")
        return arrays


class _FunctionModel:
    """A TF2 SavedModel, run through its signatures' concrete functions."""

    kind = "TF2 SavedModel (signature functions)"
    checks_shapes = True  # the concrete functions refuse other shapes anyway, with a worse message

    def __init__(self, path: Path, meta_graph: meta_graph_pb2.MetaGraphDef):
        self._loaded = tf.saved_model.load(str(path))  # the signatures' variables live as long as this
        self.signature_names = sorted(name for name in meta_graph.signature_def if name in self._loaded.signatures)
        self.compute_ops = {}
        if DEFAULT_SIGNATURE in self._loaded.signatures:
            self.compute_ops = saved_model.count_compute_ops(self._loaded.signatures[DEFAULT_SIGNATURE])
        self._input_dtypes = {name: {key: info.dtype for key, info in signature.inputs.items()}
                              for name, signature in meta_graph.signature_def.items()}

    def input_dtype(self, signature_name: str, input_name: str) -> int:
        return self._input_dtypes[signature_name][input_name]

    def call(self, signature_name: str, signature: meta_graph_pb2.SignatureDef,
             arrays: Mapping[str, np.ndarray], wanted: Sequence[str]) -> dict[str, np.ndarray]:
        function = self._loaded.signatures[signature_name]
        outputs = function(**{name: tf.convert_to_tensor(array) for name, array in arrays.items()})
        return {name: outputs[name].numpy() for name in wanted}

    def close(self) -> None:
        pass


class _SessionModel:
    """A TF1 SavedModel in its own Graph and Session, fed and fetched by tensor name like TF Serving.

    Runs go through Session callables (C++ Session::MakeCallable/RunCallable): unlike Session.run,
    they do not compare a fed array's shape with the placeholder's static shape, so a [1] or []
    input reaches a (-1, 1) placeholder as it does in TF Serving. Callables are thread-safe; one is
    made per (feeds, fetches) combination and kept.
    """

    kind = "TF1 SavedModel (Session)"
    checks_shapes = False

    def __init__(self, path: Path, meta_graph: meta_graph_pb2.MetaGraphDef):
        self._graph = tf.Graph()
        self._session = tf.compat.v1.Session(graph=self._graph,
                                             config=tf.compat.v1.ConfigProto(allow_soft_placement=True))
        try:
            with self._graph.as_default():
                tf.compat.v1.saved_model.loader.load(self._session, [SERVING_TAG], str(path))
        except Exception:
            self._session.close()
            raise
        self._graph.finalize()  # serving never adds ops; this makes sure of it
        self.signature_names = sorted(meta_graph.signature_def)
        self.compute_ops = saved_model.count_ops(meta_graph.graph_def)
        self._input_dtypes = {name: {key: self._tensor_dtype(info) for key, info in signature.inputs.items()}
                              for name, signature in meta_graph.signature_def.items()}
        self._callables: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}
        self._callables_lock = threading.Lock()

    def input_dtype(self, signature_name: str, input_name: str) -> int:
        return self._input_dtypes[signature_name][input_name]

    def call(self, signature_name: str, signature: meta_graph_pb2.SignatureDef,
             arrays: Mapping[str, np.ndarray], wanted: Sequence[str]) -> dict[str, np.ndarray]:
        feeds = sorted(arrays)
        fetches = tuple(dict.fromkeys(signature.outputs[name].name for name in wanted))  # unique, in order
        run = self._callable(tuple(signature.inputs[name].name for name in feeds), fetches)
        values = dict(zip(fetches, run(*(arrays[name] for name in feeds))))
        return {name: np.asarray(values[signature.outputs[name].name]) for name in wanted}

    def close(self) -> None:
        self._callables.clear()  # release the callables while the session is still open
        self._session.close()

    def _callable(self, feeds: tuple[str, ...], fetches: tuple[str, ...]) -> Any:
        with self._callables_lock:
            key = (feeds, fetches)
            if key not in self._callables:
                options = config_pb2.CallableOptions(feed=feeds, fetch=fetches)
                # Session.make_callable(feed_list=...) routes through Session.run and its Python-side
                # shape check; this is the C++ callable it wraps when there are no feeds.
                self._callables[key] = self._session._make_callable_from_options(options)  # noqa: SLF001
            return self._callables[key]

    def _tensor_dtype(self, info: meta_graph_pb2.TensorInfo) -> int:
        """The graph's dtype for a SignatureDef tensor (it may differ from the SignatureDef's own)."""
        try:
            return self._graph.get_tensor_by_name(info.name).dtype.base_dtype.as_datatype_enum
        except (KeyError, ValueError):
            return info.dtype


def _default_model_name(version_path: Path) -> str:
    return version_path.parent.name if saved_model.parse_version(version_path.name) is not None else version_path.name


def _first_line(error: Exception) -> str:
    """An exception's first line (TF appends node traces), or its type name if it has no message."""
    message = error.message if isinstance(error, tf.errors.OpError) else str(error)
    lines = (message or "").strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _as_array(value: Any) -> np.ndarray:
    """value as a numpy array; a list of bytes becomes an object array, because a fixed-width bytes
    array ("S") drops trailing NUL bytes, which a serialized tf.Example may end with."""
    array = np.asarray(value)
    if array.dtype.kind == "S" and not isinstance(value, np.ndarray):
        array = np.asarray(value, dtype=object)
    return array


def _dtype_of(array: np.ndarray) -> int | str:
    """The DataType value TF would feed an array as; "object" for an object array that is not all text."""
    if array.dtype.kind == "O" and not all(isinstance(item, (bytes, str)) for item in array.flat):
        return "object"
    if array.dtype.kind in "OSU":
        return types_pb2.DT_STRING
    return _numeric_dtype(array.dtype)


@functools.lru_cache(maxsize=None)
def _numeric_dtype(dtype: np.dtype) -> int | str:
    """TF's DataType value for a numpy dtype (cached: tf.as_dtype costs microseconds on every request)."""
    try:
        return tf.as_dtype(dtype).as_datatype_enum
    except TypeError:
        return str(dtype)


def _type_string(dtype: int | str) -> str:
    """TF's DataTypeString ("float", "string", "half", ...) for a DataType value; other names as they are."""
    return dtype if isinstance(dtype, str) else type_string(dtype)


def _set(names: Collection[str]) -> str:
    """A set of names as TF Serving prints one: {a,b}."""
    return "{" + ",".join(sorted(names)) + "}"


def _shape_fits(shape: tuple[int, ...], expected: Any) -> bool:
    """Rank and fixed dims must match; -1 dims and an unknown rank accept anything."""
    if expected.unknown_rank:
        return True
    dims = [dim.size for dim in expected.dim]
    return len(shape) == len(dims) and all(want < 0 or want == got for want, got in zip(dims, shape))


def _shape_text(shape: Any) -> str:
    return "any shape" if shape.unknown_rank else str([dim.size for dim in shape.dim])


def _describe_tensors(infos: Mapping[str, Any]) -> str:
    """'features (float32 [-1, 64]), mask (bool [-1])': what a signature takes or returns."""
    return ", ".join(f"{name} ({tf.as_dtype(info.dtype).name} {_shape_text(info.tensor_shape)})"
                     for name, info in sorted(infos.items())) or "nothing"
