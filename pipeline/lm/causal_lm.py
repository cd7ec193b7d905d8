"""A decoder-only language model over token ids (issue 29): the model, and the two halves of a cached forward pass
(prefill, decode_step) that pipeline/lm/generate.py drives. The tokenizers are pipeline/lm/tokenizers.py's.

    ids [batch, time] int32 → ReversibleEmbedding + LearnedPositions
    → num_layers × DecoderBlock: x + attention(LayerNorm(x)), x + MLP(LayerNorm(x)), causal
    → final LayerNorm → logits [batch, time, vocab] float32 (the embedding reversed, or a float32 Dense)

Where each part computes under a mixed policy (docs/precision.md#attention-and-transformers):
- the embeddings, the positions and the residual stream in float32 (the raw range, the long sum of updates).
  The embedding and position tables are stored in the policy's variable dtype (storage_dtype): float32 under
  float32 and the mixed training policies, float16/bfloat16 under those serving policies, like every other weight;
  what they produce is cast to float32 right after the lookup, so the arithmetic is float32 either way;
- LayerNormalization, the attention scores, their softmax and the weighted sum, the final logits in float32;
- the query, key, value and output projections and the MLP in the policy's dtype: where the FLOPs are. Unlike a
  MultiHeadAttention's (models.apply_precision_rules pins those), the query and key projections may: in a pre-norm
  block they read LayerNorm's output, so q and k stay small; it is their dot product that overflows float16, and
  that is taken in float32. So the key/value cache holds exactly what the full forward pass computes, in the
  compute dtype (half of float32's bytes under a mixed policy).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers, ops

from pipeline.errors import ModelError
from pipeline.lm.tokenizers import BOS, EOS, NUM_BYTES, PAD, SPECIAL_IDS, VOCAB_SIZE  # noqa: F401 - the bytes tokenizer's ids

NEG_INF = -1e9  # a masked attention score: finite, so a fully masked row cannot turn into NaN


@keras.saving.register_keras_serializable(package="pipeline")
def gelu_tanh(x):
    """GELU in its tanh form, GPT-2's `gelu_new` (docs/pretrained.md#numerics): Keras' "gelu" is the erf form,
    up to ~4.7e-4 away, which would break parity with an imported checkpoint."""
    return keras.activations.gelu(x, approximate=True)


ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": gelu_tanh}  # a block's MLP activation, by the name its config keeps


# ---- the model's layers ----

def storage_dtype() -> str:
    """The dtype the embedding and position tables are stored in: the global policy's variable dtype, float32
    under float32 and the mixed policies training uses, float16/bfloat16 under those serving policies (export's
    rebuild), where every weight is stored so. Whatever it is, the tables' outputs are float32
    (docs/precision.md#attention-and-transformers)."""
    return keras.config.dtype_policy().variable_dtype


@keras.saving.register_keras_serializable(package="pipeline")
class ReversibleEmbedding(layers.Layer):
    """int32 ids → float32 embeddings; with reverse=True, float32 features → float32 logits over the same rows
    (tied embeddings). The table is stored in the layer's variable dtype (storage_dtype) and read as float32: the
    rows looked up are cast right after the lookup, the whole table before the logits' matmul. An id outside
    0..vocab_size-1 reads one extra row (a CPU gather fails on it otherwise), so a request's stray id gives finite
    logits."""

    def __init__(self, vocab_size: int, width: int, **kwargs):
        super().__init__(autocast=False, **kwargs)  # ids are never cast to a float dtype
        self.vocab_size = vocab_size
        self.width = width

    @property
    def compute_dtype(self):
        return "float32"  # whatever the table is stored in

    def build(self, input_shape=None):
        # autocast=False: read in its stored dtype, cast here (a gather's rows, not the table, for a lookup)
        self.embeddings = self.add_weight(shape=(self.vocab_size + 1, self.width), name="embeddings",
                                          initializer=keras.initializers.RandomNormal(stddev=0.02), autocast=False)

    def call(self, inputs, reverse: bool = False):
        if reverse:
            table = ops.cast(self.embeddings[: self.vocab_size], "float32")
            return ops.matmul(ops.cast(inputs, "float32"), ops.transpose(table))
        ids = ops.cast(inputs, "int32")
        known = ops.logical_and(ids >= 0, ids < self.vocab_size)
        return ops.cast(ops.take(self.embeddings, ops.where(known, ids, self.vocab_size), axis=0), "float32")

    def compute_output_shape(self, input_shape, reverse: bool = False):
        return (*input_shape[:-1], self.vocab_size) if reverse else (*input_shape, self.width)

    def compute_output_spec(self, inputs, reverse: bool = False):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape, reverse), dtype="float32")

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "width": self.width}


