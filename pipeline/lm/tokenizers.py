"""The language model's tokenizers (issue 29): how text becomes token ids and ids become text, in one place for the
data's windows, the training samples, generate and the export.

Two kinds behind one small interface (data.tokenizer):
    bytes          each UTF-8 byte is an id (0..255), then PAD, BOS, EOS; no vocabulary file. Core TensorFlow ops
                   only, so stock tensorflow_model_server runs its export. Every byte string round-trips.
    sentencepiece  a SentencePiece BPE model of data.vocab_size ids, trained at `make train` from the training
                   split's text only (never the validation text), deterministically, and stored in the run's data
                   directory: pad 0, bos 1, eos 2, unk 3, the 256 bytes (byte fallback: any UTF-8 string encodes
                   without unknown ids), then the learnt pieces. Its graph encodes with TF Text's sentencepiece
                   ops, the model proto an attribute of one of them, so the proto travels inside the SavedModel;
                   it decodes by joining each id's bytes (core ops).

What each offers (docs/training.md#tokenizers):
    vocab_size, pad, bos, eos, never_generated    ids
    encode_padded(texts)      tf.string [batch] → (ids int32 [batch, longest] right-padded with pad, lengths)
    encode_document(text)     tf.string scalar → int32 [n]: a document's ids (the tf.data windows)
    token_ends(text)          bytes → the end byte offset of each token (the baselines score the same bytes)
    decode(ids)               int32 [batch, time] → tf.string [batch], special ids dropped
    pieces(ids)               int32 [n] → tf.string [n]: each id's own bytes, which joined are decode's (streaming)
    is_text(ids)              bool: the ids that are text (generate's lengths)
    token_bytes               int32 [vocab]: the UTF-8 bytes of each id's text, 0 for special ids (nats per byte)
    facts()                   pipeline.json's language_model.tokenizer
    graph_ops, op_libraries   op types its graph adds to generate.SERVING_OPS, and the modules that register them

Sentencepiece normalises nothing (identity rule, no dummy prefix, spaces kept), so decode(encode(text)) is the text,
with two exceptions inherent to SentencePiece's encoder: U+2581 '▁' (its escaped space) comes back as a space, and
bytes that are not UTF-8 as U+FFFD.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline.errors import DataError
from pipeline.lm import bpe

log = logging.getLogger(__name__)

# ---- the bytes tokenizer's ids ----
NUM_BYTES = 256  # ids 0..255 are the byte values
PAD = 256  # padding: never attended by a real token (right padding, causal attention), never generated
BOS = 257  # starts every prompt and document
EOS = 258  # ends a generation
VOCAB_SIZE = 259
SPECIAL_IDS = (PAD, BOS, EOS)
# The prompt the training samples, the export's recorded sample and the demo complete: ordinary English, it begins
# sentences in the embedded corpus and in most prose. A tokenizer may word it its own way (sample_prompt).
SAMPLE_PROMPT = "The "

# id → its byte; the special ids decode to nothing (a string constant in each graph that decodes).
_BYTE_STRINGS = [bytes([b]) for b in range(NUM_BYTES)] + [b""] * len(SPECIAL_IDS)

# ---- sentencepiece ----
SP_PAD, SP_BOS, SP_EOS, SP_UNK = 0, 1, 2, 3
SP_FIRST_BYTE = 4  # <0x00> .. <0xFF>: ids 4..259, then the learnt pieces
SENTENCEPIECE_FILE = "tokenizer.model"  # in the run's data directory, beside tokenizer.json (what it was trained on)
SENTENCEPIECE_RECORD = "tokenizer.json"
MAX_SENTENCE_BYTES = 4096  # the trainer's sentences: lines, longer ones cut (its default limit is 4192 bytes)
TRAINER = {  # fixed: the same text and size give the same model (recorded in tokenizer.json)
    "model_type": "bpe", "byte_fallback": True, "normalization_rule_name": "identity", "add_dummy_prefix": False,
    "remove_extra_whitespaces": False, "allow_whitespace_only_pieces": True, "character_coverage": 0.9995,
    "pad_id": SP_PAD, "bos_id": SP_BOS, "eos_id": SP_EOS, "unk_id": SP_UNK, "num_threads": 1,
    "max_sentence_length": MAX_SENTENCE_BYTES + 16, "input_sentence_size": 2_000_000,
    "shuffle_input_sentence": True,
}
TRAINER_SEED = 0  # the sentences sampled when there are more than input_sentence_size
TF_TEXT = "tensorflow_text"
# The op types a sentencepiece tokenizer's graph adds to generate.SERVING_OPS: TF Text's two that encode (which
# stock tensorflow_model_server links in, docs/export.md#a-sentencepiece-tokenizer) and the core op that pads the
# ids. Decoding joins each id's bytes with core ops, as the bytes tokenizer does.
SENTENCEPIECE_OPS = frozenset({"SentencepieceOp", "SentencepieceTokenizeOp", "RaggedTensorToTensor"})
# The op types a GPT-2 tokenizer's graph adds: bpe.py's encoder and decoder, and is_text's NotEqual; all core ops.
GPT2_OPS = bpe.GRAPH_OPS | {"NotEqual"}


class BytesTokenizer:
    """UTF-8 bytes as ids (module docstring); core TensorFlow ops only, so it runs eagerly, in tf.data and in a
    SavedModel that stock tensorflow_model_server loads."""

    kind = "bytes"
    sample_prompt = SAMPLE_PROMPT
    vocab_size, pad, bos, eos = VOCAB_SIZE, PAD, BOS, EOS
    never_generated = (PAD, BOS)  # not text; EOS ends a row
    graph_ops: frozenset[str] = frozenset()  # all of its ops are among generate.SERVING_OPS
    op_libraries: tuple[str, ...] = ()
    token_bytes = np.array([1] * NUM_BYTES + [0] * len(SPECIAL_IDS), np.int32)

    def encode_padded(self, texts) -> tuple[tf.Tensor, tf.Tensor]:
        """DecodePaddedRaw reads strings of different lengths in one op (decode_raw without fixed_length needs equal
        lengths); the bytes are taken as they are, so invalid UTF-8 encodes too."""
        texts = tf.convert_to_tensor(texts, tf.string)
        lengths = tf.strings.length(texts, unit="BYTE")
        longest = tf.reduce_max(tf.concat([tf.reshape(lengths, [-1]), [0]], 0))
        raw = tf.io.decode_raw(texts, tf.uint8, fixed_length=tf.maximum(longest, 1))[..., :longest]
        ids = tf.cast(raw, tf.int32)
        return tf.where(tf.sequence_mask(lengths, longest), ids, PAD), lengths

    def encode_document(self, text) -> tf.Tensor:
        return tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32)

    def token_ends(self, text: bytes) -> np.ndarray:
        return np.arange(1, len(text) + 1)

    def decode(self, ids) -> tf.Tensor:
        """int32 ids [..., time] (dense or ragged) → tf.string [...]: the bytes, special ids and ids outside the
        vocabulary dropped. The result is bytes, not text: a generation may stop inside a UTF-8 character."""
        if isinstance(ids, tf.RaggedTensor):
            ids = ids.to_tensor(PAD)
        ids = tf.convert_to_tensor(ids, tf.int32)
        known = tf.logical_and(ids >= 0, ids < VOCAB_SIZE)
        pieces = tf.gather(tf.constant(_BYTE_STRINGS), tf.where(known, ids, PAD))
        return tf.strings.reduce_join(pieces, axis=-1)

    def pieces(self, ids) -> tf.Tensor:
        return self.decode(tf.reshape(ids, [-1, 1]))

    def is_text(self, ids) -> tf.Tensor:
        return ids < NUM_BYTES

    def facts(self) -> dict:
        """prompt_tokens: a prompt of n bytes takes exactly per_byte * n + added tokens (BOS), what the `tokenize`
        signature would count; a server checks prompt + max_new_tokens against the context without calling it."""
        return {"kind": self.kind, "vocab_size": VOCAB_SIZE, "byte_ids": f"0..{NUM_BYTES - 1}",
                "special_ids": {"pad": PAD, "bos": BOS, "eos": EOS}, "prompt_tokens": {"per_byte": 1, "added": 1}}


BYTES = BytesTokenizer()


class SentencePieceTokenizer:
    """A trained SentencePiece model (module docstring): encoded by TF Text's sentencepiece ops, decoded by joining
    each id's bytes from a constant table (core ops).

    Each graph that encodes creates its own SentencepieceOp (the model proto its attribute) rather than
    capturing one made eagerly: TF Text's model resource belongs to the op's kernel, and clearing the eager kernel
    cache (tf.random.set_seed does, hence keras.utils.set_random_seed) deletes it under every function that
    captured it. Inside a graph the op lives as long as the graph's function."""

    kind = "sentencepiece"
    sample_prompt = SAMPLE_PROMPT
    pad, bos, eos = SP_PAD, SP_BOS, SP_EOS
    never_generated = (SP_PAD, SP_BOS, SP_UNK)
    graph_ops = SENTENCEPIECE_OPS
    op_libraries = (TF_TEXT,)

    def __init__(self, proto: bytes, record: dict | None = None):
        import sentencepiece
        from tensorflow_text.python.ops import sentencepiece_tokenizer  # registers the ops (the text extra)

        self._ops = sentencepiece_tokenizer.gen_sentencepiece_tokenizer
        self.proto = proto
        self.record = record or {}  # what it was trained on (tokenizer.json)
        processor = sentencepiece.SentencePieceProcessor(model_proto=proto)
        self.vocab_size = processor.get_piece_size()
        self.piece_strings = [_piece_string(processor, i) for i in range(self.vocab_size)]
        self.token_bytes = np.array([len(piece) for piece in self.piece_strings], np.int32)
        self.sha256 = hashlib.sha256(proto).hexdigest()

    def _model(self):
        return self._ops.sentencepiece_op(model=self.proto)

    def _tokenize(self, texts, offsets: bool = False):
        """tf.string [batch] → (ids, row_splits[, starts, ends]), flat."""
        texts = tf.convert_to_tensor(texts, tf.string)
        op = self._ops.sentencepiece_tokenize_with_offsets_op if offsets else self._ops.sentencepiece_tokenize_op
        return op(self._model(), texts, nbest_size=0, alpha=1.0, add_bos=False, add_eos=False, reverse=False,
                  out_type=tf.int32)

    def encode_padded(self, texts) -> tuple[tf.Tensor, tf.Tensor]:
        ids, splits = self._tokenize(texts)[:2]
        ragged = tf.RaggedTensor.from_row_splits(ids, splits, validate=False)
        return ragged.to_tensor(SP_PAD), tf.cast(splits[1:] - splits[:-1], tf.int32)

    def encode_document(self, text) -> tf.Tensor:
        return self._tokenize(tf.reshape(text, [1]))[0]

    def token_ends(self, text: bytes) -> np.ndarray:
        """TF Text's end offsets, except that it gives each byte piece of a character the character's start: a byte
        piece ends one byte after the token before it (the text is UTF-8, so each stands for one of its bytes)."""
        ids, _, _, ends = self._tokenize([text], offsets=True)
        ids, ends = ids.numpy(), ends.numpy().astype(np.int64)
        is_byte = (ids >= SP_FIRST_BYTE) & (ids < SP_FIRST_BYTE + NUM_BYTES)
        index = np.arange(len(ids))
        last_piece = np.maximum.accumulate(np.where(is_byte, -1, index)) if len(ids) else index
        base = np.where(last_piece >= 0, ends[np.maximum(last_piece, 0)], 0)
        return np.where(is_byte, base + index - last_piece, ends)

    def decode(self, ids) -> tf.Tensor:
        """int32 ids [..., time] → tf.string [...]: the ids' pieces joined (core ops: what SentencePiece's decoder
        gives for this model, which normalises nothing, except that the result is bytes, as the bytes tokenizer's:
        a generation cut inside a character ends in part of it, and streamed pieces join to the same bytes)."""
        return tf.strings.reduce_join(self.pieces(ids), axis=-1)

    def pieces(self, ids) -> tf.Tensor:
        """Each id's own bytes (a byte piece its one byte, so a character spread over byte pieces streams whole once
        joined; decode would turn a lone one into U+FFFD); special ids and ids outside the vocabulary: nothing."""
        ids = tf.convert_to_tensor(ids, tf.int32)
        known = tf.logical_and(ids >= 0, ids < self.vocab_size)
        return tf.gather(tf.constant(self.piece_strings), tf.where(known, ids, SP_PAD))

    def is_text(self, ids) -> tf.Tensor:
        return ids >= SP_FIRST_BYTE

    def facts(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size,
                "byte_ids": f"{SP_FIRST_BYTE}..{SP_FIRST_BYTE + NUM_BYTES - 1}",
                "special_ids": {"pad": SP_PAD, "bos": SP_BOS, "eos": SP_EOS, "unk": SP_UNK},
                "model": "SentencePiece BPE with byte fallback, inside the SavedModel (TF Text's SentencepieceOp)",
                "sha256": self.sha256, "trained_on": self.record.get("trained_on")}


