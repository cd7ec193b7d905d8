"""Generation for the causal language model as one TensorFlow graph (issue 29): strings in, strings out, with the
key/value cache and the sampling inside, so a SavedModel's `generate` signature does it all in one call and
stock tensorflow_model_server can run it (core ops only: no XLA-only ops, no py_func; a sentencepiece tokenizer adds
TF Text's ops, pipeline/tokenizers.py).

The steps of `Generator.generate`:
- max_new_tokens is clamped to 0..context_length-1; each prompt becomes BOS + its tokens (the tokenizer's: bytes
  by default); a prompt longer than context_length - max_new_tokens keeps BOS and its last tokens (truncated from
  the left), so prompt + new tokens always fit the context.
- Prompts are right-padded with PAD: a row's real tokens never attend to the padding after them (causal), each
  row decodes at its own position (lengths + step) and attends to its cache up to there, so a prompt gives the
  same tokens alone and in a batch of other lengths.
- One forward pass over the prompts fills the cache (causal_lm.prefill), then one token per row per step in a
  tf.while_loop (causal_lm.decode_step), until every row has emitted EOS or max_new_tokens are out.
- temperature 0: greedy. Otherwise top-k sampling (top_k ≤ 0 or ≥ the vocabulary: all of it) with
  tf.random.stateless_categorical seeded by (seed, step): the same seed gives the same text, in any process.
  PAD and BOS (and a sentencepiece tokenizer's unknown id) are never chosen (they are not text).
- log_probs: each chosen token's log-probability under the distribution it was drawn from (temperature-scaled,
  top-k-truncated); greedy: under the model's own distribution (temperature 1). 0 for padding; EOS counts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import keras
import tensorflow as tf

from pipeline import causal_lm, tokenizers
from pipeline.errors import ModelError

GENERATE_SIGNATURE = (
    tf.TensorSpec([None], tf.string, name="prompts"),
    tf.TensorSpec([], tf.int32, name="max_new_tokens"),
    tf.TensorSpec([], tf.float32, name="temperature"),
    tf.TensorSpec([], tf.int32, name="top_k"),
    tf.TensorSpec([], tf.int64, name="seed"),
)

# Every op type the exported graph may hold, as found in exports under float32, mixed_float16 and mixed_bfloat16,
# tied or not: core TensorFlow ops, all in stock tensorflow_model_server (DisableCopyOnRead, in the SavedModel's
# save function, since TensorFlow 2.15). A test fails on any other.
SERVING_OPS = frozenset({
    # the tokenizer and the strings out
    "DecodePaddedRaw", "ReduceJoin", "StringLength",
    # the model, the sampling and the loop
    "AddV2", "All", "Any", "ArgMax", "BatchMatMulV2", "BiasAdd", "BroadcastTo", "Cast", "ConcatV2", "Const",
    "Equal", "Erfc", "Exp", "ExpandDims", "Fill", "GatherV2", "Greater", "GreaterEqual", "Identity", "Less",
    "LessEqual", "LogSoftmax", "LogicalAnd", "LogicalNot", "LogicalOr", "MatMul", "Max", "Maximum", "Mean",
    "Minimum", "Mul", "Neg", "NoOp", "Pack", "Pad", "PadV2", "Placeholder", "Prod", "Range", "RealDiv", "Reshape",
    "Rsqrt", "Select", "SelectV2", "Shape", "Softmax", "SquaredDifference", "StatelessIf", "StatelessMultinomial",
    "StopGradient", "StridedSlice", "Sub", "Sum", "TopKV2", "Transpose", "While",
    # variables, function calls and the SavedModel's save/restore functions
    "AssignVariableOp", "DisableCopyOnRead", "MergeV2Checkpoints", "ReadVariableOp", "RestoreV2", "SaveV2",
    "ShardedFilename", "StatefulPartitionedCall", "StaticRegexFullMatch", "StringJoin", "VarHandleOp",
})


class _OneTracePerGenerator(logging.Filter):
    """Drops TensorFlow's "N out of the last M calls ... triggered tf.function retracing" warning for generate:
    TensorFlow counts the traces of every instance's tf.function by the method's code, so the export's parity
    gate (a trained, a float32 and a recompute Generator, each traced once, as it must be) set it off on every
    language-model export, advising a fix for a problem it did not have."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message and "Generator._" in message)


