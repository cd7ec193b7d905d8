"""Text for the causal language model (issue 29): documents of UTF-8 bytes, a deterministic training/validation
split, windows of context_length token ids for next-token prediction, and the unigram and bigram baselines that a
trained model's validation loss is measured against.

    embedded_corpus()   the default text every Python install has: CPython's pydoc_data.topics, one document a topic
    text_files(...)     the user's own UTF-8 files (a glob or a list of globs), each checked before anything trains
    split_documents     → TextData: the training and validation TextWindows (bytes tokens), the rule, summary()
    tokenize            → the same TextData with windows of another tokenizer's ids (pipeline/lm/tokenizers.py)
    text_baselines      → Baselines: unigram and bigram cross-entropy on the validation windows' target bytes
    load_text           the files (or the embedded corpus) split, in one call; then tokenize for sentencepiece

A document's ids are BOS, then its tokens (bytes: one id a byte). BOS starts a document as generate.prompt_ids starts
a prompt, so what follows BOS in training is what a prompt's first token sees in serving. There is no EOS. The
baselines score exactly the bytes of the validation windows' target tokens, so a model's nats per byte (its total
nats over those tokens' bytes) and theirs are on one scale whatever the tokenizer.

Nothing holds the whole corpus: the checks and the baselines read a file in chunks, the windows are cut in the
tf.data graph from one file at a time (tf.io.read_file; a file of a few MB is fine, the corpus is never joined).
A sentencepiece tokenizer is counted and fitted a part at a time too; only SentencePiece's trainer keeps its
sentences (up to 2 million lines, pipeline/lm/tokenizers.py).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import itertools
import posixpath
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf

from pipeline.errors import DataError
from pipeline.lm.tokenizers import BYTES, NUM_BYTES

EMBEDDED = "pydoc_data.topics"
READ_CHUNK = 1 << 20  # bytes read at a time by the UTF-8 check and the baselines
START = NUM_BYTES  # the bigram's state before a document's first byte (the model sees BOS there)
MAX_SHUFFLE_BUFFER = 16384  # training windows shuffled at once when no buffer is given (2 × context ids each)
BY_DOCUMENT, WITHIN_DOCUMENT = "by document", "within the document"


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: a file (read when its windows are) or bytes held in memory (the embedded corpus)."""

    name: str  # the file as the glob found it, or the topic's key
    size: int  # bytes
    path: str | None = None
    text: bytes | None = None

    @classmethod
    def from_bytes(cls, name: str, text: bytes) -> Document:
        return cls(name=name, size=len(text), text=text)

    def read(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) in chunks of at most READ_CHUNK."""
        if self.text is not None:
            for at in range(start, end, READ_CHUNK):
                yield self.text[at:min(end, at + READ_CHUNK)]
            return
        with tf.io.gfile.GFile(self.path, "rb") as file:
            file.seek(start)
            while start < end:
                chunk = file.read(min(READ_CHUNK, end - start))
                if not chunk:
                    return
                start += len(chunk)
                yield chunk


@dataclasses.dataclass(frozen=True)
class Part:
    """The bytes [start, end) of one document that one side of the split reads. A part that starts its document
    starts with BOS, so each of its bytes is a target; a part that starts inside one (a single file's validation
    tail) has its first byte as context only."""

    document: Document
    start: int
    end: int

    @property
    def bos(self) -> bool:
        return self.start == 0

    def read(self) -> bytes:
        """The part's bytes (one part at a time: a file's share, never the corpus)."""
        return b"".join(self.document.read(self.start, self.end))


class TextWindows:
    """One side of the split as windows: (inputs, targets), each int32 [context_length], targets the inputs
    shifted by one id (the next token). lengths: each part's tokens (default: its bytes, the bytes tokenizer's);
    a part that starts its document gets BOS before them.

    Validation (training=False): from each part's start, every context_length ids, non-overlapping; a tail shorter
    than a window is left out. The same windows every time, whatever the seed.

    Training: each part's windows start at a random offset drawn from (seed, part), so the cuts move from epoch to
    epoch. A part of T targets gives T // context_length windows, one fewer where that would leave under half a
    window to move in (at least one), so its count is the same for every seed: len() is an epoch's windows. Some
    bytes at a part's ends go unused in an epoch, fewer than 1.5 windows' worth, and different ones every epoch. The
    parts' order and a buffer of windows are shuffled from the seed. Without a seed: offset 0, the parts' order.
    All parts are files, or all are documents in memory (one source)."""

    def __init__(self, parts: Sequence[Part], context_length: int, training: bool, tokenizer=BYTES,
                 lengths: Sequence[int] | None = None) -> None:
        self.parts, self.context_length, self.training = tuple(parts), context_length, training
        self.tokenizer = tokenizer
        self.lengths = tuple(lengths) if lengths is not None else tuple(part.end - part.start for part in self.parts)
        self.counts = [self._windows_in(self.targets(i)) for i in range(len(self.parts))]

    def targets(self, index: int) -> int:
        """Part index's ids after the first: what windows can predict."""
        return self.lengths[index] - (0 if self.parts[index].bos else 1)

    def _windows_in(self, targets: int) -> int:
        full = targets // self.context_length
        if not self.training or full <= 1:
            return full
        return max(1, (targets - self.context_length // 2) // self.context_length)

    def __len__(self) -> int:
        return sum(self.counts)

    @property
    def bytes(self) -> int:
        return sum(part.end - part.start for part in self.parts)

    @property
    def names(self) -> list[str]:
        return [part.document.name for part in self.parts]

    def windows(self, seed: int | None = None, shuffle_buffer: int | None = None) -> tf.data.Dataset:
        """The windows of one epoch, one at a time. seed: a training epoch's (the loops pass seed × 1,000,003 +
        epoch); ignored by validation windows."""
        seed = seed if self.training else None
        order = tf.data.Dataset.range(len(self.parts))
        if seed is not None:
            order = order.shuffle(len(self.parts), seed=seed)
        windows = order.interleave(lambda i: self._windows_of(i, seed), cycle_length=min(4, len(self.parts)),
                                   num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if seed is not None:
            buffer = shuffle_buffer or min(len(self), MAX_SHUFFLE_BUFFER)
            windows = windows.shuffle(max(1, buffer), seed=seed, reshuffle_each_iteration=False)
        return windows

    def dataset(self, batch_size: int, shuffle_buffer: int | None = None, seed: int | None = None, *, skip: int = 0,
                drop_remainder: bool = False, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """Batches of windows, prefetched; skip: windows to leave out at the start (a resumed epoch); input_context:
        one input pipeline's share of a distributed run (every n-th window), skip counting that share's windows."""
        windows = self.windows(seed, shuffle_buffer)
        if input_context is not None and input_context.num_input_pipelines > 1:
            windows = windows.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if skip:
            windows = windows.skip(skip)
        return windows.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)

    def rows(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first `limit` windows (None: all) in their unshuffled order: (inputs, targets), int32 [n, context]."""
        windows = self.windows()
        if limit is not None:
            windows = windows.take(limit)
        batches = list(windows.batch(4096).as_numpy_iterator())
        if not batches:
            empty = np.zeros((0, self.context_length), np.int32)
            return empty, empty
        return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])

    def _windows_of(self, index, seed) -> tf.data.Dataset:
        """Part `index`'s windows, in their order."""
        length = self.context_length
        starts = tf.constant([part.start for part in self.parts], tf.int64)[index]
        sizes = tf.constant([part.end - part.start for part in self.parts], tf.int64)[index]
        bos = tf.constant([part.bos for part in self.parts])[index]
        count = tf.constant(self.counts, tf.int64)[index]
        if self.parts[0].document.text is not None:
            contents = tf.constant([part.document.text for part in self.parts])[index]
        else:
            contents = tf.io.read_file(tf.constant([part.document.path for part in self.parts])[index])
        ids = self.tokenizer.encode_document(tf.strings.substr(contents, starts, sizes))
        ids = tf.concat([tf.fill(tf.cast(bos, tf.int32)[None], self.tokenizer.bos), ids], 0)
        offset = tf.constant(0, tf.int64)
        if seed is not None:
            spare = tf.size(ids, out_type=tf.int64) - 1 - count * length  # targets no window of this epoch needs
            offset = tf.random.stateless_uniform([], seed=tf.stack([tf.cast(seed, tf.int64), index]),
                                                 minval=0, maxval=spare + 1, dtype=tf.int64)
        first = offset + tf.range(count, dtype=tf.int64) * length
        window = tf.gather(ids, first[:, None] + tf.range(length + 1, dtype=tf.int64)[None, :])  # [count, length+1]
        return tf.data.Dataset.from_tensor_slices((window[:, :-1], window[:, 1:]))


@dataclasses.dataclass(frozen=True)
class TextData:
    """The split corpus: training and validation windows, and how it was split."""

    source: str  # EMBEDDED, or the globs
    train: TextWindows
    validation: TextWindows
    rule: str  # BY_DOCUMENT or WITHIN_DOCUMENT
    validation_split: float
    seed: int
    left_out: tuple[str, ...] = ()  # embedded documents shorter than one window
    # each validation part's scored bytes: those of its windows' target tokens, [first, end) in its document
    scored: tuple[tuple[int, int], ...] | None = None

    @property
    def context_length(self) -> int:
        return self.train.context_length

    def summary(self) -> dict:
        """What the run directory records: the documents, bytes and windows of each side (JSON-able)."""
        def side(windows: TextWindows) -> dict:
            return {"documents": len(windows.parts), "bytes": windows.bytes, "tokens": sum(windows.lengths),
                    "windows": len(windows), "names": windows.names}

        return {"source": self.source, "tokenizer": self.train.tokenizer.kind, "context_length": self.context_length,
                "split": self.rule,
                "validation_split": self.validation_split, "seed": self.seed, "left_out": list(self.left_out),
                "train": side(self.train), "validation": side(self.validation)}


@dataclasses.dataclass(frozen=True)
class Baselines:
    """Cross-entropy in nats per byte on the bytes of the validation windows' target tokens, of models fitted on
    the training bytes with add-one smoothing over the 256 byte values: the byte frequencies (unigram) and the next
    byte given the previous one, or given the start of a document (bigram)."""

    unigram: float
    bigram: float
    train_bytes: int  # bytes the counts were fitted on
    validation_bytes: int  # target bytes scored: those of every validation window

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def embedded_corpus() -> tuple[Document, ...]:
    """CPython's pydoc_data.topics (the language reference in English, PSF licence; no download): one document a
    topic, sorted by key, UTF-8 bytes."""
    from pydoc_data.topics import topics

    return tuple(Document.from_bytes(key, topics[key].encode("utf-8")) for key in sorted(topics))


def text_files(patterns: str | Sequence[str], context_length: int, *, key: str = "data.path") -> tuple[Document, ...]:
    """The files the globs match, sorted, each checked: not empty, at least one window (context_length + 1 bytes),
    UTF-8 all through (a streaming decoder, a chunk at a time). Each problem is a DataError of one line naming the
    glob or the file."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    paths: set[str] = set()
    for pattern in patterns:
        matched = [path for path in tf.io.gfile.glob(pattern) if not tf.io.gfile.isdir(path)]
        if not matched:
            raise DataError(f"{key}: {pattern} not found (no file matches); this pipeline never downloads data")
        paths.update(matched)
    documents = []
    for path in sorted(paths):
        size = tf.io.gfile.stat(path).length
        if size == 0:
            raise DataError(f"{key}: {path}: the file is empty")
        if size < context_length + 1:
            raise DataError(f"{key}: {path}: {size} bytes, shorter than one window of {context_length + 1} bytes "
                            f"(context_length {context_length} + 1); use longer files or a shorter context_length")
        document = Document(name=path, size=size, path=path)
        _check_utf8(document, key)
        documents.append(document)
    return tuple(documents)


def _check_utf8(document: Document, key: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes passed to the decoder so far
    for chunk in itertools.chain(document.read(0, document.size), [b""]):  # b"": the end, where a character may be cut
        pending = len(decoder.getstate()[0])  # bytes of an unfinished character, held from the last chunk
        try:
            decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as error:
            at = offset - pending + error.start
            raise DataError(f"{key}: {document.name}: not UTF-8 text: byte 0x{error.object[error.start]:02x} at "
                            f"offset {at} ({error.reason}); save the file as UTF-8") from None
        offset += len(chunk)


def split_documents(documents: Sequence[Document], context_length: int, validation_split: float, seed: int, *,
                    source: str = EMBEDDED, key: str = "data.path") -> TextData:
    """Training and validation windows, by a rule that gives the same answer on every machine.

    Two or more documents: split by document. Each is ranked by the SHA-256 of "seed:base name" (ties: the full
    name); validation takes them in that order while a document's taking brings its bytes nearer validation_split
    of all bytes (at least one document, at most n - 1). One document:
    split within it: its last validation_split × size bytes, rounded (at least one window, leaving a window) and
    moved to the start of a UTF-8 character, are validation, the rest training, so no window holds bytes of both.
    Documents shorter than one window (context_length + 1 bytes) are left out (text_files refuses such files before
    this)."""
    if not 0 < validation_split < 1:
        raise DataError(f"data.validation_split {validation_split}: text needs a share between 0 and 1 (exclusive), "
                        "so that both training and validation have text")
    if context_length < 1:
        raise DataError(f"context_length {context_length}: must be at least 1")
    window = context_length + 1
    kept = [document for document in documents if document.size >= window]
    left_out = tuple(document.name for document in documents if document.size < window)
    if not kept:
        raise DataError(f"{key}: no document holds one window of {window} bytes (context_length {context_length} + 1)")
    if len(kept) == 1:
        train, validation = _split_within(kept[0], context_length, validation_split, key)
        rule = WITHIN_DOCUMENT
    else:
        held_out = _held_out(kept, validation_split, seed)
        train = [Part(d, 0, d.size) for d in kept if d.name not in held_out]
        validation = [Part(d, 0, d.size) for d in kept if d.name in held_out]
        rule = BY_DOCUMENT
    return TextData(source=source, train=TextWindows(train, context_length, training=True),
                    validation=TextWindows(validation, context_length, training=False), rule=rule,
                    validation_split=validation_split, seed=seed, left_out=left_out)


def _held_out(documents: Sequence[Document], share: float, seed: int) -> set[str]:
    """The names of the validation documents: the first of the hash ranking until they hold share of the bytes
    (split_documents). Counting bytes, not documents: the embedded corpus's topics run from 202 bytes to tens of
    KB, and 8 of its 79 documents held anywhere from 2% to 15% of its bytes, depending on the seed."""

    def rank(document: Document) -> tuple[str, str]:
        base = posixpath.basename(document.name.replace("\\", "/"))
        return hashlib.sha256(f"{seed}:{base}".encode()).hexdigest(), document.name

    ranked = sorted(documents, key=rank)
    wanted, held, count = share * sum(document.size for document in documents), 0, 0
    while count < len(ranked) - 1 and (count == 0 or held + ranked[count].size / 2 <= wanted):
        held += ranked[count].size
        count += 1
    return {document.name for document in ranked[:count]}


def _split_within(document: Document, context_length: int, share: float, key: str) -> tuple[list[Part], list[Part]]:
    """A single document's training head and validation tail: each at least one window. The head starts with BOS
    (context_length bytes give a window); the tail's first byte is context only (it needs context_length + 1)."""
    need = 2 * context_length + 1
    if document.size < need:
        raise DataError(f"{key}: {document.name}: {document.size} bytes, too short to split into a training and a "
                        f"validation window: one file needs at least {need} bytes (context_length {context_length}); "
                        "use longer or more files, or a shorter context_length")
    tail = min(max(int(share * document.size + 0.5), context_length + 1), document.size - context_length)
    cut = _character_start(document, document.size - tail, context_length, document.size - context_length - 1)
    return [Part(document, 0, cut)], [Part(document, cut, document.size)]


def _character_start(document: Document, cut: int, lowest: int, highest: int) -> int:
    """cut moved back (or else forward) to the start of a UTF-8 character within [lowest, highest], so that neither
    side starts or ends inside one (a tokenizer would see broken text); cut itself when none is that near."""
    near = b"".join(document.read(max(lowest, cut - 3), min(highest, cut + 3) + 1))
    base = max(lowest, cut - 3)
    starts = [base + i for i, byte in enumerate(near) if byte & 0xC0 != 0x80]
    before = [at for at in starts if at <= cut]
    after = [at for at in starts if at > cut]
    return before[-1] if before else (after[0] if after else cut)


def tokenize(data: TextData, tokenizer) -> TextData:
    """The corpus's windows of tokenizer's ids (pipeline/lm/tokenizers.py): each part is tokenized once here to count
    its tokens, a validation part also to find the bytes its windows' targets cover (TextData.scored). The bytes
    tokenizer's counts and spans follow from the sizes, so data is returned as it is."""
    if tokenizer.kind == "bytes":
        return data
    lengths = [int(tf.size(tokenizer.encode_document(tf.constant(part.read())))) for part in data.train.parts]
    train = TextWindows(data.train.parts, data.context_length, True, tokenizer, lengths)
    ends = [tokenizer.token_ends(part.read()) for part in data.validation.parts]
    validation = TextWindows(data.validation.parts, data.context_length, False, tokenizer, [len(e) for e in ends])
    for side, windows in (("training", train), ("validation", validation)):
        if not len(windows):
            raise DataError(f"data.sequence_length: {data.context_length} {tokenizer.kind} tokens is more than any "
                            f"{side} document holds ({max(windows.lengths)} tokens at most); use a shorter "
                            "sequence_length or longer documents")
    scored = tuple(_scored_span(part, part_ends, count * data.context_length)
                   for part, part_ends, count in zip(validation.parts, ends, validation.counts))
    return dataclasses.replace(data, train=train, validation=validation, scored=scored)


def _scored_span(part: Part, ends, targets: int) -> tuple[int, int]:
    """The bytes [first, end) of a part's first `targets` target tokens, given each token's end offset in the
    part: after BOS every token is a target; without it the first token is context only."""
    if targets == 0:
        return part.start, part.start
    if part.bos:
        return part.start, part.start + int(ends[targets - 1])
    return part.start + int(ends[0]), part.start + int(ends[targets])


def scored_spans(data: TextData) -> tuple[tuple[int, int], ...]:
    """Each validation part's scored bytes (TextData.scored), the bytes tokenizer's from the windows' counts."""
    if data.scored is not None:
        return data.scored
    return tuple(_scored_span(part, range(1, part.end - part.start + 1), count * data.context_length)
                 for part, count in zip(data.validation.parts, data.validation.counts))


def text_baselines(data: TextData) -> Baselines:
    """The unigram and bigram baselines (Baselines), counted a chunk at a time (np.bincount of previous × 256 +
    next): fitted on every training byte, scored on exactly the bytes of the validation windows' target tokens
    (scored_spans), each byte given the one before it (or the start state after BOS)."""
    fitted = np.zeros((NUM_BYTES + 1, NUM_BYTES), np.int64)  # [previous byte or START, next byte]
    for part in data.train.parts:
        fitted += _pair_counts(part.document, part.start + (0 if part.bos else 1), part.end, part.bos)
    scored = np.zeros_like(fitted)
    for part, (first, end) in zip(data.validation.parts, scored_spans(data)):
        if end > first:
            scored += _pair_counts(part.document, first, end, part.bos and first == part.start)
    unigram_counts = fitted.sum(axis=0)
    log_unigram = np.log((unigram_counts + 1) / (unigram_counts.sum() + NUM_BYTES))
    log_bigram = np.log((fitted + 1) / (fitted.sum(axis=1, keepdims=True) + NUM_BYTES))
    scored_bytes = int(scored.sum())
    return Baselines(unigram=float(-(scored.sum(axis=0) * log_unigram).sum() / scored_bytes),
                     bigram=float(-(scored * log_bigram).sum() / scored_bytes),
                     train_bytes=int(fitted.sum()), validation_bytes=scored_bytes)


def _pair_counts(document: Document, first: int, end: int, bos: bool) -> np.ndarray:
    """Counts of (previous, next) for each next byte in [first, end) of a document: previous is START for the
    document's first byte after BOS, else the byte before."""
    counts = np.zeros((NUM_BYTES + 1) * NUM_BYTES, np.int64)
    previous = np.array([START] if bos else [], np.int64)
    for chunk in document.read(first if bos else first - 1, end):
        values = np.frombuffer(chunk, np.uint8).astype(np.int64)
        sequence = np.concatenate([previous, values])
        counts += np.bincount(sequence[:-1] * NUM_BYTES + sequence[1:], minlength=counts.size)
        previous = sequence[-1:]
    return counts.reshape(NUM_BYTES + 1, NUM_BYTES)


def load_text(patterns: str | Sequence[str] | None, context_length: int, validation_split: float, seed: int, *,
              key: str = "data.path") -> TextData:
    """The user's files (patterns: a glob or a list of globs), or the embedded corpus when None, split."""
    if patterns is None:
        return split_documents(embedded_corpus(), context_length, validation_split, seed, source=EMBEDDED, key=key)
    documents = text_files(patterns, context_length, key=key)
    source = patterns if isinstance(patterns, str) else ", ".join(patterns)
    return split_documents(documents, context_length, validation_split, seed, source=source, key=key)