def _piece_string(processor, i: int) -> bytes:
    """The bytes id i stands for: a byte piece's byte, a piece's text (its escaped spaces as spaces), nothing for a
    control or unknown id."""
    if processor.is_byte(i):
        return bytes([int(processor.id_to_piece(i)[1:-1], 16)])  # '<0xAB>'
    if processor.is_control(i) or processor.is_unknown(i):
        return b""
    return processor.id_to_piece(i).replace("\u2581", " ").encode("utf-8")


class Gpt2Tokenizer:
    """GPT-2's byte-level BPE from a checkpoint's vocab.json and merges.txt (pipeline/lm/bpe.py: core TensorFlow
    ops, so stock tensorflow_model_server runs its export). <|endoftext|> is BOS and EOS, as in GPT-2's training;
    pad is the id after the vocabulary: never a token, never generated, the embedding's stray row
    (causal_lm.ReversibleEmbedding), so padding a prompt cannot be mistaken for the end of a text."""

    kind = "gpt2"
    # without the trailing space: GPT-2's pieces carry their leading space (" cat"), so "The " ends in a lone space
    # token, which its training text rarely has before a word, and a greedy completion of it is more spaces
    sample_prompt = SAMPLE_PROMPT.rstrip()
    never_generated: tuple[int, ...] = ()  # every id of the vocabulary is text or EOS
    op_libraries: tuple[str, ...] = ()
    graph_ops = GPT2_OPS

    def __init__(self, vocab_json: bytes, merges_txt: bytes, source: str = "the vocabulary"):
        self.files = {bpe.VOCAB_FILE: vocab_json, bpe.MERGES_FILE: merges_txt}
        self.bpe = bpe.parse(vocab_json, merges_txt, source)
        if self.bpe.end_of_text is None:
            raise DataError(f"{source}: no {bpe.END_OF_TEXT!r} token; GPT-2's BOS and EOS are that one")
        self.vocab_size = self.bpe.vocab_size
        self.bos = self.eos = self.bpe.end_of_text
        self.pad = self.vocab_size
        self.token_bytes = np.array([len(piece) for piece in self.bpe.token_strings], np.int32)
        self.sha256 = hashlib.sha256(vocab_json + b"\0" + merges_txt).hexdigest()

    def encode_padded(self, texts) -> tuple[tf.Tensor, tf.Tensor]:
        ids = self.bpe.encode(texts)
        return ids.to_tensor(self.pad), tf.cast(ids.row_lengths(), tf.int32)

    def encode_document(self, text) -> tf.Tensor:
        return self.bpe.encode(tf.reshape(text, [1])).flat_values

    def token_ends(self, text: bytes) -> np.ndarray:
        """Each token's bytes are its own (decode is encode's exact inverse), so the ends are their running sum."""
        return np.cumsum(self.token_bytes[self.encode_document(tf.constant(text)).numpy()])

    def decode(self, ids) -> tf.Tensor:
        if isinstance(ids, tf.RaggedTensor):
            ids = ids.to_tensor(self.pad)
        return self.bpe.decode(ids)

    def pieces(self, ids) -> tf.Tensor:
        return self.bpe.pieces(ids)

    def is_text(self, ids) -> tf.Tensor:
        return tf.logical_and(tf.logical_and(ids >= 0, ids < self.vocab_size), tf.not_equal(ids, self.eos))

    def facts(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size,
                "special_ids": {"pad": self.pad, "bos": self.bos, "eos": self.eos},
                "model": "GPT-2's byte-level BPE (vocab.json + merges.txt) in core TensorFlow ops",
                "sha256": self.sha256}


