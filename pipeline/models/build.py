"""Builds the experiment's Keras model: preprocessing inside, float16 math, a float32 head.

model.kind: mlp (the mixed-precision guide's model), cnn (Conv 32 → pool → Conv 64 → pool → Dense 128),
transformer (pre-norm encoder over image patches or token ids: transformer.py), causal_lm (the decoder-only
language model of causal_lm.py, float32 logits over the token ids at every position) or custom
(`model.builder: "module:function"`, the user's own Keras model). Every kind but causal_lm gets the task's head: a
float32 softmax `probabilities` for classification, float32 linear `predictions` (rescaled to the
targets' units) for regression.

Numerically sensitive layers compute in float32 under every policy, whatever a builder set, unless
float16_layers names them (apply_precision_rules): normalisation, softmax, embeddings, anything with an
epsilon below float16's smallest normal number (numerically_sensitive), and attention's query and key
projections (attention_logit_layers) and the dropout of its weights (attention_weights_dropout), at any depth: inside a MultiHeadAttention, a custom layer or a
nested model, each named by its full path (layer_paths). Keras does not save a sublayer's dtype policy
(docs/keras3-mixed-precision.md §12), so the rules are applied again to every model loaded from disk. The
standardisation floors each divisor (standardization_divisors), so that a feature that barely varied in
training cannot scale a legal input past float16's range.

Build only after precision.apply_policy: layers read the global policy when they are constructed.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import keras
import numpy as np
from keras import layers, ops

from pipeline import causal_lm, exportable, nonfinite, over_range, transformer
from pipeline.config import ModelConfig
from pipeline.data import DataSpec, Statistics
from pipeline.errors import ModelError

# Activations whose float16 exp() overflows or whose small outputs underflow (the audit's errors too).
PROBABILITY_ACTIVATIONS = ("softmax", "log_softmax", "sigmoid")
NORMALIZATION_LAYERS = (layers.BatchNormalization, layers.LayerNormalization, layers.GroupNormalization,
                        layers.Normalization, layers.UnitNormalization, layers.RMSNormalization)
EMBEDDING_LAYERS = (layers.Embedding, transformer.TokenEmbedding)
# Layers that compute query·key scores and their softmax in their own call, from their inputs.
SCORING_ATTENTION_LAYERS = (layers.Attention, layers.AdditiveAttention)
# Layers whose query and key projections are sublayers (docs/keras3-mixed-precision.md §12).
PROJECTING_ATTENTION_LAYERS = (layers.MultiHeadAttention, layers.GroupQueryAttention)
FLOAT16_SMALLEST_NORMAL = float(np.finfo(np.float16).tiny)  # 2**-14 = 6.1e-5
# A feature's standardisation divisor is at least this share of its largest training magnitude, so a legal
# value of a feature that barely varied in training is amplified at most ~2/STD_FLOOR_SHARE, not by 1e7.
STD_FLOOR_SHARE = 0.01
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
    dtype = _dtype_for(float32_layers)
    if config.kind == "custom":
        model = _build_custom(config, spec, statistics, float32_layers, float16_layers, checks)
    elif config.kind == "causal_lm":
        # It pins its float32 parts itself (causal_lm.py); its input is token ids, never standardised.
        model = causal_lm.build_causal_lm(spec.num_outputs, spec.input_shape[0], config.num_layers, config.num_heads,
                                          config.width, config.mlp_units, config.dropout, config.tied_embeddings)
    else:
        inputs = keras.Input(shape=spec.input_shape, name=spec.input_name, dtype="float32")
        body = {"mlp": _mlp_body, "cnn": _cnn_body, "transformer": _transformer_body}[config.kind]
        sensitive = _sensitive_dtype_for(float16_layers)
        # The transformer's head reads float32 pooled features and stays float32 (transformer.py).
        head_dtype = (lambda name: "float32") if config.kind == "transformer" else dtype
        outputs = _head(body(inputs, config, spec, statistics, dtype, sensitive), config, spec, head_dtype)
        model = keras.Model(inputs, outputs, name=config.kind)
        over_range.keep_over_range_in_float32(model, statistics.sample_x, float16_layers, statistics.largest_magnitude())
    _check_layer_names(model, float32_layers, "float32_layers")
    _check_layer_names(model, float16_layers, "float16_layers")
    apply_precision_rules(model, float32_layers, float16_layers)  # sublayers exist now that the graph is built
    check_float32_outputs(model)
    return model


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
    check_float32_outputs(served)
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
        _import_builder(config.builder)
    model = keras.saving.load_model(path, compile=False)  # causal_lm's layers are registered by importing it
    apply_precision_rules(model, float32_layers, float16_layers)
    return model


def check_float32_outputs(model: keras.Model) -> None:
    """Raises ModelError when any output is not float32: float16 must never reach a serving client."""
    for tensor in keras.tree.flatten(model.outputs):
        if str(tensor.dtype) != "float32":
            layer = tensor._keras_history.operation.name if hasattr(tensor, "_keras_history") else "?"
            raise ModelError(
                f"model output of layer '{layer}' is {tensor.dtype}; the pipeline serves float32 outputs. "
                "Give the last layer dtype='float32', e.g. keras.layers.Activation('softmax', dtype='float32')")


def numerically_sensitive(layer: layers.Layer) -> str | None:
    """Why the layer must not compute in float16 (None if it may): normalisation divides by a variance that
    float16 flushes or rounds; softmax/sigmoid exp() overflows and small probabilities underflow; an embedding's
    gradient sums over every occurrence of a token (docs/keras3-mixed-precision.md §12); Attention and
    AdditiveAttention compute query·key scores from their inputs; an epsilon below float16's smallest normal
    number becomes subnormal or zero."""
    if isinstance(layer, NORMALIZATION_LAYERS):
        return f"{type(layer).__name__} (means and variances need float32's range)"
    if isinstance(layer, EMBEDDING_LAYERS):
        return "embedding (a token's gradient sums over all its occurrences in a batch; float16 overflows)"
    if isinstance(layer, SCORING_ATTENTION_LAYERS):
        return f"{type(layer).__name__} (query·key scores overflow float16 beyond inputs of ~250)"
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    if isinstance(layer, layers.Softmax) or activation in PROBABILITY_ACTIVATIONS:
        return f"{activation or 'softmax'} (exp() overflows float16, small probabilities underflow)"
    epsilon = getattr(layer, "epsilon", None)
    if isinstance(epsilon, (int, float)) and 0 < epsilon < FLOAT16_SMALLEST_NORMAL:
        return f"epsilon {epsilon:g} (below float16's smallest normal number {FLOAT16_SMALLEST_NORMAL:.2g})"
    return None


def attention_logit_layers(layer: layers.Layer) -> list[layers.Layer]:
    """The query and key projections of a MultiHeadAttention or GroupQueryAttention (once built): their outputs'
    dot product is the attention logits, which overflow float16 (65504) as soon as the inputs reach a few hundred;
    in float32 they make the whole score computation and the softmax float32 (docs/keras3-mixed-precision.md §12)."""
    if not isinstance(layer, PROJECTING_ATTENTION_LAYERS) or not layer.built:
        return []
    return [layer._query_dense, layer._key_dense]


def attention_weights_dropout(layer: layers.Layer) -> layers.Layer | None:
    """The Dropout a MultiHeadAttention or GroupQueryAttention (once built, dropout > 0) applies to its softmax:
    under a mixed policy it casts the float32 weights to the compute dtype, even when not training, so the
    weighted sum ran in float16 whenever model.dropout was set; in float32 it keeps the weights as they are."""
    if not isinstance(layer, PROJECTING_ATTENTION_LAYERS) or not layer.built:
        return None
    return getattr(layer, "_dropout_layer", None)


def layer_paths(model: layers.Layer) -> dict[str, layers.Layer]:
    """Every layer inside model, at any depth (nested models, a layer's sublayers such as a MultiHeadAttention's
    query, key, value, softmax and output), by its full path, e.g. 'block_1_attention/query'. A layer reached
    twice keeps its first path; input layers are left out."""
    found: dict[str, layers.Layer] = {}
    seen: set[int] = set()

    def walk(parent: layers.Layer, prefix: str) -> None:
        for layer in parent._flatten_layers(include_self=False, recursive=False):
            if id(layer) in seen or isinstance(layer, layers.InputLayer):
                continue
            seen.add(id(layer))
            name = layer.name if isinstance(parent, keras.Model) else _stable_name(layer)
            path = prefix + (name if prefix + name not in found else layer.name)
            found[path] = layer
            walk(layer, path + "/")

    walk(model, "")
    return found


def _stable_name(sublayer: layers.Layer) -> str:
    """A sublayer's name without the counter Keras appends to names it makes up ('softmax_7' → 'softmax'): a
    MultiHeadAttention names its softmax and dropout so, and the counter differs between processes."""
    base = re.sub(r"(?<!^)(?=[A-Z])", "_", type(sublayer).__name__).lower()
    return base if re.fullmatch(rf"{re.escape(base)}(_\d+)?", sublayer.name) else sublayer.name


def sensitive_layers(model: layers.Layer) -> dict[str, str]:
    """Full path → why the layer computes in float32 by default, for every layer the precision rules pin."""
    paths = layer_paths(model)
    path_of = {id(layer): path for path, layer in paths.items()}
    reasons = {path: reason for path, layer in paths.items() if (reason := numerically_sensitive(layer))}
    for layer in paths.values():
        for projection in attention_logit_layers(layer):
            reasons[path_of[id(projection)]] = ("attention logits: query·key overflows float16 beyond inputs of "
                                                "~250; float32 here makes the scores and softmax float32")
        dropout = attention_weights_dropout(layer)
        if dropout is not None and id(dropout) in path_of:
            reasons[path_of[id(dropout)]] = ("attention weights' dropout: in the compute dtype it casts the float32 "
                                             "softmax down, and the weighted sum with it")
    return reasons


def apply_precision_rules(model: layers.Layer, float32_layers: Sequence[str] = (),
                          float16_layers: Sequence[str] = ()) -> None:
    """Sets the dtype policy of layers in place, at any depth: float32 for float32_layers and for the numerically
    sensitive layers (sensitive_layers) unless float16_layers names them; naming a layer includes its sublayers.
    In place, so it reaches nested and subclassed models and sublayers alike and keeps the weights
    (docs/keras3-mixed-precision.md §1)."""
    paths = layer_paths(model)
    forced, opted_in = _named_paths(paths, float32_layers), _named_paths(paths, float16_layers)
    pinned = [path for path in paths if _within(path, forced)]
    pinned += [path for path in sensitive_layers(model) if not _within(path, opted_in)]
    for path in pinned:
        layer = paths[path]
        if layer.dtype_policy.name == "float32":
            continue
        layer.dtype_policy = "float32"
        if isinstance(layer, layers.Normalization):  # its mean and variance are cast to the compute dtype here
            layer.finalize_state()


def _named_paths(paths: dict[str, layers.Layer], names: Sequence[str]) -> set[str]:
    """The paths a list of precision.*_layers names: by full path or by layer name."""
    wanted = set(names)
    return {path for path, layer in paths.items() if path in wanted or layer.name in wanted}


def _within(path: str, named: set[str]) -> bool:
    """path is one of named or lies inside one of them."""
    parts = path.split("/")
    return any("/".join(parts[:i]) in named for i in range(1, len(parts) + 1))


def standardization_divisors(std: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per feature (or channel), what the standardisation divides by: the training standard deviation, floored at
    STD_FLOOR_SHARE of the feature's largest training magnitude (scale) and at float16's smallest normal number;
    1 for a feature that was always 0 (it is only centred). Keras' own floor, 1e-7, turns a legal value of a pixel
    that was always 0 in training into ~1e8, which overflows the float16 layer that reads it (issue #14)."""
    divisors = np.maximum(std, np.maximum(STD_FLOOR_SHARE * scale, FLOAT16_SMALLEST_NORMAL))
    return np.where(scale == 0, 1.0, divisors)


