"""Runner: loads our mixed-precision exports and foreign models, validates inputs, honours the policy.

TF1 SavedModels (TF Serving's fixtures) run in a Session the way TF Serving runs them: no shape check,
the graph's own dtypes, state kept per loaded version; expected values come from TF Serving's tests.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from serving.servable.runner import InputError, LoadError, PolicyMismatch, Runner, RunnerClosed, SignatureNotFound
from serving.servable.saved_model import count_compute_ops

X = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)


def build_tiny_model(policy: str) -> keras.Model:
    """features [B, 8] -> Dense -> Dense logits (in `policy`) -> float32 logits and probabilities heads."""
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", dtype=policy)(inputs)
    logits = keras.layers.Dense(3, dtype=policy)(hidden)
    return keras.Model(inputs, {
        "logits": keras.layers.Activation("linear", dtype="float32", name="logits")(logits),
        "probabilities": keras.layers.Activation("softmax", dtype="float32", name="probabilities")(logits),
    })


def export_with_pipeline_json(model: keras.Model, version_dir: Path, policy: dict) -> Path:
    """Exports like pipeline/export/signatures.py (ExportArchive, no track()) and writes a hand-made pipeline.json."""
    archive = keras.export.ExportArchive()
    archive.add_endpoint("serving_default", lambda features: model(features, training=False),
                         input_signature=[tf.TensorSpec([None, 8], tf.float32, name="features")])
    archive.write_out(str(version_dir), verbose=False)
    metadata = {"format": 1, "model_name": "tiny", "version": int(version_dir.name), "policy": policy,
                "signatures": {"serving_default": {
                    "inputs": {"features": {"dtype": "float32", "shape": [None, 8]}},
                    "outputs": {name: {"dtype": "float32", "shape": [None, 3]} for name in ("logits", "probabilities")}}}}
    (version_dir / "assets.extra").mkdir()
    (version_dir / "assets.extra" / "pipeline.json").write_text(json.dumps(metadata))
    return version_dir


MIXED_FLOAT16 = {"name": "mixed_float16", "compute_dtype": "float16", "variable_dtype": "float32", "loss_scale": "dynamic"}


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    model = build_tiny_model("mixed_float16")
    base = tmp_path_factory.mktemp("runner") / "tiny"
    version_dir = export_with_pipeline_json(model, base / "3", MIXED_FLOAT16)
    expected = {name: keras.ops.convert_to_numpy(t) for name, t in model(X, training=False).items()}
    return version_dir, expected


@pytest.fixture(scope="module")
def runner(tiny_export):
    return Runner.load(tiny_export[0])


def test_load_reads_metadata_policy_and_compute_ops(runner, tiny_export):
    assert (runner.path, runner.version, runner.model_name) == (tiny_export[0], 3, "tiny")
    assert runner.policy == "mixed_float16" and runner.metadata["policy"] == MIXED_FLOAT16
    assert runner.compute_ops == {"float16": 2}
    assert "serving_default" in runner.signature_defs
    assert set(runner.signature_defs["serving_default"].inputs) == {"features"}


def test_load_base_path_takes_latest_version(tiny_export, tmp_path):
    shutil.copytree(tiny_export[0], tmp_path / "tiny" / "3")
    shutil.copytree(tiny_export[0], tmp_path / "tiny" / "10")
    assert Runner.load(tmp_path / "tiny").version == 10
    with pytest.raises(FileNotFoundError, match="no numeric version") as error:
        Runner.load(tmp_path)
    assert isinstance(error.value, LoadError)


def test_predict_returns_float32_outputs_equal_to_keras(runner, tiny_export):
    outputs = runner.predict({"features": X})
    assert sorted(outputs) == ["logits", "probabilities"]
    for name, expected in tiny_export[1].items():
        assert outputs[name].dtype == np.float32
        np.testing.assert_allclose(outputs[name], expected, rtol=0, atol=1e-6)


def test_output_filter(runner):
    assert list(runner.predict({"features": X}, output_filter=["probabilities"])) == ["probabilities"]
    with pytest.raises(InputError, match=r"^output tensor alias not found in signature: nope Outputs expected to be "
                                         r"in the set \{logits,probabilities\}\.$"):
        runner.predict({"features": X}, output_filter=["nope"])
    with pytest.raises(InputError, match=r"^duplicate output tensor alias: logits$"):
        runner.predict({"features": X}, output_filter=["logits", "logits"])


@pytest.mark.parametrize("inputs, message", [  # TF Serving's words (predict_util.cc, saved_model/util.cc)
    ({}, r"^input size does not match signature: 0!=1 len\(\{\}\) != len\(\{features\}\)\. Sent extra: \{\}\. "
         r"Missing but required: \{features\}\.$"),
    ({"features": X, "foo": X}, r"^input size does not match signature: 2!=1 len\(\{features,foo\}\) != "
                                r"len\(\{features\}\)\. Sent extra: \{foo\}\. Missing but required: \{\}\.$"),
    ({"foo": X}, r"^Signature input alias: features\(feed name: serving_default_features:0\) not found in request "
                 r"and no default value provided\. Inputs expected to be in the request \{foo\}, or default input "
                 r"alias set: $"),
    ({"features": X.astype(np.float64)}, r"^Expects arg\[0\] to be float but double is provided \(input 'features'\)$"),
    ({"features": X.astype(np.float16)}, r"^Expects arg\[0\] to be float but half is provided \(input 'features'\)$"),
    ({"features": np.zeros((3, 10), np.float32)}, r"^input 'features': expected shape \[-1, 8\], got \[3, 10\]$"),
    ({"features": np.zeros(8, np.float32)}, r"^input 'features': expected shape \[-1, 8\], got \[8\]$"),
])
def test_bad_inputs_are_refused_before_the_model_runs(runner, inputs, message):
    with pytest.raises(InputError, match=message):
        runner.predict(inputs)


def test_empty_batch_is_allowed(runner):
    assert runner.predict({"features": np.zeros((0, 8), np.float32)})["probabilities"].shape == (0, 3)


def test_unknown_signature_lists_available_ones(runner):
    with pytest.raises(SignatureNotFound, match=r'^Serving signature key "nope" not found\. Model tiny has: serving_default$'):
        runner.predict({"features": X}, signature_name="nope")
    assert issubclass(SignatureNotFound, KeyError)


def test_policy_mismatch_refuses_float32_graph_labelled_float16(tmp_path):
    version_dir = export_with_pipeline_json(build_tiny_model("float32"), tmp_path / "1", MIXED_FLOAT16)
    with pytest.raises(PolicyMismatch, match=r"computes in float16, but the serving graph's MatMul/Conv ops are float32 x2"):
        Runner.load(version_dir)
    assert issubclass(PolicyMismatch, LoadError)


def test_weights_are_read_reported_and_checked_against_the_recorded_policy(tmp_path, runner, caplog):
    parameters = 8 * 16 + 16 + 16 * 3 + 3
    assert runner.weights == {"float32": parameters * 4} and "weights float32 780 B" in runner.describe()
    bfloat16 = {"name": "bfloat16", "compute_dtype": "bfloat16", "variable_dtype": "bfloat16", "loss_scale": "none"}
    half = export_with_pipeline_json(build_tiny_model("bfloat16"), tmp_path / "1", bfloat16)
    with caplog.at_level("INFO", logger="serving.servable.runner"):
        loaded = Runner.load(half)  # the server's load line is this one
    assert loaded.weights == {"bfloat16": parameters * 2}
    assert "policy bfloat16 (compute bfloat16, variables bfloat16), MatMul/Conv ops bfloat16 x2, weights bfloat16 " \
           "390 B" in caplog.text
    loaded.close()
    mislabelled = export_with_pipeline_json(build_tiny_model("mixed_bfloat16"), tmp_path / "2", bfloat16)
    with pytest.raises(PolicyMismatch, match=r"stores its weights in bfloat16, but the version's variables are "
                                             r"float32 780 B; refusing to load it"):
        Runner.load(mislabelled)


def test_count_compute_ops_sees_inside_keras_functions(runner):
    signature = tf.saved_model.load(str(runner.path)).signatures["serving_default"]
    assert count_compute_ops(signature) == {"float16": 2}


def test_tf1_half_plus_two_fixture(tmp_path, copy_testdata):
    base = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    runner = Runner.load(base)
    assert (runner.version, runner.model_name, runner.metadata, runner.policy) == (123, "half_plus_two", None, "unknown")
    y = runner.predict({"x": np.array([[1.0], [2.0], [5.0]], np.float32)})["y"]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, [[2.5], [3.0], [4.5]])


def test_foreign_float16_output_stays_float16(tmp_path, write_float16_model):
    runner = Runner.load(write_float16_model(tmp_path / "1"))
    assert runner.metadata is None and runner.policy == "unknown"
    y = runner.predict({"x": np.array([[1.0, 3.0]], np.float32)})["y"]
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, [[0.5, 1.5]])


# --- TF1 SavedModels: served in a Session, as TF Serving serves them --------------------------------

def tf_example(**features: float) -> bytes:
    """A serialized tf.Example with one float feature per keyword, as TF Serving's Classify/Regress send."""
    feature = {name: tf.train.Feature(float_list=tf.train.FloatList(value=[value])) for name, value in features.items()}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_tf1_matmul_model(version_dir: Path) -> Path:
    """A TF1 SavedModel (SavedModelBuilder): y = x @ [[1], [2]], x float32 [None, 2]."""
    v1 = tf.compat.v1
    with tf.Graph().as_default(), v1.Session() as session:
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        y = tf.matmul(x, v1.get_variable("w", initializer=[[1.0], [2.0]]), name="y")
        session.run(v1.global_variables_initializer())
        builder = v1.saved_model.Builder(str(version_dir))
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={
            "serving_default": v1.saved_model.predict_signature_def({"x": x}, {"y": y})})
        builder.save()
    return version_dir


