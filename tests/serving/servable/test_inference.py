"""serving/servable/inference.py in-process: TF Serving's Predict/Classify/Regress/MultiInference rules over a loaded Runner.

Models:
  examples_model   a tiny Keras mixed_float16 classifier (float32 head) exported with ExportArchive, whose
                   endpoints take serialized tf.Examples; some are malformed on purpose, and saved_model.pb
                   is patched (notes §5 Route B) so that `classify`/`regress` carry TF1 method names
  half_plus_two    TF Serving's TF1 fixture (classify_x_to_y, regress_x_to_y share the input tf_example:0)
  tf2              TF Serving's saved_model_half_plus_two_tf2_cpu: native TF2 classify/regress signatures
                   (method_name predict) and a serving_default with SignatureDef.defaults (x = [0])
  half_plus_three  TF Serving's TF1 fixture whose SignatureDefs lie about shapes and dtypes
Codes are checked through errors.status_for, the one place the server maps failures to gRPC statuses.
"""

from __future__ import annotations

import tracemalloc

import grpc
import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import classification_pb2, inference_pb2, predict_pb2, regression_pb2

from serving.servable.runner import Runner
from serving import errors, limits
from serving.servable import inference

pytestmark = pytest.mark.timeout(120)

LABELS = [b"cat", b"dog", b"fish"]
KERNEL = np.array([[1.0, 0.0, -1.0], [0.5, 1.0, 0.0]], np.float32)
FEATURES = {"x": tf.io.FixedLenFeature([2], tf.float32),
            "bias": tf.io.FixedLenFeature([1], tf.float32, default_value=[0.0])}
CLASSIFY, REGRESS = inference.CLASSIFY_METHOD_NAME, inference.REGRESS_METHOD_NAME
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def write_examples_model(version_dir) -> None:
    """Exports the endpoints below; `classify`, `regress` and `custom` get their method_name set afterwards."""
    features = keras.Input((2,), name="x")
    logits = keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(KERNEL), dtype="mixed_float16",
                                name="logits")(features)
    scores = keras.layers.Activation("softmax", dtype="float32", name="scores")(logits)
    model = keras.Model(features, {"logits": logits, "scores": scores})

    def parse(inputs):
        return tf.io.parse_example(inputs, FEATURES)

    def run(inputs):
        return model(parse(inputs)["x"], training=False)

    def labels(inputs):
        return tf.tile(tf.constant([LABELS]), [tf.shape(inputs)[0], 1])

    def total(inputs):
        parsed = parse(inputs)
        return tf.reduce_sum(parsed["x"], axis=1) + parsed["bias"][:, 0]

    examples = [tf.TensorSpec([None], tf.string, name="inputs")]
    endpoints = {
        "serving_default": (lambda x: {"scores": model(x)["scores"]}, [tf.TensorSpec([None, 2], tf.float32, name="x")]),
        "classify": (lambda inputs: {"classes": labels(inputs), "scores": run(inputs)["scores"]}, examples),
        "classify_tf2": (lambda inputs: {"classes": labels(inputs), "scores": run(inputs)["scores"]}, examples),
        "scores_only": (lambda inputs: {"scores": run(inputs)["scores"]}, examples),
        "classes_only": (lambda inputs: {"classes": labels(inputs)}, examples),
        "regress": (lambda inputs: {"outputs": total(inputs)}, examples),
        "regress_column": (lambda inputs: {"outputs": total(inputs)[:, None]}, examples),
        "custom": (lambda x: {"scores": model(x)["scores"]}, [tf.TensorSpec([None, 2], tf.float32, name="x")]),
        # Signatures of the wrong form (refused before anything runs).
        "two_inputs": (lambda inputs, x: {"scores": model(x)["scores"], "outputs": total(inputs)},
                       [*examples, tf.TensorSpec([None, 2], tf.float32, name="x")]),
        "examples_input": (lambda examples: {"scores": run(examples)["scores"], "outputs": total(examples)},
                           [tf.TensorSpec([None], tf.string, name="examples")]),
        "three_outputs": (lambda inputs: {"classes": labels(inputs), "scores": run(inputs)["scores"],
                                          "outputs": total(inputs)}, examples),
        "probabilities": (lambda inputs: {"probabilities": run(inputs)["scores"]}, examples),
        "regress_two_outputs": (lambda inputs: {"outputs": total(inputs), "scores": run(inputs)["scores"]}, examples),
        # Outputs of the wrong dtype or shape (refused after running).
        "float16_scores": (lambda inputs: {"scores": run(inputs)["logits"]}, examples),  # a float16 head leaking out
        "float16_outputs": (lambda inputs: {"outputs": tf.cast(total(inputs), tf.float16)}, examples),
        "float_classes": (lambda inputs: {"classes": run(inputs)["scores"]}, examples),
        "flat_scores": (lambda inputs: {"scores": run(inputs)["scores"][:, 0]}, examples),
        "one_row_scores": (lambda inputs: {"scores": run(inputs)["scores"][:1]}, examples),
        "fewer_scores": (lambda inputs: {"classes": labels(inputs), "scores": run(inputs)["scores"][:, :2]}, examples),
        "wide_outputs": (lambda inputs: {"outputs": run(inputs)["scores"]}, examples),
        "one_row_outputs": (lambda inputs: {"outputs": total(inputs)[:1]}, examples),
    }
    archive = keras.export.ExportArchive()
    archive.track(model)
    for name, (function, signature) in endpoints.items():
        archive.add_endpoint(name, function, input_signature=signature)
    archive.write_out(str(version_dir), verbose=False)
    set_method_names(version_dir, {"classify": CLASSIFY, "regress": REGRESS, "custom": "custom/method"})


