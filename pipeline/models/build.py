"""build_model: the experiment's Keras model for its model.kind, preprocessing inside, a float32 head.

model.kind: mlp (mlp.py, the mixed-precision guide's model), cnn (cnn.py), transformer (transformer.py: a pre-norm
encoder over image patches or token ids), causal_lm (the decoder-only language model of pipeline/lm/causal_lm.py,
float32 logits over the token ids at every position) or custom (custom.py: `model.builder: "module:function"`, the
user's own Keras model). Every kind but causal_lm gets the task's head: a float32 softmax `probabilities` for
classification, float32 linear `predictions` (rescaled to the targets' units) for regression. Every kind keeps the
float32 rule (float32_rule.py, over_range.py), also on the models loaded from disk (load_trained_model).

Build only after precision.apply_policy: layers read the global policy when they are constructed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import keras
import numpy as np
from keras import layers, ops

from pipeline.config import ModelConfig
from pipeline.data import DataSpec, Statistics
from pipeline.errors import CheckpointError, ModelError
from pipeline.lm import causal_lm, gpt2
from pipeline.models import cnn, custom, float32_rule, mlp, over_range, transformer

NATS_PER_BYTE = "nats_per_byte"  # a language model's metric: its total cross-entropy over its targets' UTF-8 bytes
NATS_PER_TOKEN = "nats_per_token"  # and per target token, where a token may be more than one byte (sentencepiece)


def build_model(config: ModelConfig, spec: DataSpec, statistics: Statistics,
                float32_layers: Sequence[str] = (), float16_layers: Sequence[str] = (),
                checks: bool = True) -> keras.Model:
    """The configured model, with standardisation baked in and a float32 head.

    Args:
        config: the model section.
        spec: the data's input shape and task (DataSpec.num_outputs is the output width).
        statistics: the training rows' statistics (data/statistics.py): they fit the standardisation baked
            into the model, so the export takes raw features; its sample rows feed the build's checks.
        float32_layers: names of layers that compute in float32 whatever the policy
            (precision.float32_layers).
        float16_layers: names of numerically sensitive layers that compute in the policy's reduced
            dtype anyway (by default they compute in float32: apply_precision_rules, over_range). A name is
            a layer's name or full path ('block_1_attention/query'); naming a layer includes its sublayers.
        checks: a custom model's build-time checks on training rows (finite probabilities, the
            export's round trip); diagnose builds without them, to probe the models they refuse.

    Raises:
        ModelError: a float16 output, an unknown float32_layers/float16_layers name or one in both, a
            builder that cannot be imported or does not return a fitting keras.Model, a cnn or an image
            transformer without image-shaped rows, patches that do not tile the image.
    """
    both = sorted(set(float32_layers) & set(float16_layers))
    if both:
        raise ModelError(f"layer {both[0]!r} is in both precision.float32_layers and float16_layers; name it in one")
    dtype = float32_rule.dtype_for(float32_layers)
    if config.kind == "custom":
        model = custom.build_custom(config, spec, statistics, float32_layers, float16_layers, checks)
    elif config.kind == "causal_lm" and config.init_from:
        model = _pretrained(config.init_from, spec)
    elif config.kind == "causal_lm":
        # It pins its float32 parts itself (causal_lm.py); its input is token ids, never standardised.
        model = causal_lm.build_causal_lm(spec.num_outputs, spec.input_shape[0], config.num_layers, config.num_heads,
                                          config.width, config.mlp_units, config.dropout, config.tied_embeddings,
                                          config.remat)
    else:
        inputs = keras.Input(shape=spec.input_shape, name=spec.input_name, dtype="float32")
        body = {"mlp": mlp.body, "cnn": cnn.body, "transformer": transformer.body}[config.kind]
        sensitive = float32_rule.sensitive_dtype_for(float16_layers)
        # The transformer's head reads float32 pooled features and stays float32 (transformer.py).
        head_dtype = (lambda name: "float32") if config.kind == "transformer" else dtype
        outputs = _head(body(inputs, config, spec, statistics, dtype, sensitive), config, spec, head_dtype)
        model = keras.Model(inputs, outputs, name=config.kind)
        over_range.keep_over_range_in_float32(model, statistics.sample_x, float16_layers, statistics.largest_magnitude())
    float32_rule.check_layer_names(model, float32_layers, "float32_layers")
    float32_rule.check_layer_names(model, float16_layers, "float16_layers")
    float32_rule.apply_precision_rules(model, float32_layers, float16_layers)  # sublayers exist now that the graph is built
    float32_rule.check_float32_outputs(model)
    return model


def _pretrained(directory: str, spec: DataSpec) -> keras.Model:
    """model.init_from's checkpoint as a causal_lm with its weights (pipeline/lm/gpt2.py), checked against the data:
    the tokenizer's ids are the checkpoint's, the windows fit its context. The weights are the run's: a fresh run
    starts from the checkpoint's (train/run.py), a resumed one from its own checkpoint, an export copies them."""
    config = gpt2.read_config(directory)
    if config.vocab_size != spec.vocab_size:
        raise CheckpointError(f"model.init_from: {directory}'s config.json has vocab_size {config.vocab_size}, its "
                              f"tokenizer {spec.vocab_size} ids; they must be the same")
    if spec.input_shape[0] > config.context_length:
        raise CheckpointError(f"data.sequence_length: {spec.input_shape[0]} is more than model.init_from's context "
                              f"(n_positions {config.context_length}); use at most {config.context_length}")
    return gpt2.build(directory)