@pytest.fixture(scope="module")
def half_plus_two(tmp_path_factory, copy_testdata):
    return Runner.load(copy_testdata("saved_model_half_plus_two_cpu", tmp_path_factory.mktemp("hp2") / "half_plus_two"))


def test_tf1_feeds_any_shape_as_tf_serving_does(half_plus_two):
    """No shape check: TF Serving's own tests send [] and [1] to this (-1, 1) input (predict_impl_test.cc,
    tensorflow_model_server_test.py) and [[1, 2], [3, 4]] over REST (http_rest_api_handler_test.cc)."""
    predict = lambda x: half_plus_two.predict({"x": np.array(x, np.float32)})["y"]  # noqa: E731
    assert predict(2.0).shape == () and predict(2.0) == 3.0
    np.testing.assert_array_equal(predict([2.0]), [3.0])
    np.testing.assert_array_equal(predict([[1.0, 2.0], [3.0, 4.0]]), [[2.5, 3.0], [3.5, 4.0]])
    assert predict(np.zeros((0, 1))).shape == (0, 1)
    np.testing.assert_array_equal(half_plus_two.predict({"inputs": np.float32(2.0)}, "regress_x2_to_y3")["outputs"], 4.0)


def test_tf1_still_checks_dtypes(half_plus_two):
    with pytest.raises(InputError, match=r"^Expects arg\[0\] to be float but double is provided \(input 'x'\)$"):
        half_plus_two.predict({"x": np.array([[1.0]])})
    with pytest.raises(InputError, match=r"^Expects arg\[0\] to be float but string is provided \(input 'x'\)$"):
        half_plus_two.predict({"x": np.array([b"1"], dtype=object)})
    with pytest.raises(InputError, match=r"^Expects arg\[0\] to be string but object is provided \(input 'inputs'\)$"):
        half_plus_two.predict({"inputs": np.array([1, 2], dtype=object)}, "regress_x_to_y")