def set_method_names(version_dir, method_names: dict[str, str]) -> None:
    """Notes §5 Route B: TF2 always writes tensorflow/serving/predict, so edit SignatureDef.method_name in place."""
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((version_dir / "saved_model.pb").read_bytes())
    for name, method_name in method_names.items():
        saved_model.meta_graphs[0].signature_def[name].method_name = method_name
    (version_dir / "saved_model.pb").write_bytes(saved_model.SerializeToString())


@pytest.fixture(scope="module")
def examples_model(tmp_path_factory) -> Runner:
    version_dir = tmp_path_factory.mktemp("examples_model") / "1"
    write_examples_model(version_dir)
    return Runner.load(version_dir, model_name="examples")


@pytest.fixture(scope="module")
def half_plus_two(tmp_path_factory, copy_testdata) -> Runner:
    return Runner.load(copy_testdata("saved_model_half_plus_two_cpu", tmp_path_factory.mktemp("hp2") / "m"),
                       model_name="half_plus_two")


@pytest.fixture(scope="module")
def tf2(tmp_path_factory, copy_testdata) -> Runner:
    return Runner.load(copy_testdata("saved_model_half_plus_two_tf2_cpu", tmp_path_factory.mktemp("tf2") / "m"),
                       model_name="tf2")


@pytest.fixture(scope="module")
def half_plus_three(tmp_path_factory, copy_testdata) -> Runner:
    path = copy_testdata("saved_model_half_plus_three", tmp_path_factory.mktemp("hp3") / "m")
    return Runner.load(path, model_name="half_plus_three")


def example(**features: list[float]) -> tf.train.Example:
    return tf.train.Example(features=tf.train.Features(feature={
        name: tf.train.Feature(float_list=tf.train.FloatList(value=values)) for name, values in features.items()}))


ROWS = [example(x=[1.0, 2.0]), example(x=[-1.0, 0.5], bias=[4.0])]


def expected_scores(rows: list[list[float]]) -> np.ndarray:
    logits = np.array(rows, np.float32) @ KERNEL
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def classification_request(signature_name="classify", rows=ROWS,
                           model="examples") -> classification_pb2.ClassificationRequest:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    request.input.example_list.examples.extend(rows)
    return request