def _dtype_for(float32_layers: Sequence[str]) -> Callable[[str], str | None]:
    """name → 'float32' for precision.float32_layers, else None (the global policy)."""
    names = set(float32_layers)
    return lambda name: "float32" if name in names else None


def _sensitive_dtype_for(float16_layers: Sequence[str]) -> Callable[[str], str | None]:
    """name → None (the policy) for a numerically sensitive layer the config opts into float16, else 'float32'."""
    names = set(float16_layers)
    return lambda name: None if name in names else "float32"


def _standardize(x, statistics: Statistics, dtype: str | None = "float32", name: str = "standardize",
                 categorical: Sequence[int] = ()) -> keras.KerasTensor:
    """Per last axis of x (features, or an image's channels): the training mean and the floored standard deviation,
    from the statistics pass (float64, computed once per run: docs/data.md#statistics). The layer computes in
    float32 unless float16_layers names it. Category ids (data.categorical_columns) pass unchanged: mean 0,
    variance 1."""
    mean, variance, largest = statistics.standardization(x.shape[-1])
    mean = mean.astype(np.float32)
    variance = np.square(standardization_divisors(np.sqrt(variance), largest)).astype(np.float32)
    mean[list(categorical)], variance[list(categorical)] = 0.0, 1.0
    standardize = layers.Normalization(axis=-1, name=name, dtype=dtype)
    standardize.build(x.shape)  # its mean and variance weights, as adapt() would leave them
    standardize.adapt_mean.assign(mean)
    standardize.adapt_variance.assign(variance)
    standardize.count.assign(statistics.value_rows)
    standardize.finalize_state()
    return standardize(x)


