"""tests/helpers/tfserving_models.py builds TF Serving's test models: each source of test data (the built
one, and TF Serving's own where present) is checked against the one description of them there, so with
TF Serving's copy present the built one is shown to match it, and in a plain clone it is still checked."""

from __future__ import annotations

import pytest
import tensorflow as tf
from google.protobuf import json_format
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

import tfserving_models  # registered by tests/serving/conftest.py


def variables_of(checkpoint_prefix) -> dict[str, float]:
    """{variable name: value} of a checkpoint; TF2's names lose their '/.ATTRIBUTES/VARIABLE_VALUE'."""
    reader = tf.train.load_checkpoint(str(checkpoint_prefix))
    return {key.split("/")[0]: reader.get_tensor(key).item() for key in reader.get_variable_to_shape_map()
            if key != "_CHECKPOINTABLE_OBJECT_GRAPH"}


@pytest.mark.parametrize("name", sorted(tfserving_models.SAVED_MODELS))
def test_saved_models_have_tf_servings_signatures_and_values(every_tfserving_testdata, name):
    signature_defs, values = tfserving_models.SAVED_MODELS[name]
    expected = {key: json_format.ParseDict(value, meta_graph_pb2.SignatureDef()) for key, value in signature_defs.items()}
    versions = sorted(path.name for path in (every_tfserving_testdata / name).iterdir())
    assert versions == (["00000123", "00000124"] if name.endswith("_2_versions") else ["00000123"])
    for version in versions:
        version_dir = every_tfserving_testdata / name / version
        [meta_graph] = saved_model_pb2.SavedModel.FromString((version_dir / "saved_model.pb").read_bytes()).meta_graphs
        assert list(meta_graph.meta_info_def.tags) == ["serve"]
        served = dict(meta_graph.signature_def)
        if name == "saved_model_half_plus_two_tf2_cpu":  # predict's default argument, which the metadata JSON predates
            assert tf.make_ndarray(served["serving_default"].defaults["x"]).tolist() == [0.0]
            served["serving_default"].ClearField("defaults")
        assert served == expected
        assert variables_of(version_dir / "variables" / "variables") == values
        if name != "saved_model_counter":
            assert (version_dir / "assets" / "foo.txt").read_text() == "asset-file-contents"


def test_bad_half_plus_two_is_a_session_bundle(every_tfserving_testdata):
    """export_bad_half_plus_two.py: a meta graph and a TF 1.0 checkpoint, no saved_model.pb."""
    version_dir = every_tfserving_testdata / "bad_half_plus_two" / "00000123"
    assert sorted(path.name for path in version_dir.iterdir()) == ["checkpoint", "export", "export.meta"]
    assert variables_of(version_dir / "export") == {"Variable": 0.5, "Variable_1": 2.0}
