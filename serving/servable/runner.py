"""The one inference path: load a SavedModel version, check a call against a signature once, run it.

The gRPC and REST servers, warmup and in-process callers (the pipeline's predict, the bench) all run
models through Runner, so a request is validated and computed the same way whichever door it comes
through. A call is checked once (serving/servable/signature.py: input names, dtypes, shapes, output
names) into a ModelCall, which run() and the batcher trust. A float64 array sent to a float32 input
is an error, not a silent cast, so a client learns about the mismatch instead of getting numbers
computed from something it did not send.

Two backends, chosen by the SavedModel's format, as TF Serving would run each:
  TF2 (an object graph: our exports, tf.saved_model.save): the signatures' concrete functions.
  TF1 (no object graph: SavedModelBuilder exports): the graph in its own tf.Graph and Session, fed
      and fetched by the SignatureDef's tensor names the way TF Serving's C++ Session::Run is. There
      is no shape check (TF Serving has none; the graph's ops decide), the graph's own tensors decide
      the dtypes (some SignatureDefs misstate them), and state such as variables lives as long as the
      Runner. tf.saved_model.load cannot load every TF1 model (ref variables, SignatureDefs that
      misstate shapes), which is why these do not go through it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2

from serving.errors import (InputError, LoadError, PolicyMismatch, RunnerClosed, RunnerError, SavedModelNotFound,  # noqa: F401 - re-exported
                            SignatureNotFound, op_error_text, short)
from serving.servable import saved_model, tensors
from serving.servable.example_parsing import EXAMPLES_INPUT, read_spec, takes_examples
from serving.servable.float16_cpu import unfuse_float16_on_cpu
from serving.servable.saved_model import DEFAULT_SIGNATURE, SERVING_TAG
from serving.servable.signature import ModelCall, Signature

log = logging.getLogger(__name__)

__all__ = ["Runner", "ModelCall", "Signature", "RunnerError", "InputError", "SignatureNotFound", "LoadError",
           "SavedModelNotFound", "PolicyMismatch", "RunnerClosed", "DEFAULT_SIGNATURE", "SERVING_TAG"]


class Runner:
    """One loaded model version: its signatures, its pipeline metadata, and call() to check then run() to compute."""

    def __init__(self, *, path: Path, model_name: str, model: "_FunctionModel | _SessionModel",
                 signature_defs: dict[str, meta_graph_pb2.SignatureDef], metadata: dict[str, Any] | None,
                 weights: dict[str, int] | None = None):
        self.path = path
        self.version = saved_model.parse_version(path.name)
        self.model_name = model_name
        self.metadata = metadata
        self.policy = saved_model.serving_policy(metadata).get("name", "unknown")  # what the graph computes in
        self.weights = weights or {}  # bytes of the stored variables by dtype (saved_model.weights_by_dtype)
        self.signature_defs = signature_defs  # every SignatureDef of the MetaGraph, as GetModelMetadata reports them
        self.signatures = model.signatures  # the runnable ones, by name
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
            PolicyMismatch: pipeline.json's compute dtype disagrees with the graph's MatMul/Conv ops, or its
                variable dtype with the stored weights.
            LoadError: anything else that stops the version from loading, in one line.
        """
        path = saved_model.version_path(Path(path))
        try:
            meta_graph = saved_model.serving_meta_graph(path)
            metadata = saved_model.read_pipeline_json(path)
            saved_model.load_op_libraries(metadata, path)  # before the graph: its ops must be registered
            weights = saved_model.weights_by_dtype(path)
            model = (_SessionModel if saved_model.is_tf1(meta_graph) else _FunctionModel)(path, meta_graph)
        except RunnerError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever TF raises, the caller gets one line
            raise LoadError(f"{path}: {_first_line(error)}") from error
        policy = saved_model.serving_policy(metadata)
        problem = saved_model.policy_problem(policy, model.compute_ops) or saved_model.weights_problem(policy, weights)
        if problem:
            model.close()
            raise PolicyMismatch(f"{path}: {problem}; refusing to load it")
        if model.compute_ops.get("float16"):  # before its first call (warmup): serving/servable/float16_cpu.py
            unfuse_float16_on_cpu(f"model {model_name or path.name}")
        name = model_name or (metadata or {}).get("model_name") or _default_model_name(path)
        runner = cls(path=path, model_name=name, model=model, signature_defs=saved_model.copy_signature_defs(meta_graph),
                     metadata=metadata, weights=weights)
        log.info("%s", runner.describe())
        return runner

    @property
    def signature_names(self) -> list[str]:
        """Signatures that run() can run (a TF2 model's init op is listed in signature_defs only)."""
        return sorted(self.signatures)

    def signature(self, name: str) -> Signature:
        """The signature of that name ("" means serving_default); SignatureNotFound lists the available ones."""
        found = self.signatures.get(name or DEFAULT_SIGNATURE)
        if found is None:
            raise SignatureNotFound(f'Serving signature key "{short(name or DEFAULT_SIGNATURE)}" not found. '
                                    f"Model {self.model_name} has: {', '.join(self.signature_names) or 'none'}")
        return found

    def call(self, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
             output_filter: Sequence[str] = ()) -> ModelCall:
        """Checks numpy inputs against a signature: names, then dtypes, then shapes, then output names.

        Args:
            inputs: one array per signature input, with exactly the model's dtype (strings: bytes or
                str arrays, e.g. serialized tf.Examples as np.array([b"...", ...], dtype=object)).
            signature_name: which signature to run; "" means serving_default.
            output_filter: output names to return; empty returns all of them.

        Raises:
            SignatureNotFound: the model has no such signature.
            InputError: missing or unknown input, wrong dtype, a shape the signature cannot take (TF2
                models), an unknown or repeated output name.
        """
        signature = self.signature(signature_name)
        signature.check_input_names(inputs)
        arrays = {name: _as_array(value) for name, value in inputs.items()}
        signature.check_input_dtypes({name: tensors.datatype(array) for name, array in arrays.items()})
        signature.check_shapes(arrays)
        return ModelCall(signature, arrays, signature.check_output_filter(output_filter))

    def run(self, call: ModelCall) -> dict[str, np.ndarray]:
        """Runs a checked call; returns the outputs it asked for, in the model's own dtypes.

        Safe to call from many threads at once. A TF1 model's state (variables) is shared by all calls.

        Raises:
            InputError: the model's ops rejected the values (TF's INVALID_ARGUMENT, e.g. incompatible
                shapes in a MatMul), which TF Serving passes through.
            RunnerClosed: close() was called.
        """
        with self._running(call.signature.name):
            return self._model.call(call)

    @contextlib.contextmanager
    def _running(self, signature_name: str) -> Iterator[None]:
        """Counts a run in flight, so that close() can wait for it; the model's INVALID_ARGUMENT is an InputError."""
        with self._idle:
            if self._closed:
                raise RunnerClosed(f"model {self.model_name} version {self.version} has been unloaded")
            self._in_flight += 1
        try:
            yield
        except tf.errors.InvalidArgumentError as error:  # TF Serving passes this status through
            raise InputError(f"signature '{signature_name}': {_first_line(error)}") from error
        finally:
            with self._idle:
                self._in_flight -= 1
                if self._closed:  # only close() waits for the count
                    self._idle.notify_all()

    def run_with_state(self, signature_name: str, inputs: Mapping[str, Any], state: Mapping[str, Any],
                       state_outputs: Sequence[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """One call of a signature that carries state between calls (a language model's key/value cache in
        serving/generation/decoder.py): inputs are checked as call() checks them; state, tensors an earlier call
        of this runner returned, goes in unchecked; the outputs named in state_outputs come back as the backend
        holds them (a TF2 model's tensors), the others as numpy. The cache is then not copied into numpy and back
        at every step (measured: 1.6 of 2.9 ms per decode step of bench figure 12's model).

        Raises:
            as call() and run().
        """
        signature = self.signature(signature_name)
        signature.check_input_names([*inputs, *state])
        arrays = {name: _as_array(value) for name, value in inputs.items()}
        signature.check_input_dtypes({name: tensors.datatype(array) for name, array in arrays.items()})
        signature.check_shapes(arrays)
        call = ModelCall(signature, arrays, signature.check_output_filter(()))
        with self._running(signature.name):
            return self._model.call_with_state(call, state, frozenset(state_outputs))

    def predict(self, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
                output_filter: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """run(call(...)): numpy inputs in, the signature's outputs out (the in-process API)."""
        return self.run(self.call(inputs, signature_name, output_filter))

    def close(self) -> None:
        """Unloads this version: refuses new run() calls, waits for running ones, then closes a
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
        if policy and policy.get("requested") == "auto" and policy.get("reason"):
            text += f" (export.serving_policy auto: {policy['reason']})"  # measured rates, where auto timed them
        text += f", MatMul/Conv ops {ops}, weights {saved_model.describe_bytes(self.weights)}, {self._model.kind}"
        if shown:
            sig = self.signature_defs[shown]
            text += f"; {shown}: {_describe_tensors(sig.inputs)} -> {_describe_tensors(sig.outputs)}"
        others = [name for name in names if name != shown]
        if others:
            text += f" (+ signatures {', '.join(others)})"
        return text


class _FunctionModel:
    """A TF2 SavedModel, run through its signatures' concrete functions."""

    kind = "TF2 SavedModel (signature functions)"

    def __init__(self, path: Path, meta_graph: meta_graph_pb2.MetaGraphDef):
        self._loaded = tf.saved_model.load(str(path))  # the signatures' variables live as long as this
        self.signatures = {
            name: Signature.read(name, definition, {key: info.dtype for key, info in definition.inputs.items()},
                                 checks_shapes=True,
                                 examples=read_spec(self._loaded.signatures[name].graph.as_graph_def())
                                 if takes_examples(definition) else None)
            for name, definition in meta_graph.signature_def.items() if name in self._loaded.signatures}
        self.compute_ops = {}
        if DEFAULT_SIGNATURE in self._loaded.signatures:
            self.compute_ops = saved_model.count_compute_ops(self._loaded.signatures[DEFAULT_SIGNATURE])

    def call(self, call: ModelCall) -> dict[str, np.ndarray]:
        function = self._loaded.signatures[call.signature.name]
        outputs = function(**{name: tf.convert_to_tensor(array) for name, array in call.inputs.items()})
        return {name: outputs[name].numpy() for name in call.outputs}

    def call_with_state(self, call: ModelCall, state: Mapping[str, Any],
                        kept: frozenset[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        function = self._loaded.signatures[call.signature.name]
        outputs = function(**{name: tf.convert_to_tensor(array) for name, array in call.inputs.items()}, **state)
        return ({name: outputs[name].numpy() for name in call.outputs if name not in kept},
                {name: outputs[name] for name in call.outputs if name in kept})

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
        self.signatures = {
            name: Signature.read(name, definition,
                                 {key: self._tensor_dtype(info) for key, info in definition.inputs.items()},
                                 checks_shapes=False,
                                 examples=read_spec(meta_graph.graph_def, definition.inputs[EXAMPLES_INPUT].name)
                                 if takes_examples(definition) else None)
            for name, definition in meta_graph.signature_def.items()}
        self.compute_ops = saved_model.count_ops(meta_graph.graph_def)
        self._callables: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}
        self._callables_lock = threading.Lock()

    def call(self, call: ModelCall) -> dict[str, np.ndarray]:
        definition = call.signature.definition
        feeds = sorted(call.inputs)
        fetches = tuple(dict.fromkeys(definition.outputs[name].name for name in call.outputs))  # unique, in order
        run = self._callable(tuple(definition.inputs[name].name for name in feeds), fetches)
        values = dict(zip(fetches, run(*(call.inputs[name] for name in feeds))))
        return {name: np.asarray(values[definition.outputs[name].name]) for name in call.outputs}

    def call_with_state(self, call: ModelCall, state: Mapping[str, Any],
                        kept: frozenset[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        outputs = self.call(ModelCall(call.signature, {**call.inputs, **{k: np.asarray(v) for k, v in state.items()}},
                                      call.outputs))
        return ({name: value for name, value in outputs.items() if name not in kept},
                {name: value for name, value in outputs.items() if name in kept})

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
    """An exception's message in one line (serving/errors.py op_error_text), or its type name if it has none."""
    message = error.message if isinstance(error, tf.errors.OpError) else str(error)
    return op_error_text(message, type(error).__name__)


def _as_array(value: Any) -> np.ndarray:
    """value as a numpy array; a list of bytes becomes an object array, because a fixed-width bytes
    array ("S") drops trailing NUL bytes, which a serialized tf.Example may end with."""
    array = np.asarray(value)
    if array.dtype.kind == "S" and not isinstance(value, np.ndarray):
        array = np.asarray(value, dtype=object)
    return array


def _describe_tensors(infos: Mapping[str, Any]) -> str:
    """'features (float32 [-1, 64]), mask (bool [-1])': what a signature takes or returns."""
    def shape(info: Any) -> str:
        return "any shape" if info.tensor_shape.unknown_rank else str([dim.size for dim in info.tensor_shape.dim])

    return ", ".join(f"{name} ({tf.as_dtype(info.dtype).name} {shape(info)})"
                     for name, info in sorted(infos.items())) or "nothing"
