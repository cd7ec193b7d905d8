"""Generation for the causal language model as one TensorFlow graph (issue 29): strings in, strings out, with the
key/value cache and the sampling inside, so a SavedModel's `generate` signature does it all in one call and
stock tensorflow_model_server can run it (core ops only: no XLA-only ops, no py_func; a sentencepiece tokenizer adds
TF Text's ops, pipeline/lm/tokenizers.py).

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

from pipeline.lm import causal_lm, tokenizers
from pipeline.errors import ModelError
from serving.generation.decoder import CACHE_PREFIX, DECODE_STEP, PREFILL, TOKENIZE
from serving.generation.scoring import DETOKENIZE, SCORE

# The decode protocol (docs/serving.md#generation): the signatures a server steps generation with itself, one token
# at a time for every row of its decode batch, so that it can stream tokens, let each row finish or be cancelled
# on its own and add rows between steps. The key/value cache travels as the cache_* tensors, in the compute dtype:
# state a server hands back unchanged, not a client's data (the one reduced-precision exception at a signature
# boundary, docs/export.md#language-models). Each row has its own sampling settings, so rows of different requests
# share a step.
_ROW_SETTINGS = (
    tf.TensorSpec([None], tf.float32, name="temperature"),
    tf.TensorSpec([None], tf.int32, name="top_k"),
    tf.TensorSpec([None], tf.int64, name="seed"),
    tf.TensorSpec([None], tf.int32, name="row"),
)
PREFILL_SIGNATURE = (tf.TensorSpec([None], tf.string, name="prompts"),
                     tf.TensorSpec([None], tf.int32, name="max_new_tokens")) + _ROW_SETTINGS

SCORE_SIGNATURE = (tf.TensorSpec([None], tf.string, name="prompts"),
                   tf.TensorSpec([None, None], tf.int32, name="continuations"),
                   tf.TensorSpec([], tf.int32, name="top_n"))

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
    "StopGradient", "StridedSlice", "Sub", "Sum", "TopKV2", "Transpose", "While", "StatelessWhile", "PartitionedCall",
    "ZerosLike",
    # GPT-2's GELU, its tanh form (causal_lm.gelu_tanh)
    "Pow", "Tanh",
    # the key/value cache written in place, one position per row and head (causal_lm.write_in_place)
    "DeepCopy", "InplaceUpdate",
    # per-row sampling keys (seed, row << 32 | step), drawn row by row (tf.map_fn)
    "LeftShift", "TensorListFromTensor", "TensorListGetItem", "TensorListReserve", "TensorListSetItem",
    "TensorListStack",
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
    tokenizer: the model's (pipeline/lm/tokenizers.py), bytes by default."""

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
        self.tokenize = tf.function(self._tokenize, input_signature=(tf.TensorSpec([None], tf.string, name="prompts"),))
        self.prefill = tf.function(self._prefill, input_signature=PREFILL_SIGNATURE)
        step_inputs = (tf.TensorSpec([None], tf.int32, name="token"), tf.TensorSpec([None], tf.int32, name="position"),
                       tf.TensorSpec([None], tf.int32, name="step")) + _ROW_SETTINGS + (
                       tf.TensorSpec([], tf.int32, name="steps"),)
        self.decode_step = tf.function(self._decode_step, input_signature=step_inputs + (self._cache_specs(),))
        self.score = tf.function(self._score, input_signature=SCORE_SIGNATURE)
        # The prompt's forward pass that generate and prefill share, a function of its own: the SavedModel then
        # stores it once (docs/large-models.md#server-memory). The one-token step stays inline: as a function of its
        # own (its cache passed in and out) it decoded 16% fewer tokens/s at batch 8 at 85 M parameters (one A/B run).
        self._cached_start = tf.function(self._cached_start)
        self.detokenize = tf.function(self._detokenize,
                                      input_signature=(tf.TensorSpec([None, None], tf.int32, name="ids"),))

    def signatures(self) -> dict:
        """serving_default: int32 ids [batch, time] → {'logits': float32 [batch, time, vocab]} (ids are
        integers, so no float32 boundary); generate: the generate function; tokenize, prefill, decode_step: the
        decode protocol (see their methods); score: log-likelihoods of given text; detokenize: ids to text."""
        return {"serving_default": self.logits.get_concrete_function(),
                "generate": self.generate.get_concrete_function(),
                TOKENIZE: self.tokenize.get_concrete_function(),
                PREFILL: self.prefill.get_concrete_function(),
                DECODE_STEP: self.decode_step.get_concrete_function(),
                SCORE: self.score.get_concrete_function(),
                DETOKENIZE: self.detokenize.get_concrete_function()}

    def _cache_specs(self) -> dict[str, tf.TensorSpec]:
        """One [batch, heads, context_length, head_dim] tensor of keys and one of values per block."""
        dtype = tf.as_dtype(causal_lm.cache_dtype(self.model))
        specs = {}
        for i, block in enumerate(causal_lm.blocks(self.model)):
            shape = [None, block.attention.num_heads, self.context_length, block.attention.head_dim]
            for part in ("keys", "values"):
                name = f"{CACHE_PREFIX}{part}_{i}"
                specs[name] = tf.TensorSpec(shape, dtype, name=name)
        return specs

    def _tokenize(self, prompts):
        """prompts → {'prompt_tokens': int32 [batch]: the tokens each prompt takes, BOS included (a server checks
        prompt + max_new_tokens against the context with it before any model work), 'ids': int32 [batch, 1 +
        longest]: BOS and the prompt's tokens, PAD after a row's last (OpenAI-style /tokenize, serving/rest/openai.py)}."""
        ids, lengths = self.tokenizer.encode_padded(prompts)
        bos = tf.fill([tf.shape(ids)[0], 1], self.tokenizer.bos)
        return {"prompt_tokens": lengths + 1, "ids": tf.concat([bos, ids], axis=1)}

    def _detokenize(self, ids):
        """ids int32 [batch, time] → {'texts': string [batch]}: the ids' bytes joined; special ids and ids outside the
        vocabulary are no text (OpenAI-style /detokenize, serving/rest/openai.py)."""
        return {"texts": self.tokenizer.decode(ids)}

    def _prefill(self, prompts, max_new_tokens, temperature, top_k, seed, row):
        """The prompts in one forward pass and each row's first token (step 0): {'token', 'log_prob', 'piece',
        'finished', 'position' (where that token goes: the prompt's length), cache_*}. A prompt longer than
        context_length - max_new_tokens keeps BOS and its last tokens, as generate does."""
        max_new = tf.clip_by_value(max_new_tokens, 1, self.context_length - 1)
        ids, lengths = prompt_ids(prompts, self.context_length - max_new, self.tokenizer)
        logits, caches = self._cached_start(ids, lengths)
        chosen = self._chosen(*choose(logits, temperature, top_k, seed, row, tf.zeros_like(row),
                                      self.tokenizer.never_generated))
        return {**chosen, "position": lengths, **self._named(caches)}

    def _decode_step(self, token, position, step, temperature, top_k, seed, row, steps, caches):
        """`steps` tokens per row (≥ 1): each row's last token written into the cache at its position, the row's
        next token chosen (its step-th), and so on: {'token', 'log_prob', 'piece', 'finished': [batch, steps],
        cache_*}. Several tokens per call spare a server the call's fixed cost per token (about 0.5 ms here,
        docs/serving.md#generation); a row keeps going past its EOS within a call (the server drops the rest), so
        a caller keeps position + steps within the context."""
        blocks = range(len(causal_lm.blocks(self.model)))
        state = causal_lm.writable([(caches[f"{CACHE_PREFIX}keys_{i}"], caches[f"{CACHE_PREFIX}values_{i}"])
                                    for i in blocks])
        batch = tf.shape(token)[0]
        columns = tf.range(steps)[None, :]

        def body(i, token, state, tokens, log_probs):
            logits, state = self._cached_step(state, token, position + i)
            token, log_prob = choose(logits, temperature, top_k, seed, row, step + i, self.tokenizer.never_generated)
            here = tf.equal(columns, i)
            return (i + 1, token, state, tf.where(here, token[:, None], tokens),
                    tf.where(here, log_prob[:, None], log_probs))

        _, _, state, tokens, log_probs = tf.while_loop(
            lambda i, *_: i < steps, body,
            (tf.constant(0), token, state, tf.fill([batch, steps], self.tokenizer.pad),
             tf.zeros([batch, steps], tf.float32)))
        return {**self._chosen(tokens, log_probs), **self._named(state)}

    def _chosen(self, token, log_prob) -> dict:
        """A choice's outputs: the token ids, their log-probabilities, their bytes (`piece`: the tokenizer's
        pieces, which joined are the text's bytes), whether each ends its row's text (`finished`); any shape."""
        shape = tf.shape(token)
        pieces = tf.reshape(self.tokenizer.pieces(tf.reshape(token, [-1])), shape)
        return {"token": token, "log_prob": log_prob, "piece": pieces, "finished": tf.equal(token, self.tokenizer.eos)}

    @staticmethod
    def _named(caches) -> dict:
        return {f"{CACHE_PREFIX}{part}_{i}": tensor for i, pair in enumerate(caches)
                for part, tensor in zip(("keys", "values"), pair)}

    def _logits(self, ids):
        return {"logits": self.model(ids, training=False)}

    def _score(self, prompts, continuations, top_n):
        """Teacher forcing, for log-likelihoods (OpenAI's echo and logprobs, serving/generation/scoring.py): BOS,
        each prompt's tokens and its row of continuations (token ids, PAD after the row's last; width 0 for none)
        in one forward pass. Over the tokens after BOS: {'ids', 'pieces' (their bytes), 'log_probs' (each token's
        log-probability given those before it), 'top_ids', 'top_log_probs', 'top_pieces' ([batch, time, top_n]:
        the most likely tokens at each position)}, 'lengths' (tokens per row), 'prompt_tokens' (the prompt's of
        them). The distribution is the one greedy decoding draws from (temperature 1, the never-generated ids
        excluded), log-softmax of float32 logits under any policy (docs/precision.md). A prompt longer than the
        context leaves keeps its last tokens, as generate does; a server refuses such a prompt first."""
        pad = self.tokenizer.pad
        continuations = tf.convert_to_tensor(continuations, tf.int32)
        width = tf.shape(continuations)[1]
        prompt, lengths = prompt_ids(prompts, tf.maximum(self.context_length - width, 1), self.tokenizer)
        added = tf.reduce_sum(tf.cast(tf.logical_not(tf.equal(continuations, pad)), tf.int32), axis=1)
        total = lengths + added
        columns = tf.range(tf.shape(prompt)[1] + width)[None, :]
        # column j: the prompt's token while j < length, then continuation j - length, then PAD (the extra column)
        tail = tf.pad(continuations, [[0, 0], [0, 1]], constant_values=pad)
        tail_index = tf.where(columns < total[:, None], tf.maximum(columns - lengths[:, None], 0), width)
        ids = tf.where(columns < lengths[:, None], tf.pad(prompt, [[0, 0], [0, width]], constant_values=pad),
                       tf.gather(tail, tail_index, batch_dims=1))
        # serving_default's own function, called: the SavedModel stores the forward pass once for both signatures
        logits = tf.cast(self.logits(ids)["logits"], tf.float32)[:, :-1]  # position t predicts token t + 1
        vocab = logits.shape[-1]
        never = never_mask(vocab, self.tokenizer.never_generated)
        log_probs = tf.nn.log_softmax(tf.where(never[None, None, :], float("-inf"), logits))
        targets = ids[:, 1:]
        inside = columns[:, 1:] < total[:, None]
        top = tf.math.top_k(log_probs, tf.clip_by_value(top_n, 0, vocab))

        def pieces(token_ids):
            return tf.reshape(self.tokenizer.pieces(tf.reshape(token_ids, [-1])), tf.shape(token_ids))

        return {"ids": targets, "pieces": pieces(targets),
                "log_probs": tf.where(inside, tf.gather(log_probs, targets, batch_dims=2), 0.0),
                "top_ids": top.indices, "top_log_probs": top.values, "top_pieces": pieces(top.indices),
                "lengths": total - 1, "prompt_tokens": lengths - 1}

    def _generate(self, prompts, max_new_tokens, temperature, top_k, seed):
        max_new = tf.clip_by_value(max_new_tokens, 0, self.context_length - 1)
        ids, lengths = prompt_ids(prompts, self.context_length - max_new, self.tokenizer)
        batch = tf.shape(ids)[0]
        start, step_fn = (self._cached_start, self._cached_step) if self.use_cache else (self._full_start,
                                                                                         self._full_step)
        logits, state = start(ids, lengths)
        if self.use_cache:
            state = causal_lm.writable(state)  # prefill's own tensors; the copy keeps the loop's writes its own
        columns = tf.range(max_new)[None, :]
        rows = tf.range(batch)
        temperature, top_k, seed = (tf.fill([batch], value) for value in (temperature, top_k, seed))

        def keep_going(step, logits, state, out_ids, out_log_probs, done):
            return tf.logical_and(step < max_new, tf.logical_not(tf.reduce_all(done)))

        def body(step, logits, state, out_ids, out_log_probs, done):
            token, log_prob = choose(logits, temperature, top_k, seed, rows, tf.fill([batch], step),
                                     self.tokenizer.never_generated)
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


