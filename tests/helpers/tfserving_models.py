"""TF Serving's test data (tensorflow_serving/servables/tensorflow/testdata/, Apache-2.0), rebuilt by code.

The suite serves these models to reproduce TF Serving's own tests, so a plain clone must have them without
a copy of TF Serving's tree. Each writer follows the TF Serving script that made the shipped model
(saved_model_half_plus_two.py, export_counter.py, export_bad_half_plus_two.py, in that directory);
where the shipped model comes from an older revision of a script (half_plus_three, the two-version model),
the writer follows the model as its saved_model.pb reads. What must match TF Serving's is written down
once, below: every SignatureDef (keys, tensor names, dtypes, shapes, method names) and every variable's
value; tests/serving/test_tfserving_models.py checks both the built tree and TF Serving's own against it.

    .venv/bin/python tests/helpers/tfserving_models.py OUT_DIR     # writes the tree, as build() does
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

VERSION = "00000123"  # every fixture's version directory; the two-version model adds 00000124

# --- What TF Serving's fixtures hold (the form of GetModelMetadata's JSON, as its *_metadata.json) -------


def _tensor(name: str, dtype: str = "DT_FLOAT", shape: tuple[int, ...] | None = (-1, 1)) -> dict:
    """A TensorInfo as TF Serving's JSON prints it; shape None is an unknown rank, () a scalar."""
    return {"dtype": dtype,
            "tensor_shape": {"dim": [{"size": str(size), "name": ""} for size in shape or ()],
                             "unknown_rank": shape is None},
            "name": name}


def _signature(method: str, inputs: dict, outputs: dict) -> dict:
    return {"inputs": inputs, "outputs": outputs, "method_name": f"tensorflow/serving/{method}", "defaults": {}}


_EXAMPLES = _tensor("tf_example:0", "DT_STRING", None)  # serialized tf.Examples, parsed in the graph

# TF1 half_plus_two (saved_model_half_plus_two_cpu), in half_plus_two_model_metadata.json's order.
HALF_PLUS_TWO_TF1 = {
    "regress_x2_to_y3": _signature("regress", {"inputs": _tensor("x2:0")}, {"outputs": _tensor("y3:0")}),
    "serving_default": _signature("predict", {"x": _tensor("x:0")}, {"y": _tensor("y:0")}),
    "classify_x_to_y": _signature("classify", {"inputs": _EXAMPLES}, {"scores": _tensor("y:0")}),
    "regress_x_to_y2": _signature("regress", {"inputs": _EXAMPLES}, {"outputs": _tensor("y2:0")}),
    "regress_x_to_y": _signature("regress", {"inputs": _EXAMPLES}, {"outputs": _tensor("y:0")}),
}
# saved_model_half_plus_two_2_versions: an older export of the same script, which also had classify_x2_to_y3.
HALF_PLUS_TWO_TF1_2_VERSIONS = {
    **{key: HALF_PLUS_TWO_TF1[key] for key in ("regress_x2_to_y3", "serving_default", "classify_x_to_y")},
    "classify_x2_to_y3": _signature("classify", {"inputs": _tensor("x2:0")}, {"scores": _tensor("y3:0")}),
    **{key: HALF_PLUS_TWO_TF1[key] for key in ("regress_x_to_y2", "regress_x_to_y")},
}


def _tf2_signature(key: str, input_name: str, dtype: str, input_shape: tuple, output: str, output_shape: tuple,
                   call: int) -> dict:
    """tf.saved_model.save names inputs <key>_<arg> and outputs StatefulPartitionedCall_<n> (n by sorted key)."""
    suffix = f"_{call}" if call else ""
    return _signature("predict", {input_name: _tensor(f"{key}_{input_name}:0", dtype, input_shape)},
                      {output: _tensor(f"StatefulPartitionedCall{suffix}:0", "DT_FLOAT", output_shape)})