def regression_request(signature_name="regress", rows=ROWS, model="examples") -> regression_pb2.RegressionRequest:
    request = regression_pb2.RegressionRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    request.input.example_list.examples.extend(rows)
    return request


def multi_request(*tasks: tuple[str, str], model="examples", rows=ROWS) -> inference_pb2.MultiInferenceRequest:
    request = inference_pb2.MultiInferenceRequest()
    for signature_name, method_name in tasks:
        request.tasks.add(model_spec={"name": model, "signature_name": signature_name}, method_name=method_name)
    request.input.example_list.examples.extend(rows)
    return request


def _inline(prepare):
    """An RPC as warmup runs it: prepared, its model calls run on this thread, answered (inference.run_inline)."""
    def run(runner, request, **flags):
        return inference.run_inline(runner, prepare(runner, request, **flags))

    return run


run_predict, run_classify, run_regress, run_multi_inference = map(_inline, (
    inference.prepare_predict, inference.prepare_classify, inference.prepare_regress,
    inference.prepare_multi_inference))


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    """The gRPC status the server would answer a failing call with."""
    with pytest.raises(Exception) as raised:
        call(*args, **kwargs)
    return errors.status_for(raised.value)


def spec_of(response) -> tuple[str, int, str]:
    return response.model_spec.name, response.model_spec.version.value, response.model_spec.signature_name


def test_classify_returns_labels_and_scores_per_example(examples_model):
    response = run_classify(examples_model, classification_request())
    assert spec_of(response) == ("examples", 1, "classify")
    assert len(response.result.classifications) == 2
    scores = [[c.score for c in row.classes] for row in response.result.classifications]
    np.testing.assert_allclose(scores, expected_scores([[1.0, 2.0], [-1.0, 0.5]]), atol=2e-3)  # float16 math
    assert [[c.label for c in row.classes] for row in response.result.classifications] == [["cat", "dog", "fish"]] * 2


@pytest.mark.parametrize("signature_name, has_labels, has_scores", [
    ("scores_only", False, True), ("classes_only", True, False)])
def test_classify_with_scores_or_classes_only(examples_model, signature_name, has_labels, has_scores):
    [row, _] = run_classify(examples_model, classification_request(signature_name)).result.classifications
    assert len(row.classes) == 3
    assert [c.label for c in row.classes] == (["cat", "dog", "fish"] if has_labels else ["", "", ""])
    assert all(c.score > 0 for c in row.classes) == has_scores


@pytest.mark.parametrize("signature_name", ["regress", "regress_column"])
def test_regress_accepts_batch_or_batch_by_1_outputs(examples_model, signature_name):
    response = run_regress(examples_model, regression_request(signature_name))
    assert spec_of(response) == ("examples", 1, signature_name)
    assert [r.value for r in response.result.regressions] == [3.0, 3.5]  # x0 + x1 + bias


def test_context_is_merged_into_each_example_and_examples_win(examples_model):
    request = regression_request()
    request.input.example_list_with_context.context.CopyFrom(example(bias=[10.0]))
    request.input.example_list_with_context.examples.extend(ROWS)  # the second row sets its own bias (4)
    assert request.input.WhichOneof("kind") == "example_list_with_context"
    assert [r.value for r in run_regress(examples_model, request).result.regressions] == [13.0, 3.5]


@pytest.mark.parametrize("make_input", [
    lambda request: None,
    lambda request: request.input.example_list.SetInParent(),
    lambda request: request.input.example_list_with_context.context.CopyFrom(example(bias=[1.0])),
], ids=["no input", "empty example_list", "context only"])
def test_empty_input_is_invalid_argument(examples_model, make_input):
    for call, request in ((run_classify, classification_request(rows=[])),
                          (run_regress, regression_request(rows=[]))):
        make_input(request)
        code, message = status_of(call, examples_model, request)
        assert (code, message.split(". ")[0]) == (INVALID, "Input is empty")


