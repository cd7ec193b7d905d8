"""TF Serving's inference RPCs over one loaded Runner: Predict, Classify, Regress, MultiInference.

Pure functions (no gRPC, no model lookup, no threads), so the server and the warmup replayer run a
request the same way. Each RPC is TF Serving's PreProcess -> Run -> PostProcess (predict_util.cc):
prepare_<rpc> checks the request and the signature as TF Serving does and returns a PreparedRequest,
its checked model calls and how their outputs become the response; the server awaits the calls
(serving/prediction_service.py), warmup runs them inline (run_inline). A response carries the resolved
model_spec: the request's model name, the runner's version, and the signature name ("" means
serving_default). Failures raise serving.errors classes, the
Runner's InputError/SignatureNotFound or TF's OpError; errors.status_for maps them to the codes of
TF Serving (files under tensorflow_serving/servables/tensorflow/):

    RPC             unknown signature     signature of the wrong form   method_name check (flag on)
    Predict         FAILED_PRECONDITION   -                             INTERNAL          predict_util.cc
    Classify        INVALID_ARGUMENT      INVALID_ARGUMENT              INVALID_ARGUMENT  classifier.cc
    Regress         INVALID_ARGUMENT      INVALID_ARGUMENT              INVALID_ARGUMENT  regressor.cc
    MultiInference  INVALID_ARGUMENT      INVALID_ARGUMENT              INVALID_ARGUMENT  multi_inference.cc
                    (a task method_name other than classify/regress: UNIMPLEMENTED)

Client strings echoed in a message (names, signature names) are cut short (errors.short).

A Predict is checked before any tensor is decoded, in TF Serving's order and words: input names
(predict_util.cc, tensorflow/cc/saved_model/util.cc), each tensor's dtype, shape and values against
what was sent (serving/servable/tensors.py), output_filter names, dtypes against the model's, and the
request's total element count (--max_request_elements, serving/limits.py). Only then are the
tensors decoded, so a request that declares more than it sends is refused without allocating for it.

enable_signature_method_name_check is off by default, as in TF Serving: Classify and Regress then
accept any signature of the right form, so native TF2 exports (whose method_name is always
tensorflow/serving/predict) can be classified and regressed. Turned on, a Classify signature must be
named tensorflow/serving/classify, a Regress one tensorflow/serving/regress, and a Predict one any of
the three.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
from google.protobuf.message import Message
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import (classification_pb2, inference_pb2, input_pb2, model_pb2, predict_pb2,
                                     regression_pb2)

from serving import limits
from serving.errors import Internal, InvalidArgument, Unimplemented, short
from serving.servable import tensors
from serving.servable.example_parsing import EXAMPLES_INPUT
from serving.servable.examples import serialized_examples
from serving.servable.runner import DEFAULT_SIGNATURE, InputError, ModelCall, Runner

PREDICT_METHOD_NAME = "tensorflow/serving/predict"
CLASSIFY_METHOD_NAME = "tensorflow/serving/classify"
REGRESS_METHOD_NAME = "tensorflow/serving/regress"
# The signature keys of TF Serving's Classify/Regress contract (tensorflow/cc/saved_model/signature_constants.h).
CLASSES_OUTPUT, SCORES_OUTPUT = "classes", "scores"
REGRESSION_OUTPUT = "outputs"

Outputs = dict[str, np.ndarray]


class PreparedRequest(NamedTuple):
    """A checked request: the model calls it needs (run in order), and how their outputs become the response.

    TF Serving's PreProcess -> Run -> PostProcess (predict_util.cc): prepare_* checks and decodes, the
    caller runs each call (the server awaits them, batched or on its worker pool; run_inline runs them
    on the calling thread), and respond builds the response from their outputs, in the same order.
    """

    model_calls: tuple[ModelCall, ...]
    respond: Callable[[list[Outputs]], Message]


def run_inline(runner: Runner, prepared: PreparedRequest) -> Message:
    """Runs a prepared request's model calls on this thread and returns its response (warmup, in-process callers)."""
    return prepared.respond([runner.run(call) for call in prepared.model_calls])


