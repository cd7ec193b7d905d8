"""The constants check (verify and diagnose): epsilons and standardisation divisors below the smallest normal
number of the dtype they are read in, on models built directly with Keras."""

import keras
import numpy as np
import pytest
import yaml
from keras import layers

from pipeline.diagnose.constants import constant_findings


class Ratio(layers.Layer):
    def __init__(self, epsilon=1e-7, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def call(self, x):
        return x / (keras.ops.abs(x) + self.epsilon)


def _model(policy, build):
    keras.config.set_dtype_policy(policy)
    try:
        inputs = keras.Input((3,), name="features")
        return keras.Model(inputs, build(inputs))
    finally:
        keras.config.set_dtype_policy("float32")


def _constant_feature_normalization(x, dtype="float32", name="scaler"):
    norm = layers.Normalization(mean=[0.0, 1.0, 2.0], variance=[0.0, 1.0, 4.0], dtype=dtype, name=name)
    return norm(x)


def test_a_zero_variance_read_by_a_float16_layer_is_an_error_naming_the_reader_and_the_fix():
    model = _model("mixed_float16", lambda x: layers.Dense(2, dtype="float32", name="out")(
        layers.Dense(4, name="dense_1")(_constant_feature_normalization(x))))
    [finding] = constant_findings(model)
    assert (finding.severity, finding.layer) == ("error", "scaler")
    assert finding.problem == ("divides 1 feature(s) (e.g. feature 0) by 1e-07, below float16's smallest normal "
                               "number 6.1e-05 (read by dense_1 in float16): a value 0.0066 from the training mean "
                               "already overflows")
    assert "floor scaler's variance in the model builder" in finding.fix
    assert yaml.safe_load(finding.fix) is None  # advice in comments: no config key floors a builder's layer


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"])
def test_the_same_divisor_is_fine_where_it_is_read_in_bfloat16_or_float32(policy):
    model = _model(policy, lambda x: layers.Dense(2, dtype="float32", name="out")(
        layers.Dense(4, name="dense_1")(_constant_feature_normalization(x))))
    assert constant_findings(model) == []


def test_the_pipelines_own_standardisation_is_told_to_retrain_and_a_float16_epsilon_is_flagged():
    def build(x):
        x = layers.Dense(4, name="dense_1")(_constant_feature_normalization(x, name="standardize"))
        x = Ratio(name="ratio")(x)  # computes in float16 with epsilon 1e-7
        x = Ratio(epsilon=1e-3, name="safe_ratio")(x)
        return layers.Dense(2, dtype="float32", name="out")(x)

    findings = {f.layer: f for f in constant_findings(_model("mixed_float16", build))}
    assert set(findings) == {"standardize", "ratio"}
    assert "retrain it from scratch" in findings["standardize"].fix
    assert findings["ratio"].problem == "epsilon 1e-07 is below float16's smallest normal number 6.1e-05: it becomes " \
                                        "subnormal or 0 there"
    assert yaml.safe_load(findings["ratio"].fix) == {"precision": {"float32_layers": ["ratio"]}}


def test_a_floored_divisor_is_not_flagged_unless_its_own_float16_flushes_the_variance():
    def build(dtype):
        return lambda x: layers.Dense(2, dtype="float32", name="out")(layers.Dense(4)(layers.Normalization(
            mean=[0.0] * 3, variance=[1.0, 1e-8, 2.0 ** -27], dtype=dtype, name="scaler")(x)))

    assert np.sqrt(1e-8) > 2.0 ** -14 and np.sqrt(2.0 ** -27) > 2.0 ** -14  # float16's smallest normal number
    assert constant_findings(_model("mixed_float16", build("float32"))) == []
    # Computing in float16 itself, the layer holds its variances in float16: both small ones flush to 0.
    [finding] = constant_findings(_model("mixed_float16", build(None)))
    assert "divides 2 feature(s) (e.g. feature 1) by 1e-07" in finding.problem
