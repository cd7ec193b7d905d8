"""GPT-2's byte-level BPE (issue 43; docs/pretrained.md#the-tokenizer) as TensorFlow ops, so that an export encodes
and decodes strings inside its graph and stock tensorflow_model_server runs it: core ops only (RE2 regexes, sorts,
searchsorted, segment reductions), no table, nothing that grows with traffic.

What it computes is OpenAI's encoder (openai/gpt-2 src/encoder.py) with `regex`'s Unicode classes:
    1. pre-tokenize by 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+;
    2. map each piece's UTF-8 bytes to their single-byte tokens;
    3. within each piece, merge the adjacent pair of lowest rank in merges.txt, every occurrence left to right, until
       no pair has a rank.
RE2 has no lookahead, so step 1 runs in two passes: the first cuts every whitespace run that a non-space follows
before its last character (what `\\s+(?!\\S)` leaves to the next piece), the second matches the pattern without the
lookahead within each cut. `regex`'s `\\s` is Unicode's White_Space (RE2's is ASCII), hence WHITESPACE. Step 3
merges every piece at once, one rank per round; a piece leaves the rounds when it has no pair left.

A literal "<|endoftext|>" in a text is text here (its characters' tokens, as tiktoken's encode_ordinary), never the
special id: a prompt cannot end or start a document. OpenAI's encoder.py turns it into 50256.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline.errors import CheckpointError

VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"
# GPT-2's own vocabulary cut after its first 200 merges (457 ids, <|endoftext|> last; MIT, from openai/gpt-2's files),
# for a random-initialised checkpoint (gpt2.write_random: the demo, the tests); a real checkpoint brings its own.
PACKAGED = Path(__file__).parent / "gpt2_vocabulary"
END_OF_TEXT = "<|endoftext|>"  # GPT-2's one special token: BOS and EOS (id 50256 in GPT-2's vocabulary)
MAX_FILE_BYTES = 64 << 20  # GPT-2's vocab.json is 1 MB, merges.txt 456 KB

# Unicode's White_Space, which `regex`'s \s matches (RE2's \s is [\t\n\f\r ])
WHITESPACE = (r"\t\n\x0b\f\r \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}")
CUT = b"\xff"  # never in UTF-8, so it can mark where pieces end
LAST_OF_A_RUN = rf"([{WHITESPACE}]+)([{WHITESPACE}][^{WHITESPACE}])"  # pass 1: → \1 CUT \2
PIECE = (rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+| ?\p{{N}}+| ?[^{WHITESPACE}\p{{L}}\p{{N}}]+|[{WHITESPACE}]+")

# The op types encode and decode put in a graph (test_bpe.py traces them): core TensorFlow's, every one in stock
# tensorflow_model_server.
GRAPH_OPS = frozenset({
    "AddV2", "All", "Assert", "BroadcastTo", "Cast", "ConcatV2", "Const", "Cumsum", "DecodeRaw", "DenseBincount",
    "Equal", "ExpandDims", "FloorMod", "GatherV2", "Greater", "GreaterEqual", "Identity", "Less", "LogicalAnd",
    "LogicalNot", "LowerBound", "Max", "Maximum", "Minimum", "Mul", "Neg", "NoOp", "Pack", "Placeholder", "Prod",
    "RaggedRange", "RaggedTensorToTensor", "Range", "ReduceJoin", "Reshape", "SelectV2", "Shape", "Size", "Squeeze",
    "StatelessWhile", "StaticRegexReplace", "StridedSlice", "StringSplit", "StringSplitV2", "Sub", "Tile", "TopKV2",
    "UnicodeTranscode", "UnsortedSegmentMin", "UnsortedSegmentSum", "Where",
})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character its vocabulary writes it as (space → 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


class Gpt2Bpe:
    """A vocabulary (token string → id) and its merges in rank order, checked, as the constant arrays the graph
    reads: byte_ids [256] (each byte's token), pair_keys (left * vocab + right, sorted) with the rank and merged id
    of each, token_strings [vocab] (each id's bytes; the special token's are empty)."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], source: str = "the vocabulary"):
        self.vocab_size = len(vocab)
        chars = bytes_to_unicode()
        to_byte = {c: b for b, c in chars.items()}
        missing = [hex(b) for b, c in chars.items() if c not in vocab]
        if missing:
            raise CheckpointError(f"{source}: no token for byte {missing[0]} (a byte-level vocabulary has all 256)")
        if sorted(vocab.values()) != list(range(self.vocab_size)):
            raise CheckpointError(f"{source}: the ids are not 0..{self.vocab_size - 1}, each once")
        self.end_of_text = vocab.get(END_OF_TEXT)
        self.byte_ids = np.array([vocab[chars[b]] for b in range(256)], np.int64)
        keys, merged = [], []
        for rank, (left, right) in enumerate(merges):
            if left not in vocab or right not in vocab or left + right not in vocab:
                absent = next(t for t in (left, right, left + right) if t not in vocab)
                raise CheckpointError(f"{source}: merge {rank + 1} ({left} {right}) needs token {absent!r}, which "
                                      "the vocabulary lacks")
            keys.append(vocab[left] * self.vocab_size + vocab[right])
            merged.append(vocab[left + right])
        if len(set(keys)) != len(keys):
            raise CheckpointError(f"{source}: a pair is merged twice in merges.txt")
        keys, merged = keys or [-1], merged or [0]  # no merges: a key no pair equals
        order = np.argsort(np.array(keys, np.int64), kind="stable")
        self.pair_keys = np.array(keys, np.int64)[order]
        self.pair_ranks = order.astype(np.int64)
        self.pair_merged = np.array(merged, np.int64)[order]
        strings = [b""] * self.vocab_size
        for token, i in vocab.items():
            if token != END_OF_TEXT:
                if any(c not in to_byte for c in token):
                    raise CheckpointError(f"{source}: token {token!r} has a character that stands for no byte")
                strings[i] = bytes(to_byte[c] for c in token)
        self.token_strings = strings

    # ---- text → ids ----

    def encode(self, texts) -> tf.RaggedTensor:
        """tf.string [batch] → int32 ragged [batch, (tokens)]. A text that is not UTF-8 is an InvalidArgumentError
        saying so (a server's 400)."""
        texts = tf.convert_to_tensor(texts, tf.string)
        return self._merge(pre_tokenize(texts))

    def _merge(self, pieces: tf.RaggedTensor) -> tf.RaggedTensor:
        """Step 3 of the module docstring over every piece of every text at once: pieces tf.string [batch,
        (pieces)] → int32 [batch, (tokens)]."""
        flat = pieces.flat_values
        num_pieces = tf.shape(flat, out_type=tf.int64)[0]
        piece_bytes = tf.strings.bytes_split(flat)
        # one byte each: [n, 1], or [0, 0] when there is none (a reshape, not [:, 0], takes both)
        byte_values = tf.reshape(tf.io.decode_raw(piece_bytes.flat_values, tf.uint8), [-1])
        tokens = tf.gather(self.byte_ids, tf.cast(byte_values, tf.int32))
        word = piece_bytes.value_rowids()  # each token's piece, ascending
        keys, ranks, merged = (tf.constant(a) for a in (self.pair_keys, self.pair_ranks, self.pair_merged))
        no_rank = tf.constant(np.iinfo(np.int64).max)

        def merge_round(tokens, word, done_tokens, done_words):
            same = tf.equal(word[:-1], word[1:])
            pair = tokens[:-1] * self.vocab_size + tokens[1:]
            at = tf.minimum(tf.searchsorted(keys, pair), len(self.pair_keys) - 1)
            found = same & tf.equal(tf.gather(keys, at), pair)
            rank = tf.where(found, tf.gather(ranks, at), no_rank)
            lowest = tf.math.unsorted_segment_min(rank, word[:-1], num_pieces)  # int64's max where no pair
            finished = tf.gather(lowest >= no_rank, word)  # its piece has no pair with a rank left
            chosen = found & tf.equal(rank, tf.gather(lowest, word[:-1]))
            take = chosen & _every_other_in_runs(chosen)  # left to right, a pair never overlaps the one before
            merged_tokens = tf.where(tf.concat([take, [False]], 0), tf.gather(merged, tf.concat([at, [0]], 0)),
                                     tokens)
            keep = tf.concat([[True], ~take], 0) & ~finished
            return (tf.boolean_mask(merged_tokens, keep), tf.boolean_mask(word, keep),
                    tf.concat([done_tokens, tf.boolean_mask(tokens, finished)], 0),
                    tf.concat([done_words, tf.boolean_mask(word, finished)], 0))

        empty = tf.zeros([0], tf.int64)
        _, _, done_tokens, done_words = tf.while_loop(
            lambda tokens, *_: tf.size(tokens) > 0, merge_round, (tokens, word, empty, empty),
            shape_invariants=(tf.TensorShape([None]),) * 4)
        order = tf.argsort(done_words, stable=True)  # a piece's tokens leave in one round, in their order
        per_piece = tf.math.bincount(tf.cast(done_words, tf.int32), minlength=tf.cast(num_pieces, tf.int32),
                                     dtype=tf.int64)
        per_text = tf.math.unsorted_segment_sum(per_piece, pieces.value_rowids(), pieces.nrows())
        return tf.RaggedTensor.from_row_lengths(tf.cast(tf.gather(done_tokens, order), tf.int32), per_text,
                                                validate=False)

    # ---- ids → text ----

    def pieces(self, ids) -> tf.Tensor:
        """Each id's own bytes; the special token and ids outside the vocabulary: nothing."""
        ids = tf.convert_to_tensor(ids, tf.int32)
        known = tf.logical_and(ids >= 0, ids < self.vocab_size)
        return tf.gather(tf.constant(self.token_strings + [b""]), tf.where(known, ids, self.vocab_size))

    def decode(self, ids) -> tf.Tensor:
        """int32 ids [..., time] → tf.string [...]: the ids' bytes joined (bytes, not text: a generation may stop
        inside a character)."""
        return tf.strings.reduce_join(self.pieces(ids), axis=-1)


def read(directory: str | Path) -> Gpt2Bpe:
    """A checkpoint directory's vocab.json and merges.txt (as Hugging Face writes them), checked."""
    directory = Path(directory)
    return parse(read_file(directory / VOCAB_FILE), read_file(directory / MERGES_FILE), str(directory))


def parse(vocab_json: bytes, merges_txt: bytes, source: str = "the vocabulary") -> Gpt2Bpe:
    """The two files' contents as a Gpt2Bpe: a malformed one is one line naming it and, for merges.txt, the line."""
    try:
        vocab = json.loads(vocab_json.decode("utf-8"))
        merges_text = merges_txt.decode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{source}: {VOCAB_FILE} or {MERGES_FILE} cannot be read ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(k, str) and type(v) is int for k, v in vocab.items()):
        raise CheckpointError(f"{source}: {VOCAB_FILE} is not an object of token strings to integer ids")
    merges = []
    for number, line in enumerate(merges_text.split("\n"), 1):
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            raise CheckpointError(f"{source}: {MERGES_FILE} line {number} is {line[:60]!r}; each line is two tokens "
                                  "and one space")
        merges.append((pair[0], pair[1]))
    return Gpt2Bpe(vocab, merges, source)