def prepare_predict(runner: Runner, request: predict_pb2.PredictRequest, *,
                    enable_signature_method_name_check: bool = False, max_request_elements: int | None = None,
                    tensor_content: bool = False) -> PreparedRequest:
    """Checks a PredictRequest against its signature, then decodes its tensors into one model call.

    Inputs left out are taken from SignatureDef.defaults, as GetInputValues does
    (tensorflow/cc/saved_model/util.cc). max_request_elements: the most elements all inputs together
    may declare (0: no limit); None takes the server's --max_request_elements. tensor_content: the
    outputs as tensor_content bytes (--enable_serialization_as_tensor_content), not typed fields.

    Raises:
        SignatureNotFound: no such signature (FAILED_PRECONDITION).
        Internal: the method-name check is on and the signature is not predict/classify/regress.
        InvalidArgument, InputError: a missing (without default) or unknown input, a malformed tensor,
            an unknown or repeated output_filter name, a wrong dtype or shape, more elements than allowed.
    """
    signature = runner.signature(request.model_spec.signature_name)
    method_names = (PREDICT_METHOD_NAME, CLASSIFY_METHOD_NAME, REGRESS_METHOD_NAME)
    if enable_signature_method_name_check and signature.method_name not in method_names:
        raise Internal(f"Expected prediction signature method_name to be one of {{{', '.join(method_names)}}}. "
                       f"Was: {signature.method_name} (signature '{signature.name}')")
    signature.check_input_names(request.inputs, with_defaults=True)
    protos = dict(request.inputs)
    for name, proto in signature.defaults.items():
        if name in signature.inputs and name not in protos:
            protos[name] = proto
    sizes = {name: tensors.check_tensor(protos[name], name) for name in sorted(protos)}
    outputs = signature.check_output_filter(request.output_filter)
    signature.check_input_dtypes({name: proto.dtype for name, proto in protos.items()})
    check_request_size(sizes, limits.max_request_elements() if max_request_elements is None else max_request_elements)
    arrays = {name: tensors.to_ndarray(proto, name, sizes[name]) for name, proto in protos.items()}
    signature.check_shapes(arrays)
    model_name = request.model_spec.name

    def respond(results: list[Outputs]) -> predict_pb2.PredictResponse:
        response = predict_pb2.PredictResponse()
        _fill_model_spec(response.model_spec, model_name, runner, signature.name)
        for name, array in results[0].items():  # ParseFromString: CopyFrom would copy value by value
            response.outputs[name].ParseFromString(tensors.serialize_tensor_proto(array, content=tensor_content))
        return response

    return PreparedRequest((ModelCall(signature, arrays, outputs),), respond)


def check_request_size(sizes: dict[str, int], limit: int) -> None:
    """InvalidArgument naming the input that takes the request over `limit` elements (0: no limit)."""
    total = 0
    for name, size in sizes.items():
        total += size
        if limit and total > limit:
            raise InvalidArgument(f"input '{short(name)}' declares {size} elements, which brings the request to "
                                  f"{total}; the server allows at most {limit} per request (--max_request_elements)")


def prepare_classify(runner: Runner, request: classification_pb2.ClassificationRequest, *,
                     enable_signature_method_name_check: bool = False) -> PreparedRequest:
    """Feeds the request's tf.Examples to a classification signature; one Classifications per example.

    Raises:
        InvalidArgument: unknown signature, a signature not of the Classify form (one input
            'inputs'; outputs 'classes' and/or 'scores'), a wrong method_name when the check is on,
            no examples, or (when the response is built) outputs of the wrong dtype or shape.
    """
    signature_name, signature = _find_signature(runner, request.model_spec.signature_name)
    _check_classification_signature(signature_name, signature, enable_signature_method_name_check)
    examples = serialized_examples(request.input)
    call = _examples_call(runner, signature_name, request.input, examples, _classification_outputs(signature))
    model_name = request.model_spec.name

    def respond(results: list[Outputs]) -> classification_pb2.ClassificationResponse:
        response = classification_pb2.ClassificationResponse()
        _fill_model_spec(response.model_spec, model_name, runner, signature_name)
        _fill_classification_result(response.result, results[0], len(examples))
        return response

    return PreparedRequest((call,), respond)


def prepare_regress(runner: Runner, request: regression_pb2.RegressionRequest, *,
                    enable_signature_method_name_check: bool = False) -> PreparedRequest:
    """Feeds the request's tf.Examples to a regression signature; one value per example.

    Raises:
        InvalidArgument: unknown signature, a signature not of the Regress form (one input 'inputs',
            one output 'outputs'), a wrong method_name when the check is on, no examples, or (when the
            response is built) an output that is not DT_FLOAT of shape [batch] or [batch, 1].
    """
    signature_name, signature = _find_signature(runner, request.model_spec.signature_name)
    _check_regression_signature(signature_name, signature, enable_signature_method_name_check)
    examples = serialized_examples(request.input)
    call = _examples_call(runner, signature_name, request.input, examples, [REGRESSION_OUTPUT])
    model_name = request.model_spec.name

    def respond(results: list[Outputs]) -> regression_pb2.RegressionResponse:
        response = regression_pb2.RegressionResponse()
        _fill_model_spec(response.model_spec, model_name, runner, signature_name)
        _fill_regression_result(response.result, results[0][REGRESSION_OUTPUT], len(examples))
        return response

    return PreparedRequest((call,), respond)