def compile_settings(spec: DataSpec) -> tuple:
    """(loss, metrics) for model.compile: cross-entropy and accuracy, or mean squared error and MAE; for a
    language model, cross-entropy from the float32 logits at every position, in float32 whatever the policy.

    The history and logs then hold loss/accuracy, loss (the MSE)/mae, or loss/nats_per_byte: the total nats over
    every target token of the validation windows divided by those tokens' UTF-8 bytes (NatsPerByte), where val_loss
    averages the batches' means; a tokenizer whose tokens may be longer than a byte adds nats_per_token, the mean
    over every target token.
    """
    if spec.task == "regression":
        return "mean_squared_error", ["mae"]
    if spec.task == "language_model":
        token_bytes = spec.token_bytes or ((1,) * spec.num_classes)
        metrics = [NatsPerByte(token_bytes)]
        if max(token_bytes) > 1:
            metrics.insert(0, keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name=NATS_PER_TOKEN,
                                                                          dtype="float32"))
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float32"), metrics
    return "sparse_categorical_crossentropy", ["accuracy"]


@keras.saving.register_keras_serializable(package="pipeline")
class NatsPerByte(keras.metrics.Metric):
    """A language model's cross-entropy per UTF-8 byte: the total nats of the target tokens over their total bytes
    (token_bytes: each id's bytes, 0 for special ids), in float32. For the bytes tokenizer it is the mean per token;
    for a sentencepiece one it puts the model on the baselines' scale, the same validation bytes."""

    def __init__(self, token_bytes, name: str = NATS_PER_BYTE, **kwargs):
        super().__init__(name=name, dtype="float32", **{key: value for key, value in kwargs.items() if key != "dtype"})
        self.token_bytes = tuple(int(n) for n in token_bytes)
        self.nats = self.add_variable(shape=(), initializer="zeros", dtype="float32", name="nats")
        self.bytes = self.add_variable(shape=(), initializer="zeros", dtype="float32", name="bytes")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = ops.cast(y_true, "int32")
        nats = keras.losses.sparse_categorical_crossentropy(y_true, ops.cast(y_pred, "float32"), from_logits=True)
        counts = ops.take(ops.convert_to_tensor(self.token_bytes, "float32"), y_true)
        self.nats.assign_add(ops.sum(ops.cast(nats, "float32")))
        self.bytes.assign_add(ops.sum(counts))

    def result(self):
        return ops.divide_no_nan(self.nats, self.bytes)

    def reset_state(self):
        self.nats.assign(0.0)
        self.bytes.assign(0.0)

    def get_config(self):
        return {"name": self.name, "token_bytes": list(self.token_bytes)}


def serving_model(model: keras.Model, spec: DataSpec) -> keras.Model:
    """The trained model with the export's named float32 outputs.

    Classification: probabilities and logits (the input of the final softmax layer; a model whose last
    layer is a Dense with a softmax activation has no separate logits and exports probabilities only).
    Regression: predictions [batch, 1].
    """
    if spec.task == "regression":
        outputs = {"predictions": model.output}
    else:
        outputs = {"probabilities": model.output}
        logits = _softmax_input(model)
        if logits is not None:
            outputs["logits"] = layers.Activation("linear", dtype="float32", name="logits_float32")(logits)
    served = keras.Model(model.input, outputs, name=f"{model.name}_serving")
    float32_rule.check_float32_outputs(served)
    return served


def graph_outputs(served: keras.Model, *batches: np.ndarray) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
    """A serving model's outputs on each batch of rows, computed as a graph: what its SavedModel and
    model.predict() compute. One batch gives one dict of outputs, several a list of them.

    oneDNN fuses a graph's MatMul+BiasAdd(+activation) and rounds once where eager ops round after each
    op, so on a CPU with native float16 or bfloat16 arithmetic an eager call differs from the exported
    graph in the last bit (docs/keras3-mixed-precision.md §10); the parity gate compares like with like.
    The graph takes any number of rows, as the SavedModel's signature does, so it is traced once.
    """
    import tensorflow as tf

    function = graph_function(served, batches[0].shape[1:])
    found = [{name: keras.ops.convert_to_numpy(tensor) for name, tensor in function(tf.constant(x)).items()}
             for x in batches]
    return found[0] if len(batches) == 1 else found