def read_gpt2(directory: Path) -> Gpt2Tokenizer | None:
    """The GPT-2 tokenizer of a directory (a checkpoint's, or a run's data directory, where record() copies it), or
    None when it has neither file."""
    files = [Path(directory) / name for name in (bpe.VOCAB_FILE, bpe.MERGES_FILE)]
    if not any(path.exists() for path in files):
        return None
    vocab_json, merges_txt = (bpe.read_file(path) for path in files)
    return Gpt2Tokenizer(vocab_json, merges_txt, str(directory))


def prepare_gpt2(recorded: Path | None, pretrained: Path | None) -> Gpt2Tokenizer:
    """The run's GPT-2 tokenizer: the one its data directory recorded (a resumed run, export), else the one beside
    the checkpoint it starts from (model.init_from)."""
    for directory in (recorded, pretrained):
        found = read_gpt2(directory) if directory is not None else None
        if found is not None:
            return found
    raise DataError(f"data.tokenizer: gpt2 reads vocab.json and merges.txt from model.init_from "
                    f"({pretrained or 'not set'}), and found neither there")


# ---- training and the run directory ----

def train_sentencepiece(texts: Iterable[bytes], vocab_size: int) -> bytes:
    """A SentencePiece model proto trained on texts (the training split's parts), the same for the same texts and
    size. A size the text cannot fill is a DataError naming data.vocab_size and the size that fits."""
    import sentencepiece

    sentencepiece.set_random_generator_seed(TRAINER_SEED)
    written = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=_sentences(texts), model_writer=written,
                                                 vocab_size=vocab_size, minloglevel=2, **TRAINER)
    except RuntimeError as error:
        raise DataError(_trainer_error(str(error), vocab_size)) from None
    return written.getvalue()