def _mlp_body(inputs, config: ModelConfig, spec: DataSpec, statistics: Statistics, dtype, sensitive):
    """The mixed-precision guide's MLP: [standardize] → (Dense+ReLU)×N; images are flattened first."""
    x = inputs
    if len(spec.input_shape) > 1:
        x = layers.Flatten(name="flatten", dtype="float32")(x)  # a reshape: keep the raw values exact
    if config.normalize:
        x = _standardize(x, statistics, sensitive("standardize"), categorical=spec.categorical)
    for i, units in enumerate(config.hidden_units, start=1):
        x = layers.Dense(units, activation="relu", name=f"dense_{i}", dtype=dtype(f"dense_{i}"))(x)
    return x


def _cnn_body(inputs, config: ModelConfig, spec: DataSpec, statistics: Statistics, dtype, sensitive):
    """The mixed-precision articles' CNN: [standardize per channel] → (Conv 3×3+ReLU → MaxPool 2×2)×N
    → Flatten → (Dense+ReLU)×M. 'same' padding, so small images (digits' 8×8) keep a spatial extent."""
    x = _as_images(inputs, spec, config.kind)
    if spec.categorical:
        raise ModelError("data.categorical_columns: model.kind 'cnn' reads images, standardised per channel; "
                         "category ids need model.kind 'mlp' or 'custom'")
    if config.normalize:
        x = _standardize(x, statistics, sensitive("standardize"))
    for i, filters in enumerate(config.filters, start=1):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv_{i}", dtype=dtype(f"conv_{i}"))(x)
        x = layers.MaxPooling2D(2, padding="same", name=f"pool_{i}", dtype=dtype(f"pool_{i}"))(x)
    x = layers.Flatten(name="flatten", dtype=dtype("flatten"))(x)
    for i, units in enumerate(config.hidden_units, start=1):
        x = layers.Dense(units, activation="relu", name=f"dense_{i}", dtype=dtype(f"dense_{i}"))(x)
    return x