def never_mask(vocab: int, never_generated) -> tf.Tensor:
    """bool [vocab]: the ids a tokenizer never generates (none, for GPT-2's)."""
    return tf.reduce_any(tf.equal(tf.range(vocab)[:, None], tf.constant(list(never_generated), tf.int32)), axis=1)


def choose(logits, temperature, top_k, seed, row, step, never_generated=tokenizers.BYTES.never_generated):
    """float32 logits [batch, vocab] → (token int32 [batch], its log-probability float32 [batch]), each row on its
    own: temperature, top_k, seed, row and step are [batch]. A row is greedy when its temperature ≤ 0, else top-k
    sampled, stateless from the key (seed, row << 32 | step): a row's token depends on its own key only, not on
    the rows beside it, so a prompt sampled alone, in a generate call or in the server's decode batch
    (docs/serving.md#generation) gives the same text for the same seed. never_generated (the tokenizer's: PAD and
    BOS, and a sentencepiece tokenizer's unknown id) are never chosen."""
    vocab = logits.shape[-1]
    logits = tf.where(never_mask(vocab, never_generated)[None, :], float("-inf"), logits)
    greedy_token = tf.argmax(logits, axis=-1, output_type=tf.int32)

    def greedy():
        return greedy_token, tf.gather(tf.nn.log_softmax(logits), greedy_token, batch_dims=1)

    def sample():
        sampling = temperature > 0
        scaled = logits / tf.where(sampling, temperature, 1.0)[:, None]
        k = tf.where(tf.logical_and(top_k > 0, top_k < vocab), top_k, vocab)
        kth = tf.gather(tf.math.top_k(scaled, vocab).values, k - 1, batch_dims=1)[:, None]
        scaled = tf.where(scaled >= kth, scaled, float("-inf"))
        keys = tf.stack([tf.cast(seed, tf.int64),
                         tf.bitwise.left_shift(tf.cast(row, tf.int64), 32) + tf.cast(step, tf.int64)], axis=1)
        drawn = tf.map_fn(lambda args: tf.random.stateless_categorical(args[0][None], 1, args[1],
                                                                       dtype=tf.int32)[0, 0],
                          (scaled, keys), fn_output_signature=tf.int32)
        token = tf.where(sampling, drawn, greedy_token)
        log_probs = tf.where(sampling[:, None], tf.nn.log_softmax(scaled), tf.nn.log_softmax(logits))
        return token, tf.gather(log_probs, token, batch_dims=1)

    return tf.cond(tf.reduce_any(temperature > 0), sample, greedy)


def save(generator: Generator, path: str | Path) -> None:
    """The SavedModel with the signatures of Generator.signatures, and nothing else: the functions are not also
    attributes of its root, which would store a second copy of each (the graphs are most of a served version's
    memory beyond its weights: docs/large-models.md#server-memory).

    Its root tracks the tf.Variables the functions capture, not the Keras model, as keras.export.ExportArchive
    does: a root that tracks a Keras 3 model loads with tf.saved_model.load but not in a TF1 Session, which is how
    tensorflow_model_server loads a SavedModel ('Could not find variable ...': the checkpoint restores other
    handles than the functions read)."""
    signatures = generator.signatures()
    root = tf.Module()
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