def prepare_multi_inference(runner: Runner, request: inference_pb2.MultiInferenceRequest, *,
                            enable_signature_method_name_check: bool = False) -> PreparedRequest:
    """Several Classify/Regress tasks of one model over the same examples; one result per task, in order.

    TF Serving's rules (multi_inference.cc): every task names the same model, no signature twice,
    method_name classify or regress. TF Serving feeds the examples to every task's input tensor in
    one Session::Run (util.cc PerformOneShotTensorComputation), so signatures with separate input
    placeholders (a TF2 SavedModel's) combine as well as TF1 signatures that share `tf_example:0`.
    Here each task is its own model call on the same examples: the same answers, unless the graph
    keeps state between calls.

    Raises:
        InvalidArgument: a rule above is broken, a signature is unknown or of the wrong form, or
            there are no examples.
        Unimplemented: a task's method_name is neither classify nor regress.
    """
    signatures = _check_tasks(runner, request.tasks, enable_signature_method_name_check)
    examples = serialized_examples(request.input)
    calls = tuple(_examples_call(runner, name, request.input, examples, _classification_outputs(signature)
                                 if task.method_name == CLASSIFY_METHOD_NAME else [REGRESSION_OUTPUT])
                  for task, (name, signature) in zip(request.tasks, signatures.items()))
    tasks = list(request.tasks)

    def respond(results: list[Outputs]) -> inference_pb2.MultiInferenceResponse:
        response = inference_pb2.MultiInferenceResponse()
        for task, signature_name, outputs in zip(tasks, signatures, results):
            result = response.results.add()
            if task.method_name == CLASSIFY_METHOD_NAME:
                _fill_classification_result(result.classification_result, outputs, len(examples))
            else:
                _fill_regression_result(result.regression_result, outputs[REGRESSION_OUTPUT], len(examples))
            _fill_model_spec(result.model_spec, task.model_spec.name, runner, signature_name)
        return response

    return PreparedRequest(calls, respond)


def _check_tasks(runner: Runner, tasks: Sequence[inference_pb2.InferenceTask],
                 check_method_name: bool) -> dict[str, meta_graph_pb2.SignatureDef]:
    """Each task's signature, by name in task order, checked as multi_inference.cc does."""
    if not tasks:
        raise InvalidArgument("MultiInferenceRequest has no tasks; add an InferenceTask per signature to run")
    model_name, signatures = "", {}
    for task in tasks:
        if not task.model_spec.name:
            raise InvalidArgument("Found ModelSpec with an empty model name.")
        if model_name and task.model_spec.name != model_name:
            raise InvalidArgument("All ModelSpecs in a MultiInferenceRequest must access the same model name. "
                                  f"Got '{short(model_name)}' and '{short(task.model_spec.name)}'")
        model_name = task.model_spec.name
        signature_name = task.model_spec.signature_name or DEFAULT_SIGNATURE
        if signature_name in signatures:
            raise InvalidArgument(f"Duplicate evaluation of signature: {short(signature_name)}")
        signatures[signature_name] = _check_task(runner, task.method_name, signature_name, check_method_name)
    return signatures


def _examples_call(runner: Runner, signature_name: str, input: input_pb2.Input, examples: np.ndarray,
                   outputs: Sequence[str]) -> ModelCall:
    """The model call that feeds serialized tf.Examples to a Classify/Regress signature's 'inputs'.

    Raises:
        InputError: an example the signature's ParseExample op would refuse, in the op's words, before it
            can fail a batch merged with other clients' requests (serving/servable/example_parsing.py).
    """
    call = runner.call({EXAMPLES_INPUT: examples}, signature_name, outputs)
    spec = call.signature.examples
    if spec is not None:
        if input.WhichOneof("kind") == "example_list_with_context":
            problem = spec.first_problem(input.example_list_with_context.examples, input.example_list_with_context.context)
        else:
            problem = spec.first_problem(input.example_list.examples)
        if problem:
            raise InputError(f"signature '{call.signature.name}': {problem}")
    return call