def test_tf1_runtime_errors_are_input_errors(tmp_path, half_plus_two):
    """TF Serving passes the session's INVALID_ARGUMENT through; InputError is what the server maps to it."""
    matmul = Runner.load(write_tf1_matmul_model(tmp_path / "1"))
    np.testing.assert_array_equal(matmul.predict({"x": np.array([[1.0, 1.0]], np.float32)})["y"], [[3.0]])
    with pytest.raises(InputError, match=r"^signature 'serving_default': Matrix size-incompatible: In\[0\]: \[3,3\]"):
        matmul.predict({"x": np.ones((3, 3), np.float32)})
    with pytest.raises(InputError, match=r"^signature 'regress_x_to_y': Could not parse example input"):
        half_plus_two.predict({"inputs": np.array([b"not a tf.Example"], dtype=object)}, "regress_x_to_y")


@pytest.mark.parametrize("fixture", ["saved_model_half_plus_two_cpu", "saved_model_half_plus_two_tf2_cpu"])
def test_string_inputs_on_both_backends(tmp_path, copy_testdata, fixture):
    """Serialized tf.Examples into classify/regress signatures; values from http_rest_api_handler_test.cc."""
    runner = Runner.load(copy_testdata(fixture, tmp_path / "m"))
    examples = lambda *xs: np.array([tf_example(x=x) for x in xs], dtype=object)  # noqa: E731
    np.testing.assert_array_equal(runner.predict({"inputs": examples(80.0)}, "regress_x_to_y")["outputs"], [[42.0]])
    np.testing.assert_array_equal(runner.predict({"inputs": examples(20.0, 10.0)}, "classify_x_to_y")["scores"],
                                  [[12.0], [7.0]])
    np.testing.assert_array_equal(runner.predict({"inputs": examples(2.0)}, "regress_x_to_y2")["outputs"], [[4.0]])
    as_list = [tf_example(x=2.0)]  # a list of bytes works too (kept as bytes objects: no NUL-stripping)
    np.testing.assert_array_equal(runner.predict({"inputs": as_list}, "regress_x_to_y")["outputs"], [[3.0]])


