"""Every servable model in TF Serving's test data, served by `python -m serving`, answers as TF Serving does.

The requests and expected answers are TF Serving's own, from
  tensorflow_serving/model_servers/tensorflow_model_server_test.py    (VerifyPredictRequest: x = [2.0], shape [1])
  tensorflow_serving/servables/tensorflow/predict_impl_test.cc         (scalar x, named signatures, the counter)
  tensorflow_serving/model_servers/http_rest_api_handler_test.cc       (batches, regress/classify values)
and GetModelMetadata is compared with TF Serving's JSON fixtures in the test data.

No TF2 two-version directory ships with the test data, yet saved_model_half_plus_two_tf2_2_versions_metadata.json
describes one: its SignatureDefs are exactly saved_model_half_plus_two_tf2_cpu's, so the test serves two
copies of that model as versions 123 and 124 (under its own name: the TF1 two-version model has the
fixture's name, saved_model_half_plus_two_2_versions).

One server (--model_config_file: good_model_config.txt plus the other fixtures) serves them all, because
starting one costs an import of TensorFlow; only the counter has state, and one test owns it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import json_format, text_format
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

pytestmark = pytest.mark.timeout(240)

REPO_ROOT = Path(__file__).resolve().parents[2]
TWO_VERSIONS = "saved_model_half_plus_two_2_versions"  # the model name in both two-version metadata fixtures
TF2_TWO_VERSIONS = "saved_model_half_plus_two_tf2_2_versions"  # served beside it, so under another name


@pytest.fixture(scope="module")
def model_config(tmp_path_factory, copy_testdata, tfserving_testdata):
    """good_model_config.txt (half_plus_two, half_plus_three) with the other servable fixtures added."""
    root = tmp_path_factory.mktemp("fixtures")
    copy = lambda name: copy_testdata(name, root / name)  # noqa: E731
    half_plus_two, tf2 = copy("saved_model_half_plus_two_cpu"), copy("saved_model_half_plus_two_tf2_cpu")
    tf2_versions = root / "saved_model_half_plus_two_tf2_2_versions"
    for version in ("00000123", "00000124"):
        shutil.copytree(tf2 / "00000123", tf2_versions / version)
    template = (tfserving_testdata / "good_model_config.txt").read_text()
    config = text_format.Parse(template.replace("${TEST_HALF_PLUS_TWO_DIR}", str(half_plus_two))
                                       .replace("${TEST_HALF_PLUS_THREE_DIR}", str(copy("saved_model_half_plus_three"))),
                               model_server_config_pb2.ModelServerConfig())
    for name, base_path in (("default", half_plus_two), ("test_model", copy("saved_model_counter")),
                            (TWO_VERSIONS, copy(TWO_VERSIONS)), ("half_plus_two_tf2", tf2),
                            (TF2_TWO_VERSIONS, tf2_versions)):
        config.model_config_list.config.add(name=name, base_path=str(base_path), model_platform="tensorflow")
    path = root / "models.config"
    path.write_text(text_format.MessageToString(config))
    return path


@pytest.fixture(scope="module")
def bad_model_server(tmp_path_factory, copy_testdata):
    """`python -m serving` on bad_half_plus_two, started first so that it runs beside the main server."""
    root = tmp_path_factory.mktemp("bad")
    base_path = copy_testdata("bad_half_plus_two", root / "bad_half_plus_two")
    with open(root / "stderr", "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "serving", "--port", "0", "--model_name", "default",
                                    "--model_base_path", str(base_path),
                                    "--max_num_load_retries=0"],  # fail at once, not after TF Serving's 5 retries
                                   cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    yield process, root / "stderr"
    if process.poll() is None:
        process.kill()
    process.wait()
    process.stdout.close()


@pytest.fixture(scope="module")
def server(model_config, start_server, tmp_path_factory, bad_model_server):
    """One server for all the fixtures: importing TensorFlow dominates a server's start on 2 cores."""
    process = start_server(f"--model_config_file={model_config}", log_dir=tmp_path_factory.mktemp("server"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def request_for(model: str, signature: str = "", **inputs: tensor_pb2.TensorProto) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    if signature:
        request.model_spec.signature_name = signature
    for name, proto in inputs.items():
        request.inputs[name].CopyFrom(proto)
    return request


def floats(*values: float, shape: list[int] | None = None) -> tensor_pb2.TensorProto:
    """A DT_FLOAT TensorProto in float_val, as TF Serving's tests build them (no tensor_shape = a scalar)."""
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=values)
    for size in shape or []:
        proto.tensor_shape.dim.add().size = size
    return proto


def examples(*xs: float) -> tensor_pb2.TensorProto:
    """Serialized tf.Examples {x: value} as a DT_STRING tensor, what Classify/Regress feed a signature."""
    serialized = [tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=[x]))})).SerializeToString() for x in xs]
    return tf.make_tensor_proto(np.array(serialized, dtype=object))