def _check_task(runner: Runner, method_name: str, signature_name: str,
                check_method_name: bool) -> meta_graph_pb2.SignatureDef:
    """One MultiInference task's signature, checked for its method (Classify or Regress form)."""
    signature = runner.signature_defs.get(signature_name)
    if signature is None:
        raise InvalidArgument(f"Requested signature not found in model graph: {short(signature_name)}. "
                              f"{_available_signatures(runner)}")
    if method_name == CLASSIFY_METHOD_NAME:
        _check_classification_signature(signature_name, signature, check_method_name)
    elif method_name == REGRESS_METHOD_NAME:
        _check_regression_signature(signature_name, signature, check_method_name)
    else:
        raise Unimplemented(f"Unsupported signature method_name: {short(method_name)}. InferenceTask.method_name must be "
                            f"{CLASSIFY_METHOD_NAME} or {REGRESS_METHOD_NAME}")
    return signature


def _find_signature(runner: Runner, requested: str) -> tuple[str, meta_graph_pb2.SignatureDef]:
    """Classify/Regress look signatures up with INVALID_ARGUMENT, not Predict's FAILED_PRECONDITION."""
    signature_name = requested or DEFAULT_SIGNATURE
    signature = runner.signature_defs.get(signature_name)
    if signature is None:
        raise InvalidArgument(f"No signature was found with the name: {short(signature_name)}. "
                              f"{_available_signatures(runner)}")
    return signature_name, signature


def _check_method_name(name: str, signature: meta_graph_pb2.SignatureDef, task: str, expected: str,
                       check: bool) -> None:
    """--enable_signature_method_name_check: the signature must declare the task's method name."""
    if check and signature.method_name != expected:
        raise InvalidArgument(f"Expected {task} signature method_name to be {expected}. Was: {signature.method_name} "
                              f"(signature '{name}'; the server runs with --enable_signature_method_name_check)")


def _check_classification_signature(name: str, signature: meta_graph_pb2.SignatureDef, check_method_name: bool) -> None:
    """classifier.cc PreProcessClassification: one input 'inputs'; one or two outputs, 'classes' and/or 'scores'."""
    _check_method_name(name, signature, "classification", CLASSIFY_METHOD_NAME, check_method_name)
    _check_single_examples_input(name, signature)
    if len(signature.outputs) not in (1, 2):
        raise InvalidArgument(f"Expected one or two output Tensors, found {len(signature.outputs)} "
                              f"(signature '{name}' outputs {_keys(signature.outputs)})")
    if EXAMPLES_INPUT not in signature.inputs:
        raise InvalidArgument(f"No classification inputs found in SignatureDef: signature '{name}' takes "
                              f"{_keys(signature.inputs)}, expected '{EXAMPLES_INPUT}'")
    if not _classification_outputs(signature):
        raise InvalidArgument(f'Expected classification signature outputs to contain at least one of '
                              f'"{CLASSES_OUTPUT}" or "{SCORES_OUTPUT}". Signature \'{name}\' outputs '
                              f'{_keys(signature.outputs)}')


def _check_regression_signature(name: str, signature: meta_graph_pb2.SignatureDef, check_method_name: bool) -> None:
    """regressor.cc PreProcessRegression: one input 'inputs', one output 'outputs'."""
    _check_method_name(name, signature, "regression", REGRESS_METHOD_NAME, check_method_name)
    _check_single_examples_input(name, signature)
    if len(signature.outputs) != 1:
        raise InvalidArgument(f"Expected one output Tensor. Signature '{name}' outputs {_keys(signature.outputs)}, "
                              f"expected only '{REGRESSION_OUTPUT}'")
    if EXAMPLES_INPUT not in signature.inputs:
        raise InvalidArgument(f"No regression inputs found in SignatureDef: signature '{name}' takes "
                              f"{_keys(signature.inputs)}, expected '{EXAMPLES_INPUT}'")
    if REGRESSION_OUTPUT not in signature.outputs:
        raise InvalidArgument(f"No regression outputs found in SignatureDef: signature '{name}' outputs "
                              f"{_keys(signature.outputs)}, expected '{REGRESSION_OUTPUT}'")


def _check_single_examples_input(name: str, signature: meta_graph_pb2.SignatureDef) -> None:
    if len(signature.inputs) != 1:
        raise InvalidArgument(f"Expected one input Tensor. Signature '{name}' takes {_keys(signature.inputs)}; "
                              f"Classify and Regress feed a single DT_STRING input '{EXAMPLES_INPUT}' of "
                              "serialized tf.Examples")