def _sentences(texts: Iterable[bytes]) -> Iterator[str]:
    """The trainer's sentences: the texts' lines, a line longer than MAX_SENTENCE_BYTES cut into pieces."""
    for text in texts:
        for line in text.decode("utf-8", errors="replace").split("\n"):
            while len(line.encode("utf-8")) > MAX_SENTENCE_BYTES:
                cut = len(line.encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore"))
                yield line[:cut]
                line = line[cut:]
            if line:
                yield line


def _trainer_error(message: str, vocab_size: int) -> str:
    """SentencePiece's refusal of a vocabulary size, as one line about data.vocab_size."""
    text = message.strip().splitlines()[-1] if message.strip() else message
    if "too high" in text and "<=" in text:
        most = text.rsplit("<=", 1)[1].strip(" .")
        return (f"data.vocab_size: {vocab_size} is more than sentencepiece can learn from the training text (at most "
                f"{most} here); lower it, or train on more text")
    if "required_chars" in text and " vs " in text:
        least = text.split(" vs ", 1)[1].split(".")[0].strip()
        return (f"data.vocab_size: {vocab_size} is too small for the training text's characters (sentencepiece needs at "
                f"least {least}); raise it")
    return f"data.tokenizer: sentencepiece could not train on the training text: {text}"


def fingerprint(texts: Iterable[bytes], vocab_size: int) -> str:
    """What a trained model depends on: the training text, the size and the trainer's settings."""
    digest = hashlib.sha256(json.dumps({"vocab_size": vocab_size, "trainer": TRAINER, "seed": TRAINER_SEED,
                                        "max_sentence_bytes": MAX_SENTENCE_BYTES}, sort_keys=True).encode())
    for text in texts:
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text)
    return digest.hexdigest()