def test_tf2_still_checks_shapes(tmp_path, copy_testdata):
    runner = Runner.load(copy_testdata("saved_model_half_plus_two_tf2_cpu", tmp_path / "m"))
    np.testing.assert_array_equal(runner.predict({"x": np.array([2.0], np.float32)})["y"], [3.0])
    with pytest.raises(InputError, match=r"^input 'x': expected shape \[1\], got \[2\]$"):
        runner.predict({"x": np.array([2.0, 3.0], np.float32)})


def test_half_plus_three_signature_defs_that_misstate_the_graph(tmp_path, copy_testdata):
    """serving_default declares x as shape () and the regress signature DT_FLOAT for a string placeholder;
    like TF Serving, the graph decides. tf.saved_model.load cannot load this model at all."""
    runner = Runner.load(copy_testdata("saved_model_half_plus_three", tmp_path / "hp3"))
    assert runner.signature_names == ["serving_default", "tensorflow/serving/regress"]
    np.testing.assert_array_equal(runner.predict({"x": np.array([2.0], np.float32)})["y"], [4.0])  # TF Serving: 4.0
    examples = np.array([tf_example(x=1.0), tf_example(x=2.0)], dtype=object)
    np.testing.assert_array_equal(runner.predict({"inputs": examples}, "tensorflow/serving/regress")["outputs"],
                                  [[3.5], [4.0]])
    with pytest.raises(InputError, match=r"^Expects arg\[0\] to be string but float is provided \(input 'inputs'\)$"):
        runner.predict({"inputs": np.array([1.0], np.float32)}, "tensorflow/serving/regress")