def test_unknown_signature_code_differs_between_rpcs(examples_model):
    """predict_util.cc: FAILED_PRECONDITION; classifier.cc/regressor.cc/multi_inference.cc: INVALID_ARGUMENT."""
    predict = predict_pb2.PredictRequest(model_spec={"name": "examples", "signature_name": "nope"})
    assert status_of(run_predict, examples_model, predict)[0] == PRECONDITION
    for call, request, message in [
        (run_classify, classification_request("nope"), "No signature was found with the name: nope"),
        (run_regress, regression_request("nope"), "No signature was found with the name: nope"),
        (run_multi_inference, multi_request(("nope", REGRESS)),
         "Requested signature not found in model graph: nope"),
    ]:
        code, text = status_of(call, examples_model, request)
        assert code == INVALID and text.startswith(message) and "classify" in text  # lists what the model has


def test_signature_checks_come_before_the_empty_input_check(examples_model):
    code, message = status_of(run_classify, examples_model, classification_request("nope", rows=[]))
    assert message.startswith("No signature was found")


# rpc -> signature -> (expected message start); every one is INVALID_ARGUMENT, as in classifier.cc/regressor.cc.
BAD_SIGNATURES = [
    ("classify", "", 'No classification inputs found in SignatureDef: signature \'serving_default\' takes {x}'),
    ("classify", "two_inputs", "Expected one input Tensor. Signature 'two_inputs' takes {inputs, x}"),
    ("classify", "examples_input", "No classification inputs found in SignatureDef"),
    ("classify", "three_outputs", "Expected one or two output Tensors, found 3"),
    ("classify", "probabilities", 'Expected classification signature outputs to contain at least one of "classes" or '
                                  '"scores". Signature \'probabilities\' outputs {probabilities}'),
    ("classify", "regress", 'Expected classification signature outputs to contain at least one of'),
    ("regress", "two_inputs", "Expected one input Tensor."),
    ("regress", "examples_input", "Expected one output Tensor."),
    ("regress", "regress_two_outputs", "Expected one output Tensor. Signature 'regress_two_outputs' outputs "
                                       "{outputs, scores}"),
    ("regress", "probabilities", "No regression outputs found in SignatureDef: signature 'probabilities' outputs "
                                 "{probabilities}, expected 'outputs'"),
    ("regress", "classify", "Expected one output Tensor."),
    ("regress", "", "No regression inputs found in SignatureDef"),
    # Outputs are checked after the run, as PostProcessClassificationResult/PostProcessRegressionResult do.
    ("classify", "float16_scores", "Expected scores Tensor of DT_FLOAT. Got: DT_HALF"),
    ("classify", "float_classes", "Expected classes Tensor of DT_STRING. Got: DT_FLOAT"),
    ("classify", "flat_scores", "Expected Tensor shape: [batch_size num_classes] but got [2] (output 'scores')"),
    ("classify", "one_row_scores", "Expected scores output batch size of 2. Got: 1"),
    ("classify", "fewer_scores", "Tensors class and score should match in dim_size(1). Got 3 vs. 2"),
    ("regress", "float16_outputs", "Expected output Tensor of DT_FLOAT.  Got: DT_HALF"),
    ("regress", "wide_outputs",
     "Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but got [2,3]"),
    ("regress", "one_row_outputs", "Input batch size did not match output batch size: 2 vs. 1"),
]


@pytest.mark.parametrize("rpc, signature_name, message", BAD_SIGNATURES,
                         ids=[f"{rpc}-{name or 'default'}" for rpc, name, _ in BAD_SIGNATURES])
def test_signature_of_the_wrong_form_is_invalid_argument(examples_model, rpc, signature_name, message):
    call, request = ((run_classify, classification_request(signature_name)) if rpc == "classify"
                     else (run_regress, regression_request(signature_name)))
    code, text = status_of(call, examples_model, request)
    assert (code, text[:len(message)]) == (INVALID, message)
    # MultiInference runs the same checks for the task's method.
    task = multi_request((signature_name, CLASSIFY if rpc == "classify" else REGRESS))
    assert status_of(run_multi_inference, examples_model, task) == (code, text)