def verify_predict_request(stub, model: str, expected_output: float, expected_version: int,
                           specify_output: bool = True, signature_name: str = "serving_default") -> None:
    """tensorflow_model_server_test.py's VerifyPredictRequest: x = float_val [2.0] with shape [1]."""
    request = request_for(model, signature_name, x=floats(2.0, shape=[1]))
    if specify_output:
        request.output_filter.append("y")
    result = stub.Predict(request, timeout=10)
    assert "y" in result.outputs
    assert result.outputs["y"].dtype == types_pb2.DT_FLOAT
    assert list(result.outputs["y"].float_val) == [expected_output]
    assert (result.model_spec.name, result.model_spec.signature_name, result.model_spec.version.value) == \
        (model, signature_name, expected_version)


def expected_response(model: str, signature: str, version: int, **outputs: float) -> predict_pb2.PredictResponse:
    """predict_impl_test.cc's expected responses: scalar DT_FLOAT outputs with an empty tensor_shape."""
    response = predict_pb2.PredictResponse()
    response.model_spec.name, response.model_spec.signature_name = model, signature
    response.model_spec.version.value = version
    for name, value in outputs.items():
        response.outputs[name].CopyFrom(floats(value))
        response.outputs[name].tensor_shape.SetInParent()
    return response


def served_signature_defs(stub, model: str) -> tuple[get_model_metadata_pb2.GetModelMetadataResponse,
                                                     get_model_metadata_pb2.SignatureDefMap]:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = model
    response = stub.GetModelMetadata(request, timeout=10)
    signature_defs = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signature_defs)
    return response, signature_defs


def fixture_metadata(tfserving_testdata, filename: str) -> tuple[get_model_metadata_pb2.GetModelMetadataResponse,
                                                                 get_model_metadata_pb2.SignatureDefMap]:
    """TF Serving's JSON fixture (the REST form of GetModelMetadata) as model_spec and SignatureDefMap protos."""
    fixture = json.loads((tfserving_testdata / filename).read_text())
    response = json_format.ParseDict({"model_spec": fixture["model_spec"]},
                                     get_model_metadata_pb2.GetModelMetadataResponse())
    signature_defs = json_format.ParseDict(fixture["metadata"]["signature_def"],
                                           get_model_metadata_pb2.SignatureDefMap(), ignore_unknown_fields=True)
    return response, signature_defs


def test_predict_half_plus_two(stub):
    """testPredictSavedModel: saved_model_half_plus_two_cpu as 'default' answers 3.0, with and without output_filter."""
    verify_predict_request(stub, "default", expected_output=3.0, expected_version=123)
    verify_predict_request(stub, "default", expected_output=3.0, expected_version=123, specify_output=False)