# TF2 half_plus_two (saved_model_half_plus_two_tf2_cpu), in saved_model_half_plus_two_tf2_2_versions_metadata.json's order.
HALF_PLUS_TWO_TF2 = {
    "regress_x_to_y": _tf2_signature("regress_x_to_y", "inputs", "DT_STRING", (-1,), "outputs", (-1, 1), 3),
    "regress_x_to_y2": _tf2_signature("regress_x_to_y2", "inputs", "DT_STRING", (-1,), "outputs", (-1, 1), 4),
    "classify_x_to_y": _tf2_signature("classify_x_to_y", "inputs", "DT_STRING", (-1,), "scores", (-1, 1), 1),
    "serving_default": _tf2_signature("serving_default", "x", "DT_FLOAT", (1,), "y", (1,), 5),
    "regress_x2_to_y3": _tf2_signature("regress_x2_to_y3", "inputs", "DT_FLOAT", (1,), "outputs", (1,), 2),
    "classify_x2_to_y3": _tf2_signature("classify_x2_to_y3", "inputs", "DT_FLOAT", (1,), "scores", (1,), 0),
    "__saved_model_init_op": {"inputs": {}, "outputs": {"__saved_model_init_op": _tensor("NoOp", "DT_INVALID", None)},
                              "method_name": ""},
}
# saved_model_half_plus_three: SignatureDefs that misstate the graph (x is (-1, 1), tf_example a string), with
# no tensor_shape at all (TF 1.0 wrote none: a scalar).
HALF_PLUS_THREE = {
    "serving_default": _signature("predict", {"x": {"dtype": "DT_FLOAT", "name": "x:0"}},
                                  {"y": {"dtype": "DT_FLOAT", "name": "y:0"}}),
    "tensorflow/serving/regress": _signature("regress", {"inputs": {"dtype": "DT_FLOAT", "name": "tf_example:0"}},
                                             {"outputs": {"dtype": "DT_FLOAT", "name": "Identity:0"}}),
}
COUNTER = {
    "get_counter": _signature("predict", {}, {"output": _tensor("counter:0", "DT_FLOAT_REF", ())}),
    "incr_counter": _signature("predict", {}, {"output": _tensor("incr_counter_op/AssignAdd:0", "DT_FLOAT_REF", ())}),
    "incr_counter_by": _signature("predict", {"delta": _tensor("delta:0", "DT_FLOAT", None)},
                                  {"output": _tensor("incr_counter_by_op/AssignAdd:0", "DT_FLOAT_REF", ())}),
    "reset_counter": _signature("predict", {}, {"output": _tensor("reset_counter_op/Assign:0", "DT_FLOAT_REF", ())}),
}

# Every SavedModel fixture: its SignatureDefs and its variables' values (TF2: the tracked attribute's name).
SAVED_MODELS = {
    "saved_model_half_plus_two_cpu": (HALF_PLUS_TWO_TF1, {"a": 0.5, "b": 2.0, "c": 3.0, "a2": 0.5, "c2": 3.0}),
    "saved_model_half_plus_two_2_versions": (HALF_PLUS_TWO_TF1_2_VERSIONS, {"a": 0.5, "b": 2.0, "c": 3.0}),
    "saved_model_half_plus_two_tf2_cpu": (HALF_PLUS_TWO_TF2, {"a": 0.5, "b": 2.0, "c": 3.0}),
    "saved_model_half_plus_three": (HALF_PLUS_THREE, {"a": 0.5, "b": 3.0, "c": 3.0}),
    "saved_model_counter": (COUNTER, {"counter": 0.0}),
}
ASSET = ("foo.txt", "asset-file-contents")  # in assets/ of every half_plus_two/three

# The text files, byte for byte.
TEXT_FILES = {
    "bad_model_config.txt": "improperly formatted file",
    "batching_config.txt": "max_batch_size { value: 128 }\nbatch_timeout_micros { value: 0 }\n"
                           "max_enqueued_batches { value: 1000000 }\nnum_batch_threads { value: 8 }\n",
    "good_model_config.txt": 'model_config_list: {\n  config: {\n    name: "half_plus_two",\n'
                             '    base_path: "${TEST_HALF_PLUS_TWO_DIR}",\n    model_platform: "tensorflow"\n  },\n'
                             '  config: {\n    name: "half_plus_three",\n    base_path: "${TEST_HALF_PLUS_THREE_DIR}",\n'
                             '    model_platform: "tensorflow"\n  }\n}\n',
}
# GetModelMetadata's REST answers TF Serving recorded: (model_spec name, SignatureDefs).
METADATA_FILES = {
    "half_plus_two_model_metadata.json": ("default", HALF_PLUS_TWO_TF1),
    "saved_model_half_plus_two_2_versions_metadata.json": ("saved_model_half_plus_two_2_versions",
                                                           HALF_PLUS_TWO_TF1_2_VERSIONS),
    "saved_model_half_plus_two_tf2_2_versions_metadata.json": ("saved_model_half_plus_two_2_versions",
                                                               HALF_PLUS_TWO_TF2),
}