def custom_method_predict() -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest(model_spec={"name": "examples", "signature_name": "custom"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((1, 2), np.float32)))
    return request


# Signatures whose method_name does not fit the RPC: accepted with the check off, refused with it on.
WRONG_METHOD_NAMES = {
    "classify on predict": (run_classify, classification_request("classify_tf2"), INVALID,
                            "Expected classification signature method_name to be tensorflow/serving/classify. "
                            "Was: tensorflow/serving/predict (signature 'classify_tf2'"),
    "regress on predict": (run_regress, regression_request("regress_column"), INVALID,
                           "Expected regression signature method_name to be tensorflow/serving/regress. "
                           "Was: tensorflow/serving/predict"),
    "multi on predict": (run_multi_inference, multi_request(("classify_tf2", CLASSIFY)), INVALID,
                         "Expected classification signature method_name to be tensorflow/serving/classify"),
    "predict on custom": (run_predict, custom_method_predict(), grpc.StatusCode.INTERNAL,
                          "Expected prediction signature method_name to be one of {tensorflow/serving/predict, "
                          "tensorflow/serving/classify, tensorflow/serving/regress}. Was: custom/method"),
}


@pytest.mark.parametrize("case", list(WRONG_METHOD_NAMES))
def test_method_name_check_off_accepts_any_method_name(examples_model, case):
    """TF Serving's default: native TF2 signatures (method_name predict) serve Classify and Regress."""
    call, request, _, _ = WRONG_METHOD_NAMES[case]
    call(examples_model, request)


@pytest.mark.parametrize("case", list(WRONG_METHOD_NAMES))
def test_method_name_check_on_refuses_other_method_names(examples_model, case):
    call, request, code, message = WRONG_METHOD_NAMES[case]
    code_, text = status_of(call, examples_model, request, enable_signature_method_name_check=True)
    assert (code_, text[:len(message)]) == (code, message)


def test_method_name_check_on_accepts_matching_method_names(examples_model):
    check = {"enable_signature_method_name_check": True}
    assert len(run_classify(examples_model, classification_request("classify"), **check)
               .result.classifications) == 2
    assert len(run_regress(examples_model, regression_request("regress"), **check).result.regressions) == 2
    request = multi_request(("classify", CLASSIFY))
    assert len(run_multi_inference(examples_model, request, **check).results) == 1
    predict = predict_pb2.PredictRequest(model_spec={"name": "examples", "signature_name": "classify"})
    predict.inputs["inputs"].CopyFrom(tf.make_tensor_proto([ROWS[0].SerializeToString()]))
    assert set(run_predict(examples_model, predict, **check).outputs) == {"classes", "scores"}


def test_multi_inference_over_one_tf2_signature(examples_model):
    response = run_multi_inference(examples_model, multi_request(("classify_tf2", CLASSIFY)))
    [result] = response.results
    assert spec_of(result) == ("examples", 1, "classify_tf2")
    assert len(result.classification_result.classifications) == 2


@pytest.mark.parametrize("tasks, code, message", [
    ([("regress", REGRESS), ("regress", REGRESS)], INVALID, "Duplicate evaluation of signature: regress"),
    ([("serving_default", "tensorflow/serving/predict")], grpc.StatusCode.UNIMPLEMENTED,
     "Unsupported signature method_name: tensorflow/serving/predict"),
    ([("regress", "")], grpc.StatusCode.UNIMPLEMENTED, "Unsupported signature method_name: "),
    ([], INVALID, "MultiInferenceRequest has no tasks"),
], ids=["duplicate", "predict task", "no method", "no tasks"])
def test_multi_inference_rules(examples_model, tasks, code, message):
    code_, text = status_of(run_multi_inference, examples_model, multi_request(*tasks))
    assert (code_, text[:len(message)]) == (code, message)