def _transformer_body(inputs, config: ModelConfig, spec: DataSpec, statistics: Statistics, dtype, sensitive):
    """Token ids, or image rows cut into patches, through the pre-norm encoder (transformer.py) to pooled float32
    features. Token ids are not standardised (they are categories)."""
    if spec.tokens:
        x = transformer.embed_tokens(inputs, config, spec.vocab_size, sensitive)
        return transformer.pool(transformer.encode(x, config, dtype, sensitive, ids=inputs), ids=inputs)
    images = _as_images(inputs, spec, config.kind)
    height, width = images.shape[1], images.shape[2]
    if height % config.patch_size or width % config.patch_size:
        raise ModelError(f"model.patch_size: {config.patch_size}-pixel patches do not tile the {height}×{width} "
                         f"images; use a divisor of both ({', '.join(str(d) for d in range(1, min(height, width) + 1) if height % d == 0 and width % d == 0)})")
    if config.normalize:
        images = _standardize(images, statistics, sensitive("standardize"))
    x = transformer.embed_patches(images, config, sensitive)
    return transformer.pool(transformer.encode(x, config, dtype, sensitive))


def _as_images(inputs, spec: DataSpec, kind: str):
    """The rows as [height, width, channels] images (a float32 reshape: the raw values stay exact)."""
    if len(spec.input_shape) == 3:
        return inputs
    if spec.image_shape is None:
        raise ModelError(f"model.kind '{kind}' needs image-shaped rows, but the rows are {list(spec.input_shape)} "
                         "features; set data.image_shape: [height, width, channels]")
    return layers.Reshape(spec.image_shape, name="to_image", dtype="float32")(inputs)


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