def prepare_sentencepiece(read_texts: Callable[[], Iterable[bytes]], vocab_size: int,
                          recorded: Path | None) -> SentencePieceTokenizer:
    """The run's tokenizer: the one recorded in its data directory when it was trained on the same text and size
    (a resumed run, export), else a new one trained now (record() stores it with the run). read_texts gives the
    training parts' bytes anew each time it is called, a part at a time (never the corpus at once)."""
    found = fingerprint(read_texts(), vocab_size)
    stored = read_sentencepiece(recorded) if recorded is not None else None
    if stored is not None and stored.record.get("fingerprint") == found:
        return stored
    if stored is not None:
        log.info("data.tokenizer: the training text or data.vocab_size changed since %s was trained; training it "
                 "again", recorded / SENTENCEPIECE_FILE)
    sizes = [len(text) for text in read_texts()]
    proto = train_sentencepiece(read_texts(), vocab_size)
    trained_on = {"bytes": sum(sizes), "parts": len(sizes)}
    tokenizer = SentencePieceTokenizer(proto, {"fingerprint": found, "vocab_size": vocab_size,
                                               "trained_on": trained_on, "trainer": TRAINER})
    log.info("data.tokenizer: sentencepiece trained on the training split's %s bytes: %d ids", f"{trained_on['bytes']:,}",
             tokenizer.vocab_size)
    return tokenizer