def graph_function(served: keras.Model, row_shape: tuple[int, ...]):
    """A serving model as one tf.function over float32 rows of row_shape, any number of them: the graph its
    SavedModel's serving_default computes (graph_outputs); returns a dict of output tensors."""
    import tensorflow as tf

    spec = tf.TensorSpec([None, *row_shape], tf.float32)
    return tf.function(lambda features: served(features, training=False), input_signature=[spec])


def rebuild(model: keras.Model, config: ModelConfig, spec: DataSpec, statistics: Statistics,
            float32_layers: Sequence[str] = (), float16_layers: Sequence[str] = ()) -> keras.Model:
    """The same architecture built under the current global policy, carrying model's weights.

    Mixed policies keep float32 variables, so the weights carry over exactly; under float16 or bfloat16
    they are rounded to that dtype (set_weights casts to the nearest value), except in the layers pinned
    to float32 (numerically sensitive ones, precision.float32_layers), which stay pinned because the
    build is the same. Use it inside precision.policy_scope to get a float32 twin or a serving graph
    under another policy.

    Raises:
        ModelError: a weight does not fit the new variable dtype (float16 overflows beyond 65504).
    """
    twin = build_model(config, spec, statistics, float32_layers, float16_layers, checks=False)  # trained: checked then
    copy_weights(model, twin)
    _check_weights_fit(model, twin)
    return twin


def _check_weights_fit(source: keras.Model, target: keras.Model) -> None:
    """Every finite weight of source is finite in target, whose variables may be float16."""
    for before, after in zip(source.weights, target.weights):
        values = keras.ops.convert_to_numpy(after.value).astype(np.float32)
        if np.isfinite(values).all() or not np.isfinite(keras.ops.convert_to_numpy(before.value)).all():
            continue
        largest = float(np.max(np.abs(keras.ops.convert_to_numpy(before.value))))
        raise ModelError(f"weight {after.path}: its largest magnitude {largest:.6g} does not fit {after.dtype} "
                         f"(largest finite {float(np.finfo(np.float16).max):g} in float16); serve it under a policy "
                         "with float32 or bfloat16 weights, or name its layer in precision.float32_layers")


def copy_weights(source: keras.Model, target: keras.Model) -> None:
    """source's weights into target, a model of the same architecture (e.g. built under another policy)."""
    target.set_weights(source.get_weights())
    for layer in target._flatten_layers():  # an adapted Normalization reads its mean/variance only in finalize_state
        if isinstance(layer, layers.Normalization):
            layer.finalize_state()


def load_trained_model(path: str | Path, config: ModelConfig, float32_layers: Sequence[str] = (),
                       float16_layers: Sequence[str] = ()) -> keras.Model:
    """A trained model.keras computing as it did in training: a custom builder's module is imported first, so
    layers it registers load, and the precision rules are applied again, because a layer's sublayers are rebuilt
    from the layer's own policy (docs/keras3-mixed-precision.md §12)."""
    if config.kind == "custom":
        custom.import_builder(config.builder)
    model = keras.saving.load_model(path, compile=False)  # causal_lm's layers are registered by importing it
    float32_rule.apply_precision_rules(model, float32_layers, float16_layers)
    return model


def _head(x, config: ModelConfig, spec: DataSpec, dtype):
    """The float32 output layer: softmax probabilities, or predictions in the targets' units."""
    if spec.task == "classification":
        logits = layers.Dense(spec.num_classes, name="logits", dtype=dtype("logits"))(x)
        # The softmax runs in float32: in float16 it overflows/underflows and the output would leak float16.
        return layers.Activation("softmax", dtype="float32", name="probabilities")(logits)
    raw = layers.Dense(1, name="head", dtype=dtype("head"))(x)
    if config.normalize:
        # The head learns standardized targets; this float32 layer maps them back to the targets' units,
        # with the mean and standard deviation of the training targets baked in (like the inputs').
        return layers.Rescaling(scale=spec.target_std, offset=spec.target_mean, dtype="float32", name="predictions")(raw)
    return layers.Activation("linear", dtype="float32", name="predictions")(raw)


def _softmax_input(model: keras.Model):
    """The tensor fed to the model's final softmax layer (the logits), or None if there is no such layer."""
    operation, node_index, _ = model.output._keras_history
    is_softmax = isinstance(operation, layers.Softmax) or (
        isinstance(operation, layers.Activation) and operation.get_config().get("activation") == "softmax")
    if not is_softmax:
        return None
    return operation._inbound_nodes[node_index].input_tensors[0]
