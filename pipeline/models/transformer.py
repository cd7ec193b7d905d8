"""model.kind transformer: a pre-norm encoder over image patches or token ids, and the Keras layers it is made of.

    image rows:  standardize → Conv2D patch embedding (patch_size² pixels → width) ┐
    token ids:   TokenEmbedding (ids → width; out-of-vocabulary ids → one extra row) ┴→ + learned positions
    → num_layers × [x + Dropout(MultiHeadAttention(LayerNorm(x)))  →  x + Dropout(Dense(GELU(Dense(LayerNorm(x)))))]
    → LayerNorm → mean over the tokens (token ids: over the non-padding ones) → the float32 head

Where each part computes under a mixed policy (docs/precision.md#attention-and-transformers):
- the embeddings in float32: they read the raw input, whose range a serving request can exceed by far;
- the residual stream (positions, the Add layers, the pooling) in float32: a long sum of small updates;
- LayerNormalization, attention's query and key projections and its softmax in float32: the numerically
  sensitive rule of float32_rule.py, which reaches inside MultiHeadAttention;
- attention's value and output projections and the MLP in the policy's dtype: where the FLOPs are.
Token ids enter as float32 (the export's boundary) and padding (id 0) is masked out of attention and pooling.
"""

from __future__ import annotations

import keras
from keras import layers, ops

from pipeline.config import ModelConfig
from pipeline.data import DataSpec, Statistics
from pipeline.errors import ModelError
from pipeline.models import preprocessing

PAD = 0


@keras.saving.register_keras_serializable(package="pipeline")
class TokenEmbedding(layers.Layer):
    """float32 token ids → embeddings. An id outside 0..vocab_size-1, or not an integer (a request may send
    anything a float32 holds), reads one extra row, the same for all of them: every input stays finite."""

    def __init__(self, vocab_size: int, width: int, **kwargs):
        super().__init__(autocast=False, **kwargs)  # ids are never cast to float16 (2049 would round to 2048)
        self.vocab_size = vocab_size
        self.width = width

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(self.vocab_size + 1, self.width), name="embeddings",
                                          initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, ids):
        ids = ops.cast(ids, "float32")
        known = ops.logical_and(ops.logical_and(ids >= 0, ids < self.vocab_size), ops.equal(ids, ops.round(ids)))
        index = ops.where(known, ops.cast(ops.where(known, ids, 0.0), "int32"), self.vocab_size)
        return ops.cast(ops.take(self.embeddings, index, axis=0), self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "width": self.width}