def read_file(path: Path) -> bytes:
    """One of the two files, its size checked before it is read."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CheckpointError(f"{path}: {size:,} bytes; GPT-2's is about a megabyte, and this reader takes at "
                                  f"most {MAX_FILE_BYTES:,}")
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name} (data.tokenizer: gpt2 reads the checkpoint's "
                              f"{VOCAB_FILE} and {MERGES_FILE})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None


def pre_tokenize(texts: tf.Tensor) -> tf.RaggedTensor:
    """Step 1 of the module docstring: tf.string [batch] → tf.string [batch, (pieces)], after checking that every
    text is UTF-8 (RE2 would read invalid bytes its own way)."""
    valid = tf.equal(tf.strings.unicode_transcode(texts, "UTF-8", "UTF-8", errors="replace"), texts)
    with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(valid), ["a text is not valid UTF-8"])]):
        texts = tf.identity(texts)
    parts = tf.strings.split(tf.strings.regex_replace(texts, LAST_OF_A_RUN, b"\\1" + CUT + b"\\2"), CUT)
    marked = tf.strings.regex_replace(parts.flat_values, PIECE, CUT + b"\\0")
    pieces = tf.strings.split(marked, CUT)[:, 1:]  # each part's marked text starts with a CUT
    per_text = tf.math.unsorted_segment_sum(pieces.row_lengths(), parts.value_rowids(), parts.nrows())
    return tf.RaggedTensor.from_row_lengths(pieces.flat_values, per_text, validate=False)


def _every_other_in_runs(flags: tf.Tensor) -> tf.Tensor:
    """For runs of consecutive True flags, True at the run's 1st, 3rd, 5th... position (BPE merges "a a a" as
    "aa a", left to right)."""
    index = tf.range(tf.size(flags, out_type=tf.int64))
    starts = flags & ~tf.concat([[False], flags[:-1]], 0)
    run = tf.cumsum(tf.cast(starts, tf.int64))
    start_index = tf.concat([tf.boolean_mask(index, starts), [0]], 0)  # [0]: a gather that no flag reads
    offset = index - tf.gather(start_index, tf.maximum(run - 1, 0))
    return tf.equal(offset % 2, 0)