logging.getLogger("tensorflow").addFilter(_OneTracePerGenerator())


class Generator:
    """A causal_lm model with its generation as tf.functions for the export (save): `generate` (strings in, the
    dict of the module docstring out) and `logits` (ids → float32 logits, the teacher-forced serving call).
    use_cache=False recomputes the whole sequence every step instead: the reference the cache is held to.
    tokenizer: the model's (pipeline/tokenizers.py), bytes by default."""

    def __init__(self, model: keras.Model, use_cache: bool = True, tokenizer=tokenizers.BYTES):
        if model.output_shape[-1] != tokenizer.vocab_size:
            raise ModelError(f"generate: the model has {model.output_shape[-1]} logits, the {tokenizer.kind} "
                             f"tokenizer {tokenizer.vocab_size} ids")
        self.model = model
        self.tokenizer = tokenizer
        self.use_cache = use_cache
        self.context_length = causal_lm.context_length(model)
        self.generate = tf.function(self._generate, input_signature=GENERATE_SIGNATURE)
        self.logits = tf.function(self._logits, input_signature=(tf.TensorSpec([None, None], tf.int32, name="ids"),))

    def signatures(self) -> dict:
        """serving_default: int32 ids [batch, time] → {'logits': float32 [batch, time, vocab]} (ids are
        integers, so no float32 boundary); generate: the generate function."""
        return {"serving_default": self.logits.get_concrete_function(),
                "generate": self.generate.get_concrete_function()}

    def _logits(self, ids):
        return {"logits": self.model(ids, training=False)}

    def _generate(self, prompts, max_new_tokens, temperature, top_k, seed):
        max_new = tf.clip_by_value(max_new_tokens, 0, self.context_length - 1)
        ids, lengths = prompt_ids(prompts, self.context_length - max_new, self.tokenizer)
        batch = tf.shape(ids)[0]
        start, step_fn = (self._cached_start, self._cached_step) if self.use_cache else (self._full_start,
                                                                                         self._full_step)
        logits, state = start(ids, lengths)
        columns = tf.range(max_new)[None, :]

        def keep_going(step, logits, state, out_ids, out_log_probs, done):
            return tf.logical_and(step < max_new, tf.logical_not(tf.reduce_all(done)))

        def body(step, logits, state, out_ids, out_log_probs, done):
            token, log_prob = choose(logits, temperature, top_k, seed, step, self.tokenizer.never_generated)
            token, log_prob = tf.where(done, self.tokenizer.pad, token), tf.where(done, 0.0, log_prob)
            here = tf.equal(columns, step)
            out_ids = tf.where(here, token[:, None], out_ids)
            out_log_probs = tf.where(here, log_prob[:, None], out_log_probs)
            done = tf.logical_or(done, tf.equal(token, self.tokenizer.eos))
            # The last step's logits go unused; its position lengths + max_new - 1 still fits the context.
            logits, state = step_fn(state, token, lengths + step)
            return step + 1, logits, state, out_ids, out_log_probs, done

        loop_vars = (tf.constant(0), logits, state, tf.fill([batch, max_new], self.tokenizer.pad),
                     tf.zeros([batch, max_new], tf.float32), tf.zeros([batch], tf.bool))
        _, _, _, out_ids, out_log_probs, _ = tf.while_loop(keep_going, body, loop_vars)
        return {"completions": self.tokenizer.decode(out_ids),
                "ids": out_ids,
                # PAD and BOS are never chosen and EOS ends a row, so the text ids are the tokens before EOS.
                "lengths": tf.reduce_sum(tf.cast(self.tokenizer.is_text(out_ids), tf.int32), axis=1),
                "log_probs": out_log_probs}

    def _cached_start(self, ids, lengths):
        return causal_lm.prefill(self.model, ids, lengths - 1)

    def _cached_step(self, caches, tokens, positions):
        return causal_lm.decode_step(self.model, tokens, positions, caches)

    def _full_start(self, ids, lengths):
        """The recompute reference keeps every row's tokens in a [batch, context_length] buffer."""
        tokens = tf.pad(ids, [[0, 0], [0, self.context_length - tf.shape(ids)[1]]],
                        constant_values=self.tokenizer.pad)
        return tf.gather(self.model(ids, training=False), lengths - 1, batch_dims=1), tokens

    def _full_step(self, tokens, new, positions):
        tokens = tf.where(tf.equal(tf.range(self.context_length)[None, :], positions[:, None]), new[:, None], tokens)
        logits = self.model(tokens[:, : tf.reduce_max(positions) + 1], training=False)
        return tf.gather(logits, positions, batch_dims=1), tokens