def metadata_json(model_name: str, signature_defs: dict) -> str:
    """A *_metadata.json fixture's text: model_spec at version 123 and the SignatureDefMap."""
    return json.dumps({"model_spec": {"name": model_name, "signature_name": "", "version": "123"},
                       "metadata": {"signature_def": {"signature_def": signature_defs}}}, indent=1) + "\n"


# --- Writers --------------------------------------------------------------------------------------------


def build(root: Path) -> Path:
    """Writes every fixture under root (laid out as TF Serving's testdata/) and returns root."""
    for name, text in TEXT_FILES.items():
        (root / name).write_text(text)
    for name, (model_name, signature_defs) in METADATA_FILES.items():
        (root / name).write_text(metadata_json(model_name, signature_defs))
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)  # the TF1 APIs' deprecation notices are expected here
    try:
        write_half_plus_two_tf1(root / "saved_model_half_plus_two_cpu" / VERSION)
        for version in (VERSION, "00000124"):
            write_half_plus_two_tf1(root / "saved_model_half_plus_two_2_versions" / version, tf_1_1=True)
        write_half_plus_two_tf2(root / "saved_model_half_plus_two_tf2_cpu" / VERSION)
        write_half_plus_three(root / "saved_model_half_plus_three" / VERSION)
        write_counter(root / "saved_model_counter" / VERSION)
        write_bad_half_plus_two(root / "bad_half_plus_two" / VERSION)
    finally:
        tf_logger.setLevel(level)
    return root


def _feature_spec(tf):
    """saved_model_half_plus_two.py's _get_feature_spec: tf.Examples with float features x and x2."""
    return {"x": tf.io.FixedLenFeature([1], dtype=tf.float32),
            "x2": tf.io.FixedLenFeature([1], dtype=tf.float32, default_value=[0.0])}


def _parse_tf_examples(tf, serialized, keys: tuple[str, ...]) -> dict:
    """TF 1.x's tf.parse_example (the ParseExample op of the shipped graphs) for float features of shape [1],
    x required, x2 defaulting to 0. Its outputs are (-1, 1) even when the fed placeholder has no shape, as
    in TF Serving's SignatureDefs; today's ParseExampleV2 would make them unknown."""
    defaults = {"x": tf.constant([], tf.float32), "x2": tf.constant([0.0])}
    with tf.name_scope("ParseExample"):
        parsed = tf.raw_ops.ParseExample(serialized=serialized, names=tf.constant([], tf.string), sparse_keys=[],
                                         dense_keys=[tf.constant(key) for key in keys],
                                         dense_defaults=[defaults[key] for key in keys], sparse_types=[],
                                         dense_shapes=[[1]] * len(keys), name="ParseExample")
    return dict(zip(keys, parsed.dense_values))


def _tf1_asset(v1, scratch: Path):
    """_create_asset_file: foo.txt in the assets collection, and an op that assigns its name (the main op)."""
    (scratch / ASSET[0]).write_text(ASSET[1])
    v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, v1.constant(str(scratch / ASSET[0])))
    filename = v1.Variable(ASSET[0], name="filename_tensor", trainable=False, collections=[], use_resource=False)
    return filename.assign(ASSET[0])


def _tf1_signature(v1, method: str, inputs: dict, outputs: dict):
    """build_signature_def over build_tensor_info, as the scripts do (no checks on what a method may take)."""
    info = lambda tensors: {key: v1.saved_model.utils.build_tensor_info(t) for key, t in tensors.items()}  # noqa: E731
    return v1.saved_model.signature_def_utils.build_signature_def(info(inputs), info(outputs),
                                                                  f"tensorflow/serving/{method}")


def _save_tf1(v1, session, version_dir: Path, signature_defs: dict, main_op=None) -> None:
    builder = v1.saved_model.Builder(str(version_dir))
    builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map=signature_defs,
                                         assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS),
                                         main_op=main_op)
    builder.save()