@keras.saving.register_keras_serializable(package="pipeline")
class LearnedPositions(layers.Layer):
    """Adds one learned vector per position to float32 [batch, time, width], time ≤ context_length (any length, so
    the same model takes a training window, a prompt and the teacher-forced serving call). Like the embedding's,
    the table is stored in the layer's variable dtype and what it adds is float32."""

    def __init__(self, context_length: int, **kwargs):
        super().__init__(autocast=False, **kwargs)  # the residual stream enters and leaves float32
        self.context_length = context_length

    @property
    def compute_dtype(self):
        return "float32"  # whatever the table is stored in

    def build(self, input_shape):
        self.positions = self.add_weight(shape=(self.context_length, input_shape[-1]), name="positions",
                                         initializer=keras.initializers.RandomNormal(stddev=0.02), autocast=False)

    def call(self, x):
        return ops.cast(x, "float32") + ops.cast(self.positions[: ops.shape(x)[1]], "float32")

    def at(self, positions):
        """int32 [batch] → float32 [batch, width]: the vectors of one position per row (the cached decode step)."""
        return ops.cast(ops.take(self.positions, positions, axis=0), "float32")

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "context_length": self.context_length}


@keras.saving.register_keras_serializable(package="pipeline")
class CausalSelfAttention(layers.Layer):
    """Multi-head causal self-attention whose two halves, project and attend, serve both the full forward pass
    and the cached decode step with the same weights (keras' MultiHeadAttention cannot hand out its keys and
    values). Projections in the layer's compute dtype; scores, softmax and the weighted sum in float32."""

    def __init__(self, num_heads: int, head_dim: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout
        width = num_heads * head_dim
        policy = self.dtype_policy  # the sublayers follow this layer's policy, as MultiHeadAttention's do
        self.query = layers.Dense(width, name="query", dtype=policy)
        self.key = layers.Dense(width, name="key", dtype=policy)
        self.value = layers.Dense(width, name="value", dtype=policy)
        self.output_projection = layers.Dense(width, name="attention_output", dtype=policy)
        # float32: under a mixed policy a Dropout casts its input to the compute dtype, even when not training
        self.weights_dropout = layers.Dropout(dropout, name="attention_dropout", dtype="float32")

    def build(self, input_shape):
        for dense in (self.query, self.key, self.value):
            dense.build(input_shape)
        self.output_projection.build((*input_shape[:-1], self.num_heads * self.head_dim))

    def project(self, x):
        """x [batch, time, width] (or [batch, width]: one token) → (q, k, v), each [batch, heads, time, head_dim]
        in the compute dtype."""
        return tuple(self._split_heads(dense(x)) for dense in (self.query, self.key, self.value))

    def attend(self, q, keys, values, mask, training=False):
        """q [batch, heads, tq, head_dim], keys and values [batch, heads, tk, head_dim], mask broadcastable to
        [batch, heads, tq, tk] (True: may attend) → float32 [batch, tq, width]: the heads' weighted sums, side by
        side, before the output projection."""
        q = ops.cast(q, "float32") * (self.head_dim ** -0.5)
        scores = ops.matmul(q, ops.swapaxes(ops.cast(keys, "float32"), -1, -2))
        weights = ops.softmax(ops.where(mask, scores, NEG_INF), axis=-1)
        weights = self.weights_dropout(weights, training=training)
        context = ops.matmul(weights, ops.cast(values, "float32"))  # [batch, heads, tq, head_dim]
        return ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (ops.shape(q)[0], -1, self.num_heads * self.head_dim))

    def attend_one(self, q, keys, values, visible):
        """attend for one query per row (the cached decode step): q [batch, heads, 1, head_dim], keys and values
        [batch, heads, tk, head_dim], visible [batch, tk] bool → float32 [batch, width]. The same float32 math
        written as elementwise products and sums: with one query row, oneDNN's batched matmul and softmax cost
        more to set up than to compute (measured: about half of a decode step's time)."""
        q = ops.cast(q, "float32") * (self.head_dim ** -0.5)
        scores = ops.sum(q * ops.cast(keys, "float32"), axis=-1)  # [batch, heads, tk]
        scores = ops.where(visible[:, None, :], scores, NEG_INF)
        scores = ops.exp(scores - ops.max(scores, axis=-1, keepdims=True))
        weights = scores / ops.sum(scores, axis=-1, keepdims=True)
        context = ops.sum(weights[..., None] * ops.cast(values, "float32"), axis=2)  # [batch, heads, head_dim]
        return ops.reshape(context, (-1, self.num_heads * self.head_dim))

    def call(self, x, training=None):
        q, k, v = self.project(x)
        return self.output_projection(self.attend(q, k, v, causal_mask(ops.shape(x)[1]), training))

    def _split_heads(self, x):
        x = ops.reshape(x, (ops.shape(x)[0], -1, self.num_heads, self.head_dim))
        return ops.transpose(x, (0, 2, 1, 3))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.num_heads * self.head_dim)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "head_dim": self.head_dim,
                "dropout": self.dropout}