def test_multi_inference_tasks_must_name_one_model(examples_model):
    request = multi_request(("classify", CLASSIFY), ("scores_only", CLASSIFY))
    request.tasks[1].model_spec.name = "other"
    assert status_of(run_multi_inference, examples_model, request) == (
        INVALID,
        "All ModelSpecs in a MultiInferenceRequest must access the same model name. Got 'examples' and 'other'")
    request.tasks[1].model_spec.name = ""
    assert status_of(run_multi_inference, examples_model, request) == (
        INVALID, "Found ModelSpec with an empty model name.")


def test_multi_inference_checks_tasks_before_input(examples_model):
    request = multi_request(("regress", REGRESS), ("regress", REGRESS), rows=[])
    assert status_of(run_multi_inference, examples_model, request)[1].startswith("Duplicate evaluation")
    assert status_of(run_multi_inference, examples_model,
                     multi_request(("regress", REGRESS), rows=[]))[1].startswith("Input is empty")


def test_tf_serving_multi_inference_on_half_plus_two(half_plus_two):
    """tensorflow_model_server_test.py testMultiInference: regress_x_to_y and classify_x_to_y share tf_example:0."""
    request = multi_request(("regress_x_to_y", REGRESS), ("classify_x_to_y", CLASSIFY), model="half_plus_two",
                            rows=[example(x=[2.0])])
    response = run_multi_inference(half_plus_two, request)
    assert response.results[0].regression_result.regressions[0].value == 3.0
    assert response.results[1].classification_result.classifications[0].classes[0].score == 3.0
    assert [spec_of(result) for result in response.results] == [
        ("half_plus_two", 123, "regress_x_to_y"), ("half_plus_two", 123, "classify_x_to_y")]


def test_multi_inference_over_signatures_with_separate_inputs(examples_model):
    """multi_inference.cc feeds the examples to every task's input tensor, so signatures with their own
    placeholders (classify_inputs:0, regress_inputs:0) combine."""
    response = run_multi_inference(examples_model, multi_request(("classify", CLASSIFY), ("regress", REGRESS)))
    scores = [[c.score for c in row.classes] for row in response.results[0].classification_result.classifications]
    np.testing.assert_allclose(scores, expected_scores([[1.0, 2.0], [-1.0, 0.5]]), atol=2e-3)
    assert [r.value for r in response.results[1].regression_result.regressions] == [3.0, 3.5]
    assert [spec_of(result) for result in response.results] == [("examples", 1, "classify"), ("examples", 1, "regress")]


def test_tf_serving_multi_inference_tf2(tf2):
    """tensorflow_model_server_test.py testMultiInferenceTf2: the TF2 half_plus_two answers 3.0 for both tasks."""
    request = multi_request(("regress_x_to_y", REGRESS), ("classify_x_to_y", CLASSIFY), model="tf2",
                            rows=[example(x=[2.0])])
    response = run_multi_inference(tf2, request)
    assert len(response.results) == 2
    assert response.results[0].regression_result.regressions[0].value == 3.0
    assert response.results[1].classification_result.classifications[0].classes[0].score == 3.0


def test_native_tf2_classify_and_regress_on_tf_serving_fixture(tf2):
    """saved_model_half_plus_two_tf2_cpu: predict-named signatures work while the method-name check is off."""
    rows = [example(x=[2.0]), example(x=[4.0])]
    classified = run_classify(tf2, classification_request("classify_x_to_y", rows, model="tf2"))
    assert [row.classes[0].score for row in classified.result.classifications] == [3.0, 4.0]
    regressed = run_regress(tf2, regression_request("regress_x_to_y2", rows, model="tf2"))
    assert [r.value for r in regressed.result.regressions] == [4.0, 5.0]  # y2 = x / 2 + 3
    assert status_of(run_regress, tf2, regression_request("regress_x_to_y", rows, model="tf2"),
                     enable_signature_method_name_check=True)[0] == INVALID