def _import_builder(builder: str) -> Callable:
    module_name, _, function_name = builder.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module, reported in one line
        raise ModelError(f"model.builder: cannot import module {module_name!r} of {builder!r}: "
                         f"{type(e).__name__}: {e} (it must be importable from the working directory or PYTHONPATH)") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelError(f"model.builder: module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
                         f"{function_name!r}")
    return function


def _build_custom(config: ModelConfig, spec: DataSpec, statistics: Statistics, float32_layers: Sequence[str],
                  float16_layers: Sequence[str], checks: bool = True) -> keras.Model:
    """The user's model, called as builder(input_shape=..., num_classes=..., **model.params) under the
    current policy, behind the pipeline's raw float32 input and standardisation, with its numerically
    sensitive layers and float32_layers computing in float32."""
    function = _import_builder(config.builder)
    kwargs = {"input_shape": spec.input_shape, "num_classes": spec.num_outputs, **config.params}
    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as e:
        raise ModelError(f"model.builder {config.builder!r} cannot be called with input_shape, num_classes and "
                         f"model.params {sorted(config.params)}: {e}") from None
    user = function(**kwargs)
    if not isinstance(user, keras.Model):
        raise ModelError(f"model.builder {config.builder!r} returned {type(user).__name__}, not a keras.Model")
    n_inputs, n_outputs = _count_tensors(user, "inputs"), _count_tensors(user, "outputs")
    if n_inputs > 1 or n_outputs > 1:
        raise ModelError(f"model.builder {config.builder!r}: the pipeline feeds one input and serves one output; "
                         f"the model has {n_inputs} inputs and {n_outputs} outputs")
    apply_precision_rules(user, float32_layers, float16_layers)

    # The builder may use any names, the pipeline's own included: ours give way (the signature's input name
    # is spec.input_name whatever the Keras input layer is called).
    taken = {layer.name for layer in layer_paths(user).values()}
    inputs = keras.Input(shape=spec.input_shape, name=_free_name(spec.input_name, taken), dtype="float32")
    x = inputs
    if config.normalize and not spec.tokens:  # token ids are categories: the builder gets them as they are
        name = _free_name("standardize", taken)
        x = _standardize(inputs, statistics, _sensitive_dtype_for(float16_layers)(name), name=name,
                         categorical=spec.categorical)
    try:
        outputs = _call_inlined(user, inputs, x)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - a shape the user's model cannot take
        raise ModelError(f"model.builder {config.builder!r}: the model cannot take inputs of shape "
                         f"{list(spec.input_shape)}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    model = keras.Model(inputs, outputs, name=user.name)
    over_range.keep_over_range_in_float32(model, statistics.sample_x, float16_layers, statistics.largest_magnitude())
    _check_custom_output(model, config.builder, spec, statistics.sample_x if checks else None, float32_layers,
                         float16_layers)
    _check_follows_policy(model, config.builder)
    if checks:
        exportable.check_exportable(model, config.builder)
    return model


def _free_name(name: str, taken: set[str]) -> str:
    """name, or the first of pipeline_name, pipeline_name_2, ... that the user's model does not use."""
    candidates = [name, f"pipeline_{name}"] + [f"pipeline_{name}_{i}" for i in range(2, len(taken) + 3)]
    return next(candidate for candidate in candidates if candidate not in taken)


def _count_tensors(model: keras.Model, attr: str) -> int:
    """len(model.inputs/outputs); 1 for a subclassed or unbuilt model, which has none until called."""
    try:
        return len(keras.tree.flatten(getattr(model, attr)))
    except (AttributeError, ValueError):
        return 1


def _call_inlined(user: keras.Model, inputs, x):
    """Applies the user's layers to x inside the pipeline's graph, so they appear (and can be found by
    name) in the pipeline's model, sharing their weights. A subclassed model cannot be taken apart and is
    called as one layer."""
    if isinstance(user, keras.Sequential):
        for layer in user.layers:
            if isinstance(layer, keras.Model):  # a fresh graph for a nested model: see clone_model below
                layer = keras.models.clone_model(layer, clone_function=lambda inner: inner, recursive=True)
            x = layer(x)
        return x

    def call_function(layer, *args, **kwargs):  # feeds the standardized tensor where the raw input went
        return layer(*keras.tree.map_structure(lambda t: x if t is inputs else t, args), **kwargs)

    try:
        # recursive: nested models get graphs of their own layers anew, so their outputs take the dtypes
        # apply_precision_rules set (called as one layer, a model reuses its old output dtype: docs/keras3-mixed-precision.md §8).
        inlined = keras.models.clone_model(user, input_tensors=inputs, clone_function=lambda layer: layer,
                                           call_function=call_function, recursive=True)
    except ValueError as e:
        if "only supported" not in str(e):
            raise
        return user(x)
    return inlined.output


def _check_custom_output(model: keras.Model, builder: str, spec: DataSpec, sample_x: np.ndarray | None,
                         float32_layers: Sequence[str] = (), float16_layers: Sequence[str] = ()) -> None:
    """The output has the task's width and, on training rows (unless sample_x is None), is finite and, for
    classification, holds probabilities (a softmax); a non-finite output names the layer that made it."""
    width = model.output.shape[-1] if len(model.output.shape) > 1 else 1
    if width != spec.num_outputs or len(model.output.shape) > 2:
        what = f"{spec.num_classes} class probabilities" if spec.task == "classification" else "1 prediction"
        raise ModelError(f"model.builder {builder!r}: the model's output has shape {list(model.output.shape)}; "
                         f"the task needs [batch, {spec.num_outputs}] ({what} per row)")
    check_float32_outputs(model)
    if sample_x is None:
        return
    rows = nonfinite.probe_rows(sample_x)
    scores = keras.ops.convert_to_numpy(model(rows, training=False))
    if not np.all(np.isfinite(scores)):
        found = nonfinite.first_nonfinite(model, rows)
        cause = (nonfinite.describe(found, keras.config.dtype_policy().name, float32_layers, float16_layers)
                 if found else "set precision.check_numerics: true to find the op")
        raise ModelError(f"model.builder {builder!r}: the model's outputs are inf or NaN on training rows: {cause}")
    if spec.task == "classification":
        if not (np.all(scores >= 0) and np.allclose(scores.sum(axis=-1), 1.0, atol=1e-3)):
            raise ModelError(f"model.builder {builder!r}: for classification the model must output class probabilities "
                             "(end with keras.layers.Activation('softmax', dtype='float32')); its outputs do not sum to 1")


def _check_follows_policy(model: keras.Model, builder: str) -> None:
    """At least one layer with a kernel computes in the policy's compute dtype; otherwise the builder
    fixed every dtype itself, and the export would contradict the policy it records."""
    compute_dtype = keras.config.dtype_policy().compute_dtype
    kernels = [layer for layer in layer_paths(model).values() if getattr(layer, "kernel", None) is not None]
    if kernels and compute_dtype != "float32" and not any(layer.compute_dtype == compute_dtype for layer in kernels):
        policy = keras.config.dtype_policy().name
        if all(numerically_sensitive(layer) for layer in kernels):
            raise ModelError(f"model.builder {builder!r}: no layer computes in {compute_dtype}, the compute dtype of "
                             f"policy {policy}: its only layers with weights ({', '.join(l.name for l in kernels)}) are "
                             "numerically sensitive and compute in float32; train it under precision.policy float32")
        raise ModelError(f"model.builder {builder!r}: no layer computes in {compute_dtype}, the compute dtype of policy "
                         f"{policy}; build layers without a dtype so they follow the policy "
                         "(use precision.float32_layers for the ones that must stay float32)")


def _check_layer_names(model: keras.Model, names: Sequence[str], key: str) -> None:
    paths = layer_paths(model)
    known = set(paths) | {layer.name for layer in paths.values()}
    unknown = [name for name in names if name not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(f"precision.{key}: no layer named {unknown[0]!r} in model {model.name!r}; {hint}"
                         f"its layers are: {', '.join(layer.name for layer in model.layers if not isinstance(layer, layers.InputLayer))} "
                         "(a layer inside another by its full path, e.g. 'block_1_attention/query')")


def _softmax_input(model: keras.Model):
    """The tensor fed to the model's final softmax layer (the logits), or None if there is no such layer."""
    operation, node_index, _ = model.output._keras_history
    is_softmax = isinstance(operation, layers.Softmax) or (
        isinstance(operation, layers.Activation) and operation.get_config().get("activation") == "softmax")
    if not is_softmax:
        return None
    return operation._inbound_nodes[node_index].input_tensors[0]