def _classification_outputs(signature: meta_graph_pb2.SignatureDef) -> list[str]:
    return [name for name in (CLASSES_OUTPUT, SCORES_OUTPUT) if name in signature.outputs]


def _fill_classification_result(result: classification_pb2.ClassificationResult,
                                outputs: dict[str, np.ndarray], num_examples: int) -> None:
    """classifier.cc PostProcessClassificationResult: classes (DT_STRING) and/or scores (DT_FLOAT), [batch, classes]."""
    classes, scores = outputs.get(CLASSES_OUTPUT), outputs.get(SCORES_OUTPUT)
    for name, array, dtype in ((CLASSES_OUTPUT, classes, "DT_STRING"), (SCORES_OUTPUT, scores, "DT_FLOAT")):
        if array is None:
            continue
        if array.ndim != 2:
            raise InvalidArgument(f"Expected Tensor shape: [batch_size num_classes] but got {_shape(array)} "
                                  f"(output '{name}')")
        if _dtype_name(array) != dtype:
            raise InvalidArgument(f"Expected {name} Tensor of {dtype}. Got: {_dtype_name(array)}")
        if array.shape[0] != num_examples:
            raise InvalidArgument(f"Expected {name} output batch size of {num_examples}. Got: {array.shape[0]}")
    if classes is not None and scores is not None and classes.shape[1] != scores.shape[1]:
        raise InvalidArgument(f"Tensors class and score should match in dim_size(1). "
                              f"Got {classes.shape[1]} vs. {scores.shape[1]}")
    num_classes = (classes if classes is not None else scores).shape[1]
    labels = classes.tolist() if classes is not None else None
    values = scores.tolist() if scores is not None else None
    for i in range(num_examples):
        row = result.classifications.add()
        for j in range(num_classes):
            entry = row.classes.add()
            if labels is not None:
                entry.label = _label(labels[i][j], i, j)
            if values is not None:
                entry.score = values[i][j]


def _fill_regression_result(result: regression_pb2.RegressionResult, values: np.ndarray, num_examples: int) -> None:
    """regressor.cc PostProcessRegressionResult: DT_FLOAT of shape [batch] or [batch, 1]."""
    if not (values.ndim == 1 or (values.ndim == 2 and values.shape[1] == 1)):
        raise InvalidArgument("Expected output Tensor shape to be either [batch_size] or [batch_size, 1] "
                              f"but got {_shape(values)} (output '{REGRESSION_OUTPUT}')")
    if values.shape[0] != num_examples:
        raise InvalidArgument(f"Input batch size did not match output batch size: {num_examples} vs. {values.shape[0]}")
    if _dtype_name(values) != "DT_FLOAT":
        raise InvalidArgument(f"Expected output Tensor of DT_FLOAT.  Got: {_dtype_name(values)} "
                              f"(output '{REGRESSION_OUTPUT}')")
    result.regressions.extend(regression_pb2.Regression(value=value) for value in values.ravel().tolist())


def _fill_model_spec(spec: model_pb2.ModelSpec, model_name: str, runner: Runner, signature_name: str) -> None:
    """TF Serving's MakeModelSpec (util.cc): the requested name, the served version, the resolved signature."""
    spec.name = model_name or runner.model_name
    if runner.version is not None:
        spec.version.value = runner.version
    spec.signature_name = signature_name


def _label(value: object, row: int, column: int) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"output '{CLASSES_OUTPUT}'[{row}, {column}] is not UTF-8 text, "
                              f"which Class.label (a proto string) requires: {value[:32]!r}") from None


def _dtype_name(array: np.ndarray) -> str:
    """TF's DataType name of an output array: DT_FLOAT, DT_HALF, DT_STRING, ..."""
    dtype = tensors.datatype(array)
    return types_pb2.DataType.Name(dtype) if isinstance(dtype, int) else dtype


def _shape(array: np.ndarray) -> str:
    return "[" + ",".join(str(dim) for dim in array.shape) + "]"


def _keys(names: Iterable[str]) -> str:
    return "{" + ", ".join(sorted(names)) + "}"


def _available_signatures(runner: Runner) -> str:
    names = sorted(name for name in runner.signature_defs if not name.startswith("__"))
    return f"Model {runner.model_name} has: {', '.join(names) or 'no signatures'}"