def test_good_model_config_half_plus_two_and_half_plus_three(stub):
    """testGoodModelConfig: half_plus_two 3.0 and half_plus_three 4.0 from good_model_config.txt.

    half_plus_three's serving_default declares x with shape () over a (-1, 1) placeholder, and
    tf.saved_model.load cannot load it; TF Serving (and we) feed x:0 by name in a Session.
    """
    for model, expected in (("half_plus_two", 3.0), ("half_plus_three", 4.0)):
        for specify_output in (True, False):
            verify_predict_request(stub, model, expected, 123, specify_output=specify_output)


def test_predict_impl_scalar_inputs_and_named_signatures(stub):
    """predict_impl_test.cc PredictionSuccess and PredictionWithNamedRegressionSignature: a scalar
    float_val 2.0 (no tensor_shape) into a (-1, 1) input answers a scalar, 3 and 4."""
    response = stub.Predict(request_for("default", x=floats(2.0)), timeout=10)
    assert response == expected_response("default", "serving_default", 123, y=3.0)
    response = stub.Predict(request_for("default", "regress_x2_to_y3", inputs=floats(2.0)), timeout=10)
    assert response == expected_response("default", "regress_x2_to_y3", 123, outputs=4.0)


def test_predict_batches_of_any_shape(stub):
    """http_rest_api_handler_test.cc Predict: [[1, 2], [3, 4]] -> [[2.5, 3], [3.5, 4]] and [1, 2] -> [2.5, 3]."""
    for x, y in (([[1.0, 2.0], [3.0, 4.0]], [[2.5, 3.0], [3.5, 4.0]]), ([1.0, 2.0], [2.5, 3.0])):
        request = request_for("default", x=tf.make_tensor_proto(np.array(x, np.float32)))
        np.testing.assert_array_equal(tf.make_ndarray(stub.Predict(request, timeout=10).outputs["y"]), y)


@pytest.mark.parametrize("model", ["default", "half_plus_two_tf2"])
def test_string_inputs_classify_and_regress_signatures(stub, model):
    """Serialized tf.Examples through Predict, TF1 and TF2: http_rest_api_handler_test.cc's Regress
    (x = 80 -> 42) and Classify (x = 20 -> 12), tensorflow_model_server_test.py's (x = 2 -> 3)."""
    for signature, output, xs, expected in (("regress_x_to_y", "outputs", (80.0, 2.0), [[42.0], [3.0]]),
                                            ("classify_x_to_y", "scores", (20.0, 2.0), [[12.0], [3.0]])):
        response = stub.Predict(request_for(model, signature, inputs=examples(*xs)), timeout=10)
        np.testing.assert_array_equal(tf.make_ndarray(response.outputs[output]), expected)


def test_counter_state_per_loaded_version(stub):
    """predict_impl_test.cc PredictionWithCustomizedSignatures: get 0, incr 1, reset 0, incr 1, incr_by(3) 4."""
    calls = [("get_counter", {}, 0.0), ("incr_counter", {}, 1.0), ("reset_counter", {}, 0.0),
             ("incr_counter", {}, 1.0), ("incr_counter_by", {"delta": floats(3.0)}, 4.0)]
    for i, (signature, inputs, expected) in enumerate(calls):
        request = request_for("test_model", signature, **inputs)
        if i == 3:
            request.output_filter.append("output")
        response = stub.Predict(request, timeout=10)
        assert response == expected_response("test_model", signature, 123, output=expected), signature


def test_half_plus_two_metadata_matches_tf_serving(stub, tfserving_testdata):
    """testGetModelMetadataREST: half_plus_two_model_metadata.json, model_spec included."""
    served, signature_defs = served_signature_defs(stub, "default")
    expected, expected_signature_defs = fixture_metadata(tfserving_testdata, "half_plus_two_model_metadata.json")
    assert served.model_spec == expected.model_spec
    assert signature_defs == expected_signature_defs