def read_sentencepiece(directory: Path) -> SentencePieceTokenizer | None:
    """The tokenizer recorded in a run's data directory, or None when there is none."""
    model, record = Path(directory) / SENTENCEPIECE_FILE, Path(directory) / SENTENCEPIECE_RECORD
    if not (model.is_file() and record.is_file()):
        return None
    return SentencePieceTokenizer(model.read_bytes(), json.loads(record.read_text()))


def read_recorded(kind: str, directory: Path):
    """(the tokenizer of kind 'sentencepiece' or 'gpt2' that record() stored in a run's data directory, or None,
    the file that holds it): what the export and the audit encode with."""
    if kind == "gpt2":
        return read_gpt2(directory), Path(directory) / bpe.VOCAB_FILE
    return read_sentencepiece(directory), Path(directory) / SENTENCEPIECE_FILE


def record(tokenizer, directory: Path) -> None:
    """Stores a sentencepiece or GPT-2 tokenizer in the run's data directory (the bytes one needs nothing), so the
    run's export and audit encode as its training did."""
    from pipeline import artifacts

    if isinstance(tokenizer, Gpt2Tokenizer):
        for name, content in tokenizer.files.items():
            with artifacts.atomic_file(Path(directory) / name) as tmp:
                tmp.write_bytes(content)
    if not isinstance(tokenizer, SentencePieceTokenizer):
        return
    with artifacts.atomic_file(Path(directory) / SENTENCEPIECE_FILE) as tmp:
        tmp.write_bytes(tokenizer.proto)
    artifacts.write_json_atomic(Path(directory) / SENTENCEPIECE_RECORD, tokenizer.record)
