"""Model building: float16 compute, float32 variables, float32 outputs, preprocessing inside — for
every model.kind (mlp, cnn, custom) and both heads (classification, regression)."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline.config import load_config
from pipeline.data import DataSpec
from pipeline.data.statistics import of_rows
from pipeline.errors import ModelError
from pipeline.models import (apply_precision_rules, build_model, check_float32_outputs, compile_settings,
                             graph_outputs, layer_paths, load_trained_model, serving_model, standardization_divisors)
from pipeline.precision import apply_policy

SPEC = DataSpec(input_name="features", input_shape=(6,), num_classes=3, label_names=("a", "b", "c"))
REGRESSION = DataSpec(input_name="features", input_shape=(6,), num_classes=0, label_names=(), task="regression",
                      target_mean=150.0, target_std=75.0)
IMAGES = DataSpec(input_name="features", input_shape=(8, 8, 1), num_classes=3, label_names=("a", "b", "c"),
                  image_shape=(8, 8, 1))
RAW = np.random.default_rng(0).normal(50.0, 10.0, size=(40, 6)).astype(np.float32)
RAW_IMAGES = np.random.default_rng(0).uniform(0, 16, size=(40, 8, 8, 1)).astype(np.float32)

BUILDERS = '''
import keras
from keras import layers


def functional(input_shape, num_classes, width=8):
    inputs = keras.Input(input_shape)
    x = layers.Dense(width, activation="relu", name="hidden")(inputs)
    x = layers.BatchNormalization(name="bn")(x)
    logits = layers.Dense(num_classes, name="scores")(x)
    return keras.Model(inputs, layers.Activation("softmax", dtype="float32", name="probs")(logits), name="my_functional")


def sequential_regressor(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), layers.Dense(8, activation="relu", name="hidden"),
                             layers.Dense(num_classes, name="out"),
                             layers.Activation("linear", dtype="float32", name="prediction")], name="my_sequential")


@keras.saving.register_keras_serializable(package="tests_model_builders")  # exportable: the build checks it
class Subclassed(keras.Model):
    def __init__(self, num_classes, **kwargs):
        super().__init__(**{"name": "my_subclassed", **kwargs})
        self.num_classes = num_classes
        self.dense = layers.Dense(num_classes, name="dense")
        self.softmax = layers.Activation("softmax", dtype="float32", name="softmax")

    def call(self, x):
        return self.softmax(self.dense(x))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


def subclassed(input_shape, num_classes):
    return Subclassed(num_classes)


def float16_head(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax", name="head")(inputs))


def float16_logits(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, layers.Dense(num_classes, name="head")(layers.Dense(8, name="hidden")(inputs)))


@keras.saving.register_keras_serializable(package="tests_model_builders")
class Epsilon(layers.Layer):
    """x / (|x| + epsilon): an epsilon of 1e-7 is below float16's smallest normal number."""

    def __init__(self, epsilon=1e-7, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def call(self, x):
        return x / (keras.ops.abs(x) + self.epsilon)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}


def sensitive(input_shape, num_classes):
    """Every kind of numerically sensitive layer, none given a dtype: they must compute in float32 anyway."""
    inputs = keras.Input(input_shape, name="features")  # the pipeline's own input name
    block = keras.Sequential([layers.Dense(8, name="inner"), layers.LayerNormalization(name="inner_norm")],
                             name="block")
    x = block(layers.Dense(8, activation="relu", name="standardize")(inputs))  # and its standardisation's name
    x = layers.BatchNormalization(name="bn")(x)
    x = Epsilon(name="ratio")(layers.Dense(8, name="hidden")(x))
    x = layers.Softmax(name="attention")(x)
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax", name="head")(x), name="sensitive")


@keras.saving.register_keras_serializable(package="tests_model_builders")
class SubclassedTwo(keras.Model):
    def __init__(self, num_classes, **kwargs):
        super().__init__(**{"name": "my_subclassed_two", **kwargs})
        self.num_classes = num_classes
        self.hidden = layers.Dense(8, name="hidden")
        self.mixed = layers.Dense(8, name="mixed")
        self.norm = layers.LayerNormalization(name="norm")
        self.out = layers.Dense(num_classes, activation="softmax", name="out")

    def call(self, x):
        return self.out(self.norm(self.mixed(self.hidden(x))))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