@keras.saving.register_keras_serializable(package="pipeline")
class PositionEmbedding(layers.Layer):
    """Adds one learned vector per position."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=tuple(input_shape[1:]), name="positions",
                                         initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + ops.cast(self.positions, x.dtype)


@keras.saving.register_keras_serializable(package="pipeline")
class PaddingMask(layers.Layer):
    """float32 token ids [batch, length] → [batch, 1, length]: which keys attention may look at (not padding)."""

    def __init__(self, **kwargs):
        super().__init__(autocast=False, **kwargs)

    def call(self, ids):
        return ops.expand_dims(ops.not_equal(ids, PAD), 1)

    def compute_output_spec(self, ids):
        return keras.KerasTensor((ids.shape[0], 1, ids.shape[1]), dtype="bool")


@keras.saving.register_keras_serializable(package="pipeline")
class MaskedMeanPooling(layers.Layer):
    """The mean of x [batch, length, width] over the positions whose token id is not padding (zeros for a row of
    padding only)."""

    def __init__(self, **kwargs):
        super().__init__(autocast=False, **kwargs)

    def call(self, x, ids):
        keep = ops.cast(ops.expand_dims(ops.not_equal(ids, PAD), -1), x.dtype)
        return ops.sum(x * keep, axis=1) / ops.maximum(ops.sum(keep, axis=1), 1.0)

    def compute_output_spec(self, x, ids):
        return keras.KerasTensor((x.shape[0], x.shape[2]), dtype=x.dtype)


def body(inputs, config: ModelConfig, spec: DataSpec, statistics: Statistics, dtype, sensitive):
    """Token ids, or image rows cut into patches, through the pre-norm encoder below to pooled float32
    features. Token ids are not standardised (they are categories)."""
    if spec.tokens:
        x = embed_tokens(inputs, config, spec.vocab_size, sensitive)
        return pool(encode(x, config, dtype, sensitive, ids=inputs), ids=inputs)
    images = preprocessing.as_images(inputs, spec, config.kind)
    height, width = images.shape[1], images.shape[2]
    if height % config.patch_size or width % config.patch_size:
        raise ModelError(f"model.patch_size: {config.patch_size}-pixel patches do not tile the {height}×{width} "
                         f"images; use a divisor of both ({', '.join(str(d) for d in range(1, min(height, width) + 1) if height % d == 0 and width % d == 0)})")
    if config.normalize:
        images = preprocessing.standardize(images, statistics, sensitive("standardize"))
    x = embed_patches(images, config, sensitive)
    return pool(encode(x, config, dtype, sensitive))


def embed_patches(images, config, sensitive):
    """[batch, height, width, channels] → [batch, patches, config.width]: a Conv2D with stride patch_size is the
    linear patch embedding."""
    size = config.patch_size
    height, width = images.shape[1], images.shape[2]
    x = layers.Conv2D(config.width, size, strides=size, name="patch_embedding", dtype=sensitive("patch_embedding"))(images)
    x = layers.Reshape(((height // size) * (width // size), config.width), name="patches", dtype="float32")(x)
    return PositionEmbedding(name="positions", dtype=sensitive("positions"))(x)


def embed_tokens(ids, config, vocab_size: int, sensitive):
    """[batch, length] float32 ids → [batch, length, config.width]."""
    x = TokenEmbedding(vocab_size, config.width, name="token_embedding", dtype=sensitive("token_embedding"))(ids)
    return PositionEmbedding(name="positions", dtype=sensitive("positions"))(x)


def encode(x, config, dtype, sensitive, ids=None):
    """config.num_layers pre-norm blocks and the final LayerNorm; ids (token data) masks padding out of attention."""
    mask = PaddingMask(name="padding_mask")(ids) if ids is not None else None
    for i in range(1, config.num_layers + 1):
        name = f"block_{i}"
        h = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_norm_1", dtype=sensitive(f"{name}_norm_1"))(x)
        h = layers.MultiHeadAttention(config.num_heads, config.width // config.num_heads, dropout=config.dropout,
                                      name=f"{name}_attention", dtype=dtype(f"{name}_attention"))(
            h, h, attention_mask=mask)
        x = _residual(x, h, config, f"{name}_attention", sensitive)
        h = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_norm_2", dtype=sensitive(f"{name}_norm_2"))(x)
        h = layers.Dense(config.mlp_units, activation="gelu", name=f"{name}_mlp_1", dtype=dtype(f"{name}_mlp_1"))(h)
        h = layers.Dense(config.width, name=f"{name}_mlp_2", dtype=dtype(f"{name}_mlp_2"))(h)
        x = _residual(x, h, config, f"{name}_mlp", sensitive)
    return layers.LayerNormalization(epsilon=1e-6, name="final_norm", dtype=sensitive("final_norm"))(x)


def pool(x, ids=None):
    """[batch, length, width] → [batch, width] in float32: the mean over the tokens (not the padding)."""
    if ids is None:
        return layers.GlobalAveragePooling1D(name="pool", dtype="float32")(x)
    return MaskedMeanPooling(name="pool", dtype="float32")(x, ids)


def _residual(x, branch, config, name: str, sensitive):
    if config.dropout:
        branch = layers.Dropout(config.dropout, name=f"{name}_dropout")(branch)
    return layers.Add(name=f"{name}_residual", dtype=sensitive(f"{name}_residual"))([x, branch])