def recompute_generate(model: keras.Model, tokenizer=tokenizers.BYTES):
    """generate without a cache (the whole sequence through the model at every step), same signature: the
    reference for tests and the benchmark. Greedy, it gives the cached generate's tokens."""
    return Generator(model, use_cache=False, tokenizer=tokenizer).generate


def prompt_ids(prompts, budget, tokenizer=tokenizers.BYTES):
    """tf.string [batch], budget int32 (tokens a prompt may take, ≥ 1) → (ids int32 [batch, longest]:
    BOS + the prompt's last budget-1 tokens, right-padded with PAD; lengths int32 [batch])."""
    data, n = tokenizer.encode_padded(prompts)
    keep = tf.minimum(n, budget - 1)
    width = tf.reduce_max(tf.concat([keep, [0]], 0))
    j = tf.range(width)[None, :]
    # a row's last keep tokens start at n - keep; past a row's end data holds PAD, and one more PAD column takes
    # the indices past the longest row
    index = tf.minimum((n - keep)[:, None] + j, tf.shape(data)[1])
    taken = tf.gather(tf.pad(data, [[0, 0], [0, 1]], constant_values=tokenizer.pad), index, batch_dims=1)
    return tf.concat([tf.fill([tf.shape(data)[0], 1], tokenizer.bos), taken], axis=1), keep + 1


def choose(logits, temperature, top_k, seed, step, never_generated=tokenizers.BYTES.never_generated):
    """float32 logits [batch, vocab] → (token int32 [batch], its log-probability float32 [batch]): greedy when
    temperature ≤ 0, else top-k sampling, stateless from (seed, step); never_generated ids are never chosen."""
    vocab = logits.shape[-1]
    never = tf.reduce_any(tf.equal(tf.range(vocab)[:, None], list(never_generated)), axis=1)
    logits = tf.where(never[None, :], float("-inf"), logits)

    def pick(log_probs, token):
        return token, tf.gather(log_probs, token, batch_dims=1)

    def greedy():
        return pick(tf.nn.log_softmax(logits), tf.argmax(logits, axis=-1, output_type=tf.int32))

    def sample():
        scaled = logits / temperature
        k = tf.where(tf.logical_and(top_k > 0, top_k < vocab), top_k, vocab)
        kth = tf.math.top_k(scaled, k).values[:, -1:]
        scaled = tf.where(scaled >= kth, scaled, float("-inf"))
        seeds = tf.stack([tf.cast(seed, tf.int64), tf.cast(step, tf.int64)])
        token = tf.random.stateless_categorical(scaled, 1, seeds, dtype=tf.int32)[:, 0]
        return pick(tf.nn.log_softmax(scaled), token)

    return tf.cond(temperature > 0, sample, greedy)


def save(generator: Generator, path: str | Path) -> None:
    """The SavedModel with the serving_default and generate signatures (also callable as .logits and .generate
    after tf.saved_model.load).

    Its root tracks the tf.Variables the functions capture, not the Keras model, as keras.export.ExportArchive
    does: a root that tracks a Keras 3 model loads with tf.saved_model.load but not in a TF1 Session, which is how
    tensorflow_model_server loads a SavedModel ('Could not find variable ...': the checkpoint restores other
    handles than the functions read)."""
    signatures = generator.signatures()
    root = tf.Module()
    root.generate, root.logits = generator.generate, generator.logits
    captured = {id(variable): variable for function in signatures.values() for variable in function.variables}
    root.model_variables = list(captured.values())
    tf.saved_model.save(root, str(path), signatures=signatures)


def saved_model_op_types(path: str | Path) -> set[str]:
    """Every op type in a SavedModel's graphs: the meta graphs' nodes and every function in their libraries
    (a call of a library function by its name is not an op and is left out)."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((Path(path) / "saved_model.pb").read_bytes())
    ops = set()
    for meta_graph in saved.meta_graphs:
        graph = meta_graph.graph_def
        functions = {function.signature.name for function in graph.library.function}
        ops |= {node.op for node in graph.node}
        for function in graph.library.function:
            ops |= {node.op for node in function.node_def}
        ops -= functions
    return ops