def test_predict_takes_omitted_inputs_from_signature_defaults(tf2):
    """predict_util.cc + saved_model/util.cc GetInputValues: an input left out is read from SignatureDef.defaults."""
    request = predict_pb2.PredictRequest(model_spec={"name": "tf2"})
    response = run_predict(tf2, request)
    assert spec_of(response) == ("tf2", 123, "serving_default")
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["y"]), [2.0])  # x defaults to [0]
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([4.0], np.float32)))
    np.testing.assert_array_equal(tf.make_ndarray(run_predict(tf2, request).outputs["y"]), [4.0])


def test_predict_without_defaults_still_needs_every_input(half_plus_two):
    request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"})
    assert status_of(run_predict, half_plus_two, request) == (
        INVALID, "input size does not match signature: 0!=1 len({}) != len({x}). Sent extra: {}. "
                 "Missing but required: {x}.")


@pytest.mark.parametrize("specify_output", [True, False])
def test_tf_serving_predict_on_half_plus_three(half_plus_three, specify_output):
    """tensorflow_model_server_test.py testGoodModelConfig: half_plus_three gives 4.0 for x = 2.0."""
    request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_three"},
                                         output_filter=["y"] if specify_output else [])
    request.inputs["x"].dtype = tf.float32.as_datatype_enum
    request.inputs["x"].float_val.append(2.0)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    response = run_predict(half_plus_three, request)
    assert list(response.outputs["y"].float_val) == [4.0]
    assert spec_of(response) == ("half_plus_three", 123, "serving_default")


def test_regress_on_half_plus_three_whose_signature_lies_about_its_input(half_plus_three):
    """Its regress SignatureDef says DT_FLOAT for tf_example:0; TF Serving feeds the graph's DT_STRING anyway."""
    request = regression_request("tensorflow/serving/regress", [example(x=[1.0]), example(x=[2.0])],
                                 model="half_plus_three")
    response = run_regress(half_plus_three, request, enable_signature_method_name_check=True)
    assert [r.value for r in response.result.regressions] == [3.5, 4.0]


def predict_x(**proto_fields) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"})
    request.inputs["x"].CopyFrom(tensor_pb2.TensorProto(**proto_fields))
    return request


def test_tf_serving_predict_wordings(half_plus_two):
    """predict_util_test.cc InputTensorsDontMatchModelSpecInputs, PredictionInvalidTensor, OutputFiltersDontMatch..."""
    request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"})
    request.inputs["unknown_key1"].CopyFrom(tf.make_tensor_proto([b"any_value"]))
    request.inputs["unknown_key2"].CopyFrom(tf.make_tensor_proto([1.0]))
    code, message = status_of(run_predict, half_plus_two, request)
    assert code == INVALID and "Sent extra: {unknown_key1,unknown_key2}" in message
    assert "Missing but required: {x}" in message
    invalid = predict_x(dtype=types_pb2.DT_BOOL, bool_val=[True])
    assert status_of(run_predict, half_plus_two, invalid) == (
        INVALID, "Expects arg[0] to be float but bool is provided (input 'x')")
    good = predict_x(dtype=types_pb2.DT_FLOAT, float_val=[2.0])
    good.output_filter.append("output_filter")
    assert status_of(run_predict, half_plus_two, good) == (
        INVALID, "output tensor alias not found in signature: output_filter Outputs expected to be in the set {y}.")
    good.output_filter[:] = ["y", "y"]
    assert status_of(run_predict, half_plus_two, good) == (INVALID, "duplicate output tensor alias: y")


def test_arg_index_counts_the_signature_inputs_in_name_order(examples_model):
    request = predict_pb2.PredictRequest(model_spec={"name": "examples", "signature_name": "two_inputs"})
    request.inputs["inputs"].CopyFrom(tf.make_tensor_proto([ROWS[0].SerializeToString()]))
    request.inputs["x"].CopyFrom(tf.make_tensor_proto([b"not a float"]))
    assert status_of(run_predict, examples_model, request) == (
        INVALID, "Expects arg[1] to be float but string is provided (input 'x')")