def test_counter_keeps_state_per_loaded_version(tmp_path, copy_testdata):
    """TF Serving's predict_impl_test.cc PredictionWithCustomizedSignatures, then the same from 4 threads."""
    base = copy_testdata("saved_model_counter", tmp_path / "counter")
    runner = Runner.load(base)
    assert runner.signature_names == ["get_counter", "incr_counter", "incr_counter_by", "reset_counter"]
    call = lambda signature, **inputs: runner.predict(inputs, signature)["output"]  # noqa: E731
    assert [call("get_counter"), call("incr_counter"), call("reset_counter"), call("incr_counter")] == [0, 1, 0, 1]
    assert call("incr_counter_by", delta=np.float32(3)) == 4
    assert call("get_counter").dtype == np.float32 and call("get_counter").shape == ()

    threads = [threading.Thread(target=lambda: [call("incr_counter") for _ in range(25)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert call("get_counter") == 104
    assert Runner.load(base).predict({}, "get_counter")["output"] == 0  # another load, another session


@pytest.mark.parametrize("fixture", ["bad_half_plus_two", "saved_model_half_plus_two_cpu"])
def test_failed_loads_are_load_errors_in_one_line(tmp_path, copy_testdata, fixture):
    base = copy_testdata(fixture, tmp_path / "m")
    if fixture == "saved_model_half_plus_two_cpu":  # a corrupt saved_model.pb
        (base / "00000123" / "saved_model.pb").write_bytes(b"not a protobuf")
    with pytest.raises(LoadError) as error:
        Runner.load(base)
    assert "\n" not in str(error.value) and str(error.value).startswith(str(base / "00000123"))
    if fixture == "bad_half_plus_two":  # TF Serving: "Could not find SavedModel .pb or .pbtxt ..."
        assert isinstance(error.value, FileNotFoundError)
        assert "could not find SavedModel .pb or .pbtxt" in str(error.value) and "SessionBundle" in str(error.value)
        with pytest.raises(LoadError) as from_version_dir:  # what a model manager passes
            Runner.load(base / "00000123")
        assert str(from_version_dir.value) == str(error.value)


@pytest.mark.parametrize("fixture", ["saved_model_half_plus_two_cpu", "saved_model_half_plus_two_tf2_cpu"])
def test_close_refuses_new_calls_and_is_idempotent(tmp_path, copy_testdata, fixture):
    runner = Runner.load(copy_testdata(fixture, tmp_path / "m"))
    runner.close()
    runner.close()
    with pytest.raises(RunnerClosed, match=r"version 123 has been unloaded"):
        runner.predict({"x": np.array([2.0], np.float32)})


def test_close_waits_for_running_predict_then_closes_the_session(tmp_path, copy_testdata, monkeypatch):
    runner = Runner.load(copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "m"))
    started, release, results = threading.Event(), threading.Event(), []
    call = runner._model.call

    def slow_call(*args):
        started.set()
        release.wait(10)
        return call(*args)

    monkeypatch.setattr(runner._model, "call", slow_call)
    request = threading.Thread(target=lambda: results.append(runner.predict({"x": np.array([2.0], np.float32)})))
    request.start()
    assert started.wait(10)
    closer = threading.Thread(target=runner.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not runner._model._session._closed  # waiting for the request
    release.set()
    request.join(10)
    closer.join(10)
    assert results[0]["y"] == [3.0] and runner._model._session._closed


@pytest.mark.subprocess  # grappler's options are process-wide: a fresh process shows what loading did
def test_loading_a_float16_model_on_a_cpu_turns_off_the_slow_float16_fusion(tiny_export):
    """oneDNN's fused float16 MatMul+BiasAdd is hundreds of times slower on AVX512_FP16 CPUs
    (docs/keras3-mixed-precision.md §11): loading a float16 graph turns grappler's remapper off before
    the model first runs; a float32 graph leaves it alone."""
    import subprocess
    import sys

    script = ("import sys, tensorflow as tf\n"
              "from serving.servable.runner import Runner\n"
              "Runner.load(sys.argv[1])\n"
              "print(tf.config.optimizer.get_experimental_options().get('remapping', True))\n")
    float32_dir = export_with_pipeline_json(build_tiny_model("float32"), tiny_export[0].parent.with_name("f32") / "1",
                                            {"name": "float32", "compute_dtype": "float32", "variable_dtype": "float32"})
    answers = {}
    for name, version_dir in (("float16", tiny_export[0]), ("float32", float32_dir)):
        result = subprocess.run([sys.executable, "-c", script, str(version_dir)], capture_output=True, text=True,
                                timeout=120, cwd=Path(__file__).resolve().parents[3])
        answers[name] = result.stdout.strip().splitlines()[-1]
    gpu = bool(tf.config.list_physical_devices("GPU"))
    assert answers == {"float16": str(gpu), "float32": "True"}  # with a GPU the fusion is kept