def write_half_plus_two_tf1(version_dir: Path, *, tf_1_1: bool = False) -> Path:
    """saved_model_half_plus_two.py (device cpu): y = a*x + b, y2 = a*x + c, y3 = a2*x2 + c2, x and x2 parsed
    from tf.Examples fed to tf_example. tf_1_1: the revision the two-version model was exported with
    (TF 1.1): y3 = a*x2 + c (no a2, c2) and one more signature, classify_x2_to_y3."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default(), v1.Session() as session, tempfile.TemporaryDirectory() as scratch:
        with tf.device("/cpu:0"):
            a = v1.Variable(0.5, name="a", use_resource=False)
            b = v1.Variable(2.0, name="b", use_resource=False)
            c = v1.Variable(3.0, name="c", use_resource=False)
            serialized = v1.placeholder(tf.string, name="tf_example")  # the shipped models: unknown rank
            example = _parse_tf_examples(tf, serialized, ("x", "x2"))
            x = tf.identity(example["x"], name="x")
            y = tf.identity(tf.add(tf.multiply(a, x), b), name="y")
            y2 = tf.identity(tf.add(tf.multiply(a, x), c), name="y2")
            x2 = tf.identity(example["x2"], name="x2")
            if tf_1_1:
                a2, c2 = a, c
            else:
                a2 = v1.Variable(0.5, name="a2", use_resource=False)
                c2 = v1.Variable(3.0, name="c2", use_resource=False)
            y3 = tf.identity(tf.add(tf.multiply(a2, x2), c2), name="y3")
        assign_filename = _tf1_asset(v1, Path(scratch))
        signature_defs = {
            "regress_x_to_y": _tf1_signature(v1, "regress", {"inputs": serialized}, {"outputs": y}),
            "regress_x_to_y2": _tf1_signature(v1, "regress", {"inputs": serialized}, {"outputs": y2}),
            "regress_x2_to_y3": _tf1_signature(v1, "regress", {"inputs": x2}, {"outputs": y3}),
            "classify_x_to_y": _tf1_signature(v1, "classify", {"inputs": serialized}, {"scores": y}),
            "serving_default": _tf1_signature(v1, "predict", {"x": x}, {"y": y}),
        }
        if tf_1_1:
            signature_defs["classify_x2_to_y3"] = _tf1_signature(v1, "classify", {"inputs": x2}, {"scores": y3})
        session.run(v1.global_variables_initializer())
        _save_tf1(v1, session, version_dir, signature_defs, main_op=tf.group(assign_filename))
    return version_dir


def write_half_plus_three(version_dir: Path) -> Path:
    """The shipped half_plus_three (TF 1.0): y = a*x + b with b = 3, y2 = a*x2 + c, and SignatureDefs
    written by hand that misstate the graph (HALF_PLUS_THREE), which TF Serving serves anyway."""
    import tensorflow as tf
    from google.protobuf import json_format
    from tensorflow.core.protobuf import meta_graph_pb2

    v1 = tf.compat.v1
    with tf.Graph().as_default(), v1.Session() as session, tempfile.TemporaryDirectory() as scratch:
        a = v1.Variable(0.5, name="a", use_resource=False)
        b = v1.Variable(3.0, name="b", use_resource=False)
        c = v1.Variable(3.0, name="c", use_resource=False)
        serialized = v1.placeholder(tf.string, name="tf_example")
        x = tf.identity(_parse_tf_examples(tf, serialized, ("x",))["x"], name="x")
        y = tf.add(tf.multiply(a, x), b, name="y")
        x2 = v1.placeholder(tf.float32, name="x2")
        tf.add(tf.multiply(a, x2), c, name="y2")
        tf.identity(y, name="Identity")
        assign_filename = _tf1_asset(v1, Path(scratch))
        signature_defs = {key: json_format.ParseDict(value, meta_graph_pb2.SignatureDef())
                          for key, value in HALF_PLUS_THREE.items()}
        session.run(v1.global_variables_initializer())
        _save_tf1(v1, session, version_dir, signature_defs, main_op=tf.group(assign_filename))
    return version_dir


def write_counter(version_dir: Path) -> Path:
    """export_counter.py: a float counter with get/incr/incr_by(delta)/reset signatures (state per session)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default(), v1.Session() as session:
        counter = v1.Variable(0.0, dtype=tf.float32, name="counter", use_resource=False)
        with tf.name_scope("incr_counter_op"):
            incr_counter = counter.assign_add(1.0)
        delta = v1.placeholder(dtype=tf.float32, name="delta")
        with tf.name_scope("incr_counter_by_op"):
            incr_counter_by = counter.assign_add(delta)
        with tf.name_scope("reset_counter_op"):
            reset_counter = counter.assign(0.0)
        session.run(v1.global_variables_initializer())
        _save_tf1(v1, session, version_dir, {
            "get_counter": _tf1_signature(v1, "predict", {}, {"output": counter}),
            "incr_counter": _tf1_signature(v1, "predict", {}, {"output": incr_counter}),
            "incr_counter_by": _tf1_signature(v1, "predict", {"delta": delta}, {"output": incr_counter_by}),
            "reset_counter": _tf1_signature(v1, "predict", {}, {"output": reset_counter}),
        })
    return version_dir