def subclassed_two(input_shape, num_classes):
    return SubclassedTwo(num_classes)


def logits_only(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, layers.Dense(num_classes, dtype="float32", name="head")(inputs))


def all_float32(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = layers.Dense(4, dtype="float32")(inputs)
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax", dtype="float32")(x))


@keras.saving.register_keras_serializable(package="tests")
class AttentionBlock(layers.Layer):
    """A user's own layer holding a transformer block: the rule has to reach inside it, and inside its attention."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.LayerNormalization(name="norm")
        self.attention = layers.MultiHeadAttention(2, 4, dropout=0.1, name="attention")
        self.ffn = layers.Dense(8, name="ffn")

    def call(self, x, training=None):
        h = self.norm(x)
        return x + self.ffn(self.attention(h, h, training=training))


def nested_attention(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = layers.Dense(8, name="embed")(layers.Reshape((3, 2))(inputs))
    x = layers.GlobalAveragePooling1D()(AttentionBlock(name="block")(x))
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax", dtype="float32")(x))


def attention_block(input_shape, num_classes):
    """Issue #24's block: Dense -> MultiHeadAttention -> LayerNormalization."""
    inputs = keras.Input(input_shape)
    x = layers.Dense(32, name="embed")(layers.Reshape((3, 2))(inputs))
    x = layers.LayerNormalization(name="norm")(layers.MultiHeadAttention(4, 8, name="attention")(x, x))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax", dtype="float32")(x))


def wrong_width(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, layers.Dense(num_classes + 1, activation="softmax", dtype="float32")(inputs))


def pretrained(input_shape, num_classes):
    import numpy as np

    inputs = keras.Input(input_shape)
    hidden = layers.Dense(4, name="hidden")
    x = hidden(inputs)
    hidden.set_weights([np.full(hidden.kernel.shape, 0.5), np.arange(4.0)])  # e.g. loaded from a checkpoint
    x = layers.Dense(4, name="mixed")(x)
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax", dtype="float32")(x))


def not_a_model(input_shape, num_classes):
    return "a string"
'''


@pytest.fixture(scope="module", autouse=True)
def builders_module(builder_module):
    """tests_model_builders.py, importable as model.builder 'tests_model_builders:<function>'."""
    builder_module("tests_model_builders", BUILDERS)


def build(*overrides, spec=SPEC, x=RAW, policy="mixed_float16"):
    cfg = load_config(None, [f"precision.policy={policy}", *overrides])
    apply_policy(cfg.precision)
    if cfg.model.kind != "custom" and not any(o.startswith("model.hidden_units") for o in overrides):
        cfg = load_config(None, [f"precision.policy={policy}", "model.hidden_units=[16, 8]", *overrides])
    return build_model(cfg.model, spec, of_rows(x), float32_layers=cfg.precision.float32_layers,
                       float16_layers=cfg.precision.float16_layers)


def custom(function, *overrides, spec=SPEC, x=RAW, policy="mixed_float16"):
    return build("model.kind=custom", f"model.builder=tests_model_builders:{function}", *overrides, spec=spec, x=x,
                 policy=policy)


def dtype_of(tensor) -> str:
    return keras.backend.standardize_dtype(tensor.dtype)


def assert_mixed(model, kernel_layers):
    for name in kernel_layers:
        assert model.get_layer(name).compute_dtype == "float16", name
    assert all(v.dtype == "float32" for v in model.trainable_weights)
    for tensor in keras.tree.flatten(model.outputs):
        assert dtype_of(tensor) == "float32"


def test_mixed_float16_model_computes_in_float16_keeps_float32_variables_and_outputs():
    model = build()
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert [layer.compute_dtype for layer in dense] == ["float16"] * 3
    assert all(v.dtype == "float32" for v in model.trainable_weights)
    assert model.get_layer("standardize").mean.dtype == "float32"
    assert model.get_layer("probabilities").compute_dtype == "float32"
    assert model.get_layer("standardize").compute_dtype == "float32"
    out = keras.ops.convert_to_numpy(model(RAW))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out.sum(axis=1), 1.0, atol=1e-5)


def test_standardisation_is_baked_in_from_the_training_rows():
    standardized = keras.ops.convert_to_numpy(build().get_layer("standardize")(RAW))
    np.testing.assert_allclose(standardized.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(standardized.std(axis=0), 1.0, atol=1e-3)


def test_serving_model_has_named_float32_outputs():
    outputs = serving_model(build(), SPEC)(RAW)
    assert sorted(outputs) == ["logits", "probabilities"]
    assert all(dtype_of(t) == "float32" for t in outputs.values())


def test_a_float16_output_is_an_error_at_build_time():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,), name="features")
    head = keras.layers.Dense(2, activation="softmax", name="head")(inputs)
    with pytest.raises(ModelError, match=r"output of layer 'head' is float16.*dtype='float32'"):
        check_float32_outputs(keras.Model(inputs, head))


def test_compile_settings_follow_the_task():
    assert compile_settings(SPEC) == ("sparse_categorical_crossentropy", ["accuracy"])
    assert compile_settings(REGRESSION) == ("mean_squared_error", ["mae"])


def test_regression_head_is_float32_in_the_targets_units():
    model = build(spec=REGRESSION)
    assert_mixed(model, ["dense_1", "dense_2", "head"])
    scaling = model.get_layer("predictions")
    assert scaling.compute_dtype == "float32"
    assert (scaling.scale, scaling.offset) == (75.0, 150.0)  # standardized head → the targets' units
    served = serving_model(model, REGRESSION)(RAW)
    assert list(served) == ["predictions"]
    assert dtype_of(served["predictions"]) == "float32" and tuple(served["predictions"].shape) == (40, 1)
    plain = build("model.normalize=false", spec=REGRESSION)
    assert plain.get_layer("predictions").compute_dtype == "float32"
    assert "standardize" not in [layer.name for layer in plain.layers]


def test_cnn_is_conv_pool_conv_pool_dense_with_float16_convolutions():
    model = build("model.kind=cnn", "model.hidden_units=[16]", spec=IMAGES, x=RAW_IMAGES)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["InputLayer", "Normalization", "Conv2D", "MaxPooling2D", "Conv2D", "MaxPooling2D", "Flatten",
                     "Dense", "Dense", "Activation"]
    assert [model.get_layer(n).filters for n in ("conv_1", "conv_2")] == [32, 64]
    assert model.get_layer("dense_1").units == 16
    assert_mixed(model, ["conv_1", "conv_2", "dense_1", "logits"])
    assert load_config(None, ["model.kind=cnn"]).model.hidden_units == [128]  # the articles' Dense 128
    assert sorted(serving_model(model, IMAGES)(RAW_IMAGES)) == ["logits", "probabilities"]


def test_cnn_reshapes_flat_rows_of_a_source_with_an_image_shape_and_has_a_regression_head():
    flat = DataSpec("features", (64,), 0, (), task="regression", image_shape=(8, 8, 1))
    model = build("model.kind=cnn", "model.filters=[4]", spec=flat, x=RAW_IMAGES.reshape(40, 64))
    assert model.get_layer("to_image").output.shape[1:] == (8, 8, 1)
    assert_mixed(model, ["conv_1", "head"])
    assert dtype_of(model.output) == "float32" and model.output.shape[1:] == (1,)


def test_cnn_without_an_image_shape_says_how_to_give_one():
    with pytest.raises(ModelError, match=r"model\.kind 'cnn' needs image-shaped rows.*set data\.image_shape"):
        build("model.kind=cnn")


def test_float32_layers_compute_in_float32_and_unknown_names_are_errors():
    model = build("precision.float32_layers=[dense_1, logits]")
    assert model.get_layer("dense_1").compute_dtype == "float32"
    assert model.get_layer("logits").compute_dtype == "float32"
    assert model.get_layer("dense_2").compute_dtype == "float16"
    with pytest.raises(ModelError, match=r"precision\.float32_layers: no layer named 'dense_9' in model 'mlp'; "
                                         r"did you mean 'dense_2'\? its layers are: standardize, dense_1"):
        build("precision.float32_layers=[dense_9]")


def test_custom_functional_builder_gets_the_policy_params_preprocessing_and_float32_layers():
    model = custom("functional", "model.params={width: 5}", "precision.float32_layers=[bn]")
    assert model.name == "my_functional"
    assert [layer.name for layer in model.layers] == ["features", "standardize", "hidden", "bn", "scores", "probs"]
    assert model.get_layer("hidden").units == 5  # model.params reached the builder
    assert_mixed(model, ["hidden", "scores"])  # built after the policy was set
    assert model.get_layer("bn").compute_dtype == "float32"
    served = serving_model(model, SPEC)(RAW)  # logits: the input of the final softmax
    np.testing.assert_allclose(keras.ops.convert_to_numpy(keras.ops.softmax(served["logits"])),
                               keras.ops.convert_to_numpy(served["probabilities"]), atol=1e-3)


def test_float32_layers_keep_the_builders_weights():
    model = custom("pretrained", "precision.float32_layers=[hidden]")
    hidden = model.get_layer("hidden")
    assert hidden.compute_dtype == "float32" and model.get_layer("mixed").compute_dtype == "float16"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(hidden.kernel), 0.5)  # set by the builder, not re-initialised
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(hidden.bias), np.arange(4.0))


def test_custom_sequential_and_subclassed_builders():
    regressor = custom("sequential_regressor", spec=REGRESSION)
    assert [layer.name for layer in regressor.layers] == ["features", "standardize", "hidden", "out", "prediction"]
    assert list(serving_model(regressor, REGRESSION)(RAW)) == ["predictions"]
    nested = custom("subclassed")
    assert dtype_of(nested(RAW)) == "float32"
    assert list(serving_model(nested, SPEC)(RAW)) == ["probabilities"]  # no separate logits layer to export
    # Layers of a subclassed model are pinned in place: float32_layers and the sensitive ones reach inside it.
    inner = custom("subclassed_two", "precision.float32_layers=[hidden]").get_layer("my_subclassed_two")
    assert [layer.compute_dtype for layer in (inner.hidden, inner.mixed, inner.norm, inner.out)] == [
        "float32", "float16", "float32", "float32"]


@pytest.mark.parametrize("builder, overrides, message", [
    ("no_such_module_xyz:build", [], r"model\.builder: cannot import module 'no_such_module_xyz'.*ModuleNotFoundError"),
    ("tests_model_builders:missing", [], r"module 'tests_model_builders' \(.*\) has no function 'missing'"),
    ("tests_model_builders:not_a_model", [], r"returned str, not a keras\.Model"),
    ("tests_model_builders:functional", ["model.params={depth: 3}"],
     r"cannot be called with input_shape, num_classes and model\.params \['depth'\]: .*unexpected keyword argument 'depth'"),
    ("tests_model_builders:float16_logits", [], r"output of layer 'head' is float16.*dtype='float32'"),
    ("tests_model_builders:float16_head", [], r"no layer computes in float16.*only layers with weights \(head\) are "
                                             r"numerically sensitive.*precision\.policy float32"),
    ("tests_model_builders:logits_only", [], r"must output class probabilities.*do not sum to 1"),
    ("tests_model_builders:wrong_width", [], r"output has shape \[None, 4\]; the task needs \[batch, 3\]"),
    ("tests_model_builders:all_float32", [], r"no layer computes in float16, the compute dtype of policy mixed_float16"),
])
def test_an_unusable_builder_is_a_model_error(builder, overrides, message):
    with pytest.raises(ModelError, match=message) as info:
        build("model.kind=custom", f"model.builder={builder}", *overrides)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("raw, message", [
    ({"kind": "custom"}, r"model\.builder: required when model\.kind is 'custom'"),
    ({"builder": "m:f"}, r"model\.builder: only for model\.kind 'custom', got kind 'mlp'"),
    ({"kind": "cnn", "params": {"a": 1}}, r"model\.params: only for model\.kind 'custom', got kind 'cnn'"),
    ({"kind": "custom", "builder": "m.f"}, r"model\.builder: expected 'module:function' \(e\.g\. 'my_models:build'\), got 'm\.f'"),
    ({"kind": "custom", "builder": "m:f", "hidden_units": [8]}, r"model\.hidden_units: not used by model\.kind 'custom'"),
    ({"kind": "rnn"}, r"model\.kind: expected one of 'mlp', 'cnn', 'transformer', 'causal_lm' or 'custom', got 'rnn'"),
])
def test_model_settings_that_do_not_fit_are_config_errors(raw, message):
    from pipeline.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message) as info:
        validate_config({"model": raw})
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_numerically_sensitive_layers_compute_in_float32_whatever_the_builder_set(policy):
    model = custom("sensitive", policy=policy)
    reduced = policy.removeprefix("mixed_")
    dtypes = {layer.name: layer.compute_dtype for layer in model.get_layer("block").layers}
    dtypes |= {layer.name: layer.compute_dtype for layer in model.layers}
    assert {name: dtypes[name] for name in ("inner_norm", "bn", "ratio", "attention", "head")} == dict.fromkeys(
        ("inner_norm", "bn", "ratio", "attention", "head"), "float32")
    assert {name: dtypes[name] for name in ("inner", "standardize", "hidden")} == dict.fromkeys(
        ("inner", "standardize", "hidden"), reduced)
    # The builder's input is replaced by the pipeline's; its other names win: the standardisation takes a free one.
    assert [layer.name for layer in model.layers][:3] == ["features", "pipeline_standardize", "standardize"]
    assert dtypes["pipeline_standardize"] == "float32"
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(model(RAW))))


def test_the_float16_layers_config_key_reaches_the_model():
    assert build("precision.float16_layers=[standardize]").get_layer("standardize").compute_dtype == "float16"
    assert build().get_layer("standardize").compute_dtype == "float32"


def test_float16_layers_opt_sensitive_layers_into_the_policy():
    cfg = load_config(None, ["model.kind=custom", "model.builder=tests_model_builders:sensitive"])
    apply_policy(cfg.precision)
    model = build_model(cfg.model, SPEC, of_rows(RAW), float16_layers=["bn", "pipeline_standardize"])
    assert model.get_layer("bn").compute_dtype == "float16"
    assert model.get_layer("pipeline_standardize").compute_dtype == "float16"
    assert model.get_layer("attention").compute_dtype == "float32"
    mlp = load_config(None, ["model.hidden_units=[8]"]).model
    assert build_model(mlp, SPEC, of_rows(RAW), float16_layers=["standardize"]).get_layer("standardize").compute_dtype == "float16"
    with pytest.raises(ModelError, match=r"^precision\.float16_layers: no layer named 'nope' in model 'mlp'"):
        build_model(mlp, SPEC, of_rows(RAW), float16_layers=["nope"])
    with pytest.raises(ModelError, match=r"^layer 'dense_1' is in both precision\.float32_layers and float16_layers"):
        build_model(mlp, SPEC, of_rows(RAW), float32_layers=["dense_1"], float16_layers=["dense_1"])


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_the_float32_rule_reaches_inside_a_users_layer_and_its_attention(policy):
    model = custom("nested_attention", policy=policy)
    dtypes = {path: layer.compute_dtype for path, layer in layer_paths(model).items()}
    reduced = policy.removeprefix("mixed_")
    assert {path: dtypes[path] for path in ("block/norm", "block/attention/query", "block/attention/key",
                                            "block/attention/softmax")} == dict.fromkeys(
        ("block/norm", "block/attention/query", "block/attention/key", "block/attention/softmax"), "float32")
    assert {path: dtypes[path] for path in ("embed", "block/attention/value", "block/attention/attention_output",
                                            "block/ffn")} == dict.fromkeys(
        ("embed", "block/attention/value", "block/attention/attention_output", "block/ffn"), reduced)
    opted_in = custom("nested_attention", "precision.float16_layers=[block/attention]", policy=policy)
    dtypes = {path: layer.compute_dtype for path, layer in layer_paths(opted_in).items()}
    assert dtypes["block/attention/query"] == dtypes["block/attention/softmax"] == reduced
    assert dtypes["block/norm"] == "float32"


def test_attention_with_dropout_takes_its_weighted_sum_in_float32():
    """A MultiHeadAttention's dropout of its weights casts them to the compute dtype even when not training:
    with model.dropout set, the weighted sum ran in float16 until the rule pinned that dropout too."""
    keras.mixed_precision.set_global_policy("mixed_float16")  # tests/conftest.py restores the policy
    inputs = keras.Input((8, 16))
    model = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="attention")(inputs, inputs))
    apply_precision_rules(model)
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec([1, 8, 16], tf.float32)).graph
    operations = graph.get_operations()
    softmax = next(index for index, op in enumerate(operations) if op.type == "Softmax")
    weighted_sum = next(op for op in operations[softmax:] if op.type in ("BatchMatMulV2", "Einsum"))
    assert weighted_sum.outputs[0].dtype == tf.float32


def test_a_reloaded_model_computes_in_the_dtypes_it_trained_in(tmp_path):
    """Keras saves a layer's policy but not its sublayers': a MultiHeadAttention rebuilds them from its own, so
    load_trained_model applies the rules again (docs/keras3-mixed-precision.md §12)."""
    model = custom("nested_attention")
    path = tmp_path / "model.keras"
    model.save(path)
    raw = keras.saving.load_model(path, compile=False)
    assert layer_paths(raw)["block/attention/query"].compute_dtype == "float16"  # what Keras gives back
    cfg = load_config(None, ["model.kind=custom", "model.builder=tests_model_builders:nested_attention"])
    reloaded = load_trained_model(path, cfg.model)
    assert ({p: l.dtype_policy.name for p, l in layer_paths(reloaded).items()}
            == {p: l.dtype_policy.name for p, l in layer_paths(model).items()})
    spec_outputs = [graph_outputs(serving_model(m, SPEC), RAW * 30)["probabilities"] for m in (model, reloaded)]
    np.testing.assert_array_equal(*spec_outputs)


def test_the_issues_attention_block_stays_finite_only_with_the_rule():
    """Dense -> MultiHeadAttention -> LayerNormalization fed values of ~1000 (normalize off; the issue saw it at ~300
    on a wider block): query·key overflows float16 unless the attention's logits compute in float32."""
    x = RAW / 50.0 * 1000.0
    safe = custom("attention_block", "model.normalize=false")
    assert np.isfinite(keras.ops.convert_to_numpy(safe(x))).all()
    unsafe = custom("attention_block", "model.normalize=false", "precision.float16_layers=[attention, norm]")
    assert not np.isfinite(keras.ops.convert_to_numpy(unsafe(x))).all()


def test_standardisation_floors_divisors_so_unseen_legal_values_stay_in_float16_range():
    x = np.zeros((50, 4), np.float32)
    x[:, 1] = np.linspace(0, 16, 50)  # an ordinary feature: divided by its standard deviation
    x[0, 2] = 1.0  # lit once in 50 rows: std 0.14, floored at 1% of its largest value (0.01) -> unchanged
    x[:, 3] = 5.0  # constant but not 0: floored at 1% of 5
    divisors = standardization_divisors(x.std(axis=0), np.abs(x).max(axis=0))  # column 0 was always 0: only centred
    np.testing.assert_allclose(divisors, [1.0, x[:, 1].std(), x[:, 2].std(), 0.05], rtol=1e-6)
    assert standardization_divisors(np.zeros(1), np.full(1, 1e-6))[0] == np.finfo(np.float16).tiny

    spec = DataSpec(input_name="features", input_shape=(4,), num_classes=3, label_names=("a", "b", "c"))
    model = build("model.hidden_units=[8]", spec=spec, x=x)
    legal = np.array([[16, 16, 16, 16], [16, 0, 0, 0], [0, 0, 16, 0]], np.float32)
    standardized = keras.ops.convert_to_numpy(model.get_layer("standardize")(legal))
    assert np.abs(standardized).max() < 1000  # Keras' own 1e-7 floor gave 1.6e8 for column 0
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(model(legal))))