@keras.saving.register_keras_serializable(package="pipeline")
class DecoderBlock(layers.Layer):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)). The residual stream x stays float32 (it is not
    autocast on entry); attention and the MLP follow the block's policy, its LayerNorms compute in float32."""

    def __init__(self, num_heads: int, width: int, mlp_width: int, dropout: float = 0.0, norm_epsilon: float = 1e-5,
                 remat: bool = False, activation: str = "gelu", **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.remat = remat  # training recomputes the block in the backward pass (model.remat)
        self.activation = activation  # a key of ACTIVATIONS: the MLP's GELU, erf (ours) or tanh (GPT-2's) form
        # not `epsilon`: models.numerically_sensitive would pin a layer with a small epsilon, MLP and all
        self.num_heads, self.width, self.mlp_width, self.dropout, self.norm_epsilon = (num_heads, width, mlp_width,
                                                                                        dropout, norm_epsilon)
        policy = self.dtype_policy
        self.norm_1 = layers.LayerNormalization(epsilon=norm_epsilon, name="norm_1", dtype="float32")
        self.attention = CausalSelfAttention(num_heads, width // num_heads, dropout, name="attention", dtype=policy)
        self.norm_2 = layers.LayerNormalization(epsilon=norm_epsilon, name="norm_2", dtype="float32")
        self.mlp_1 = layers.Dense(mlp_width, activation=ACTIVATIONS[activation], name="mlp_1", dtype=policy)
        self.mlp_2 = layers.Dense(width, name="mlp_2", dtype=policy)
        self.attention_dropout = layers.Dropout(dropout, name="attention_residual_dropout")
        self.mlp_dropout = layers.Dropout(dropout, name="mlp_residual_dropout")

    def build(self, input_shape):
        self.norm_1.build(input_shape)
        self.attention.build(input_shape)
        self.norm_2.build(input_shape)
        self.mlp_1.build(input_shape)
        self.mlp_2.build((*input_shape[:-1], self.mlp_width))

    def call(self, x, training=None):
        if self.remat and training:
            # the backward pass runs the block again rather than keeping its activations: keras.remat on a
            # positional-only function (docs/large-models.md#memory; Keras' RematScope("full") fails under fit)
            return keras.remat(lambda inputs: self.prefill(inputs, True)[0])(x)
        return self.prefill(x, training)[0]

    def prefill(self, x, training=False):
        """Full causal pass over [batch, time, width] float32 → (the block's output, (keys, values)), keys and
        values [batch, heads, time, head_dim] in the compute dtype: what the cache holds for these positions."""
        x = ops.cast(x, "float32")
        q, k, v = self.attention.project(self.norm_1(x))
        attended = self.attention.attend(q, k, v, causal_mask(ops.shape(x)[1]), training)
        x = self._add(x, self.attention.output_projection(attended), self.attention_dropout, training)
        return self._mlp(x, training), (k, v)

    def decode(self, x, cache, positions):
        """One new token per row: x [batch, width] float32 at positions int32 [batch]; cache (keys, values), each
        [batch, heads, context_length, head_dim] → (the block's output [batch, width], the cache with this token
        written at its row's position, in place: see write_in_place). A row attends to the cache up to its own
        position, so rows may be at different positions;
        [batch, width] rather than [batch, 1, width] keeps the Dense layers plain MatMuls (Keras computes a Dense
        of a 3-d input as a tensordot: a dozen shape ops more per layer and step)."""
        x = ops.cast(x, "float32")
        q, k, v = self.attention.project(self.norm_1(x))
        keys, values = write_in_place(cache[0], k, positions), write_in_place(cache[1], v, positions)
        seen = ops.max(positions) + 1  # attend over the filled part of the cache only
        visible = ops.arange(seen)[None, :] <= positions[:, None]  # [batch, seen]
        attended = self.attention.attend_one(q, keys[:, :, :seen], values[:, :, :seen], visible)
        x = self._add(x, self.attention.output_projection(attended), self.attention_dropout, False)
        return self._mlp(x, False), (keys, values)

    def _mlp(self, x, training):
        return self._add(x, self.mlp_2(self.mlp_1(self.norm_2(x))), self.mlp_dropout, training)

    @staticmethod
    def _add(x, branch, dropout, training):
        return x + ops.cast(dropout(branch, training=training), "float32")

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "width": self.width,
                "mlp_width": self.mlp_width, "dropout": self.dropout, "norm_epsilon": self.norm_epsilon,
                "remat": self.remat, "activation": self.activation}


def writable(caches):
    """Copies of the caches that write_in_place may overwrite: a decode loop takes one at its start (one copy per
    call rather than one per token), so the tensors it was given, its caller's, stay as they were."""
    return [tuple(tf.raw_ops.DeepCopy(x=tensor) for tensor in pair) for pair in caches]


def write_in_place(cache, new, positions):
    """cache [batch, heads, context_length, head_dim] with new [batch, heads, 1, head_dim] written at each row's
    position, into the cache's own buffer: an InplaceUpdate of the cache seen as [batch * heads *
    context_length, head_dim] rows (a reshape, so the same buffer). TensorScatterUpdate copied the whole cache
    for every token (2 MiB per row of bench figure 12's model: about half of a decode step at 8 rows or more);
    this writes the new rows only. Both are core TensorFlow ops. The cache's buffer is overwritten, so a caller
    passes one it owns (writable()); within a decode loop each step's cache is the one the step before returned."""
    shape = tf.shape(cache)
    batch, heads, context, head_dim = shape[0], shape[1], shape[2], shape[3]
    rows = (tf.range(batch)[:, None] * heads + tf.range(heads)[None, :]) * context + positions[:, None]
    flat = tf.raw_ops.InplaceUpdate(x=tf.reshape(cache, [-1, head_dim]), i=tf.reshape(rows, [-1]),
                                    v=tf.reshape(ops.cast(new, cache.dtype), [-1, head_dim]))
    written = tf.reshape(flat, shape)
    written.set_shape(cache.shape)
    return written


def causal_mask(time):
    """[time, time] bool: query i may attend to keys 0..i."""
    index = ops.arange(time)
    return index[:, None] >= index[None, :]


# ---- the model ----

def build_causal_lm(vocab_size: int = VOCAB_SIZE, context_length: int = 256, num_layers: int = 4,
                    num_heads: int = 4, width: int = 128, mlp_width: int = 512, dropout: float = 0.0,
                    tied_embeddings: bool = True, remat: bool = False, norm_epsilon: float = 1e-5,
                    activation: str = "gelu", logits_bias: bool = True) -> keras.Model:
    """int32 ids [batch, time ≤ context_length] → float32 logits [batch, time, vocab_size] for the next token at
    every position. Build under the run's policy (precision.apply_policy first): the float32 parts are pinned
    here (the embedding and position tables compute in float32 and are stored in the policy's variable dtype:
    storage_dtype), the rest follows the global policy. Layer names (token_embedding, positions, block_i, final_norm,
    logits) are what prefill and decode_step look up. vocab_size: the tokenizer's (the bytes one's VOCAB_SIZE by
    default). norm_epsilon, activation (a key of ACTIVATIONS) and logits_bias (of an untied head) are an imported
    checkpoint's (pipeline/lm/gpt2.py); the defaults are what every run trained from scratch has used."""
    if activation not in ACTIVATIONS:
        raise ModelError(f"causal_lm: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if width % num_heads:
        raise ModelError(f"causal_lm: width {width} is not a multiple of num_heads {num_heads}")
    if min(vocab_size, context_length, num_layers, num_heads, width, mlp_width) < 1:
        raise ModelError("causal_lm: vocab_size, context_length, num_layers, num_heads, width and mlp_width must be "
                         "at least 1")
    ids = keras.Input(shape=(None,), dtype="int32", name="ids")
    embedding = ReversibleEmbedding(vocab_size, width, name="token_embedding", dtype=storage_dtype())
    x = LearnedPositions(context_length, name="positions", dtype=storage_dtype())(embedding(ids))
    if dropout:
        x = layers.Dropout(dropout, name="embedding_dropout", dtype="float32")(x)  # the residual stream
    for i in range(1, num_layers + 1):
        x = DecoderBlock(num_heads, width, mlp_width, dropout, norm_epsilon, remat, activation, name=f"block_{i}")(x)
    x = layers.LayerNormalization(epsilon=norm_epsilon, name="final_norm", dtype="float32")(x)
    if tied_embeddings:
        logits = embedding(x, reverse=True)
    else:
        logits = layers.Dense(vocab_size, use_bias=logits_bias, name="logits", dtype="float32")(x)
    return keras.Model(ids, logits, name="causal_lm")


def blocks(model: keras.Model) -> list[DecoderBlock]:
    """The model's DecoderBlocks, first to last."""
    return [layer for layer in model.layers if isinstance(layer, DecoderBlock)]


def context_length(model: keras.Model) -> int:
    """The most positions the model has vectors for: prompt + generated tokens must fit."""
    return model.get_layer("positions").context_length


def cache_dtype(model: keras.Model) -> str:
    """The key/value cache's dtype: the attention's compute dtype (bfloat16 under mixed_bfloat16)."""
    return blocks(model)[0].attention.compute_dtype


def prefill(model: keras.Model, ids, last):
    """The prompt in one forward pass: ids int32 [batch, time] (right-padded), last int32 [batch] (each row's
    last prompt position) → (float32 logits [batch, vocab] for the token after it, one (keys, values) per block,
    each preallocated at [batch, heads, context_length, head_dim] in the compute dtype, positions ≥ time zero)."""
    x = model.get_layer("positions")(model.get_layer("token_embedding")(ids))
    room = context_length(model) - ops.shape(ids)[1]
    caches = []
    for block in blocks(model):
        x, (keys, values) = block.prefill(x)
        pad = [[0, 0], [0, 0], [0, room], [0, 0]]
        caches.append((ops.pad(keys, pad), ops.pad(values, pad)))
    return _logits(model, ops.take_along_axis(x, last[:, None, None], axis=1)[:, 0]), caches


def decode_step(model: keras.Model, tokens, positions, caches):
    """One token per row: tokens int32 [batch] at positions int32 [batch] → (float32 logits [batch, vocab] for
    the next token, the caches with this token's keys and values written in)."""
    x = model.get_layer("token_embedding")(tokens) + model.get_layer("positions").at(positions)
    written = []
    for block, cache in zip(blocks(model), caches):
        x, cache = block.decode(x, cache, positions)
        written.append(cache)
    return _logits(model, x), written


def _logits(model: keras.Model, x):
    """The final LayerNorm and the float32 logits of hidden states x."""
    x = model.get_layer("final_norm")(x)
    head = next((layer for layer in model.layers if layer.name == "logits"), None)
    return head(x) if head is not None else model.get_layer("token_embedding")(x, reverse=True)