def test_two_versions_tf1_serves_latest_and_matches_metadata(stub, tfserving_testdata):
    """saved_model_half_plus_two_2_versions: 124 is the latest. Its metadata fixture was recorded with
    a specific-version policy pinned to 123 (http_rest_api_handler_test.cc); both versions have the
    same SignatureDefs, so only the version number differs."""
    verify_predict_request(stub, TWO_VERSIONS, expected_output=3.0, expected_version=124)
    response = stub.Predict(
        request_for(TWO_VERSIONS, "classify_x2_to_y3", inputs=floats(2.0)), timeout=10)
    assert response == expected_response(TWO_VERSIONS, "classify_x2_to_y3", 124, scores=4.0)  # PredictionWithNamedClassificationSignature
    served, signature_defs = served_signature_defs(stub, TWO_VERSIONS)
    expected, expected_signature_defs = fixture_metadata(tfserving_testdata, "saved_model_half_plus_two_2_versions_metadata.json")
    assert (served.model_spec.name, served.model_spec.version.value) == (expected.model_spec.name, 124)
    assert expected.model_spec.version.value == 123
    assert signature_defs == expected_signature_defs


def test_tf2_models_predict_and_match_metadata(stub, tfserving_testdata):
    """saved_model_half_plus_two_tf2_cpu (x has shape [1]) answers 3.0; two copies of it as 123/124
    match saved_model_half_plus_two_tf2_2_versions_metadata.json, __saved_model_init_op included, but
    for one field the fixture predates."""
    verify_predict_request(stub, "half_plus_two_tf2", expected_output=3.0, expected_version=123)
    verify_predict_request(stub, TF2_TWO_VERSIONS, expected_output=3.0, expected_version=124)
    served, signature_defs = served_signature_defs(stub, TF2_TWO_VERSIONS)
    expected, expected_signature_defs = fixture_metadata(tfserving_testdata,
                                                         "saved_model_half_plus_two_tf2_2_versions_metadata.json")
    assert served.model_spec.version.value == 124 and expected.model_spec.name == TWO_VERSIONS
    # The shipped model was re-exported (TF 2.14) after the fixture was recorded, and its serving_default
    # now also carries SignatureDef.defaults (x = 0.0); everything else is identical.
    serving_default = signature_defs.signature_def["serving_default"]
    assert tf.make_ndarray(serving_default.defaults["x"]).tolist() == [0.0]
    serving_default.ClearField("defaults")
    assert signature_defs == expected_signature_defs


@pytest.mark.parametrize("x, message", [
    (examples(2.0), "Expects arg[0] to be float but string is provided (input 'x')"),  # predict_util.cc
    (tf.make_tensor_proto(np.array([2.0])), "Expects arg[0] to be float but double is provided (input 'x')"),
])
def test_wrong_dtype_is_invalid_argument(stub, x, message):
    with pytest.raises(grpc.RpcError) as error:
        stub.Predict(request_for("default", x=x), timeout=10)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_session_errors_are_invalid_argument(stub):
    """A TF1 model's runtime error (the session rejecting the values) is TF's INVALID_ARGUMENT, not INTERNAL."""
    bad = tf.make_tensor_proto(np.array([b"not a tf.Example"], dtype=object))
    with pytest.raises(grpc.RpcError) as error:
        stub.Predict(request_for("default", "regress_x_to_y", inputs=bad), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("signature 'regress_x_to_y': Could not parse example input")
    verify_predict_request(stub, "default", expected_output=3.0, expected_version=123)  # still serving


def test_bad_half_plus_two_fails_to_load(server, bad_model_server):
    """bad_half_plus_two is a legacy SessionBundle, not a SavedModel: like tensorflow_model_server, the
    server reports the load error ("Could not find SavedModel .pb or .pbtxt") and does not serve."""
    process, stderr_path = bad_model_server
    try:
        stdout, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the server kept running with a model that cannot load; stderr:\n{stderr_path.read_text()[-2000:]}")
    assert process.returncode != 0 and "Running gRPC ModelServer" not in stdout
    assert "could not find SavedModel .pb or .pbtxt" in stderr_path.read_text()
