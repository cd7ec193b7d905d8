"""Token-id sequences: checking and padding them to one length, and the generated pointer task.

A row of sequence data is a list of integer token ids 0..vocab_size-1 of any length; id 0 is padding,
wherever it stands. Every source (npz, csv, tfrecord, pointer) is padded here to data.sequence_length
(default: the longest sequence) with trailing zeros, and travels as float32 ids: the SavedModel's input
stays float32 like every other export (float32 holds every integer below 2**24 exactly), and the model
turns the ids into embeddings and a padding mask itself (pipeline/models/transformer.py).

The pointer task (data.source: pointer) is this project's shipped sequence task, generated from a seed:
the first token points at a position, the label is the digit found there. Example, sequence_length 8:
    [→3, 7, 1, 4, 4, 9]  (padded: [13, 8, 2, 5, 5, 10, 0, 0])  →  label 4, the digit at position 3
Which digit answers depends on where the pointer points, so a model must relate positions to one
another: attention does it in one step (query: the pointer; key: each token's position), while a bag of
tokens cannot tell it at all (pooled embeddings without attention reach 0.32 validation accuracy, chance
is 0.10; the 2-layer transformer of configs/pointer_transformer.yaml 1.00; docs/training.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pipeline.errors import DataError

PAD = 0
DIGITS = 10
FIRST_DIGIT = 1  # digit d is token d + 1
FIRST_POINTER = FIRST_DIGIT + DIGITS  # "→p" (p = 1 .. sequence_length - 1) is token FIRST_POINTER + p - 1
MIN_POINTER_LENGTH = 3  # a pointer and at least two digits


def pointer_vocab_size(sequence_length: int) -> int:
    """Padding, the ten digits and one pointer per position after the first."""
    return FIRST_POINTER + sequence_length - 1


def pointer_task(num_examples: int, sequence_length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """num_examples rows [→p, d_1 .. d_(n-1), 0 ...] of lengths n from 3 to sequence_length, label d_p; the
    same rows for the same (num_examples, sequence_length, seed) on every machine."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_POINTER_LENGTH, sequence_length + 1, num_examples)
    digits = rng.integers(0, DIGITS, (num_examples, sequence_length - 1))
    positions = (rng.random(num_examples) * (lengths - 1)).astype(np.int64) + 1  # 1 .. n-1
    x = np.zeros((num_examples, sequence_length), np.int64)
    x[:, 0] = FIRST_POINTER + positions - 1
    x[:, 1:] = np.where(np.arange(1, sequence_length) < lengths[:, None], digits + FIRST_DIGIT, PAD)
    y = digits[np.arange(num_examples), positions - 1]
    return x, y


def parse_ids(text: str) -> list[float]:
    """A csv cell of whitespace-separated token ids, e.g. '13 8 2 5'; an empty cell is an empty sequence."""
    return [float(part) for part in text.split()]


def without_trailing_padding(row: np.ndarray) -> np.ndarray:
    """A fixed-width row (npz, several csv columns) as the sequence it holds: its trailing zeros are padding."""
    nonzero = np.flatnonzero(row != PAD)
    return row[:nonzero[-1] + 1] if len(nonzero) else row[:0]


def pad(sequences: Sequence[np.ndarray], length: int, vocab_size: int, where: Callable[[int], str],
        name: str) -> np.ndarray:
    """The sequences as float32 ids [n, length], padded with trailing zeros; every id checked first.

    Raises:
        DataError: naming the row: an id that is not an integer in 0..vocab_size-1, or a sequence longer
            than length.
    """
    rows = np.zeros((len(sequences), length), np.float32)
    for i, ids in enumerate(sequences):
        ids = np.asarray(ids, np.float64)
        bad = ~np.isfinite(ids) | (ids != np.round(ids)) | (ids < 0) | (ids >= vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise DataError(f"{where(i)}: token {ids[j]:g} at position {j} is not an id in 0..{vocab_size - 1} "
                            "(data.vocab_size)")
        if len(ids) > length:
            raise DataError(f"{where(i)}: {len(ids)} tokens, more than data.sequence_length {length}; raise it "
                            f"(the longest sequence in {name} is {max(len(s) for s in sequences)})")
        rows[i, :len(ids)] = ids
    return rows