def write_bad_half_plus_two(version_dir: Path) -> Path:
    """export_bad_half_plus_two.py: half_plus_two as a legacy SessionBundle (export.meta + a checkpoint),
    no saved_model.pb: what a server must refuse to load."""
    import tensorflow as tf

    v1 = tf.compat.v1
    version_dir.mkdir(parents=True)
    with tf.Graph().as_default(), v1.Session() as session:
        a = v1.Variable(0.5, use_resource=False)
        b = v1.Variable(2.0, use_resource=False)
        x = v1.placeholder(tf.float32)
        tf.add(tf.multiply(a, x), b)
        session.run(v1.global_variables_initializer())
        saver = v1.train.Saver(write_version=v1.train.SaverDef.V1)  # TF 1.0's format: a single 'export' file
        saver.export_meta_graph(filename=str(version_dir / "export.meta"))
        saver.save(session, str(version_dir / "export"), write_meta_graph=False)
    return version_dir


def write_half_plus_two_tf2(version_dir: Path) -> Path:
    """saved_model_half_plus_two.py's HalfPlusTwoModel (tf2=True): native TF2 signatures, all 'predict'."""
    import tensorflow as tf

    string_batch = lambda name: tf.TensorSpec([None], tf.string, name=name)  # noqa: E731
    one_float = lambda name=None: tf.TensorSpec([1], tf.float32, name=name)  # noqa: E731

    class HalfPlusTwoModel(tf.Module):
        def __init__(self, asset_path: str):
            super().__init__()
            self.a = tf.Variable(0.5, name="a")
            self.b = tf.Variable(2.0, name="b")
            self.c = tf.Variable(3.0, name="c")
            self.asset = tf.saved_model.Asset(asset_path)

        def compute(self, x, inc):
            return tf.add(tf.multiply(self.a, x), inc)

        def parse_x(self, serialized):
            return tf.io.parse_example(serialized, _feature_spec(tf))["x"]

        @tf.function(input_signature=[one_float()])
        def predict(self, x=tf.constant([0], shape=[1], dtype=tf.float32)):
            return {"y": self.compute(x, self.b)}

        @tf.function(input_signature=[string_batch("inputs")])
        def regress_xy(self, serialized_proto):
            return {"outputs": self.compute(self.parse_x(serialized_proto), self.b)}

        @tf.function(input_signature=[string_batch("inputs")])
        def regress_xy2(self, serialized_proto):
            return {"outputs": self.compute(self.parse_x(serialized_proto), self.c)}

        @tf.function(input_signature=[one_float("inputs")])
        def regress_x2y3(self, x2):
            return {"outputs": self.compute(x2, self.c)}

        @tf.function(input_signature=[string_batch("inputs")])
        def classify_xy(self, serialized_proto):
            return {"scores": self.compute(self.parse_x(serialized_proto), self.b)}

        @tf.function(input_signature=[one_float("inputs")])
        def classify_x2y3(self, x2):
            return {"scores": self.compute(x2, self.c)}

    with tempfile.TemporaryDirectory() as scratch:
        asset = Path(scratch) / ASSET[0]
        asset.write_text(ASSET[1])
        model = HalfPlusTwoModel(str(asset))
        tf.saved_model.save(model, str(version_dir), signatures={
            "regress_x_to_y": model.regress_xy, "regress_x_to_y2": model.regress_xy2,
            "regress_x2_to_y3": model.regress_x2y3, "classify_x_to_y": model.classify_xy,
            "classify_x2_to_y3": model.classify_x2y3, "serving_default": model.predict})
    return version_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tfserving_models.py OUT_DIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    print(build(out))