@pytest.mark.parametrize("request_, message", [
    # The 42-byte request: float32 [1048576, 64] declared, no values sent.
    (predict_x(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 1048576}, {"size": 64}]}),
     "tensor parsing error: x (shape [1048576, 64] declares 67108864 elements but 0 values were sent"),
    # An input name the model lacks, declaring 8 Mi strings: refused by name.
    (predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"}, inputs={"nope": tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING, tensor_shape={"dim": [{"size": 8388608}]})}),
     "Signature input alias: x(feed name: x:0) not found in request"),
    # The wrong dtype, with a huge declared shape.
    (predict_x(dtype=types_pb2.DT_STRING, tensor_shape={"dim": [{"size": 8388608}]}, string_val=[b"a"] * 8),
     "tensor parsing error: x (shape [8388608] declares 8388608 elements but 8 values were sent"),
    (predict_x(dtype=types_pb2.DT_STRING, tensor_shape={"dim": [{"size": 8}]}, string_val=[b"a"] * 8),
     "Expects arg[0] to be float but string is provided (input 'x')"),
], ids=["declared, not sent", "unknown name", "declared string", "wrong dtype"])
def test_requests_are_refused_before_anything_is_allocated_for_them(half_plus_two, request_, message):
    tracemalloc.start()
    try:
        code, text = status_of(run_predict, half_plus_two, request_)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (code, text[:len(message)]) == (INVALID, message)
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse the request"


@pytest.mark.parametrize("values, expected", [
    ([], [2.0, 2.0, 2.0]), ([2.0], [3.0, 3.0, 3.0]), ([1.0, 2.0], [2.5, 3.0, 3.0])])
def test_values_that_do_not_fill_the_shape_are_filled_as_tensor_from_proto_does(half_plus_two, values, expected):
    """Tensor::FromProto: no values are zeros, fewer values repeat the last one."""
    request = predict_x(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 3}, {"size": 1}]}, float_val=values)
    assert list(run_predict(half_plus_two, request).outputs["y"].float_val) == expected


def test_request_element_limit_names_the_input(half_plus_two):
    request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((5, 1), np.float32)))
    assert status_of(run_predict, half_plus_two, request, max_request_elements=4) == (
        INVALID, "input 'x' declares 5 elements, which brings the request to 5; the server allows at most 4 per "
                 "request (--max_request_elements)")
    assert len(run_predict(half_plus_two, request, max_request_elements=5).outputs["y"].float_val) == 5
    assert len(run_predict(half_plus_two, request, max_request_elements=0).outputs["y"].float_val) == 5


@pytest.fixture
def one_element_per_request():
    limits.set_max_request_elements(1)
    yield
    limits.set_max_request_elements(limits.DEFAULT_MAX_REQUEST_ELEMENTS)


def test_examples_count_against_the_request_element_limit(examples_model, one_element_per_request):
    assert status_of(run_classify, examples_model, classification_request()) == (
        INVALID, "Input has 2 examples; the server allows at most 1 per request (--max_request_elements)")
    assert len(run_regress(examples_model, regression_request(rows=ROWS[:1])).result.regressions) == 1


def test_a_context_copied_into_many_examples_is_bounded(examples_model):
    """A 1 MB context and 100 empty examples would be 100 MB of rows (util.cc copies the context into each)."""
    request = regression_request(rows=[])
    request.input.example_list_with_context.context.features.feature["pad"].bytes_list.value.append(b"x" * (1 << 20))
    request.input.example_list_with_context.examples.extend([tf.train.Example()] * 100)
    code, message = status_of(run_regress, examples_model, request)
    assert code == INVALID and message.startswith("Input's context of 1048") and "bytes of copies" in message
