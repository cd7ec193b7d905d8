"""The checks every row of every source passes, whatever its format: a label that is a class id (or a finite
target), finite feature values, category ids that are ids, token ids inside the vocabulary.

Vectorised over a batch: find_problems returns each bad row's first problem, and the statistics pass (or the
in-memory reader) decides what to do with it under data.max_bad_records.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rules:
    task: str  # classification | regression
    num_classes: int | None = None  # declared (data.num_classes): labels must be below it
    categorical: tuple[int, ...] = ()  # flat positions holding category ids
    feature_names: tuple[str, ...] = ()  # one per flat position, where the source names them
    label: str = "label"  # the label's column or feature name
    vocab_size: int | None = None  # token sequences: ids 0..vocab_size-1
    sequence_length: int | None = None  # token sequences: at most this many ids


@dataclasses.dataclass(frozen=True)
class Problem:
    row: int  # index in the batch
    column: str | None  # the column or feature that is wrong; None for the row as a whole
    reason: str  # "label 2 is not below data.num_classes 2"


def find_problems(x: np.ndarray, y: np.ndarray, rules: Rules, lengths: np.ndarray | None = None) -> list[Problem]:
    """The first problem of each bad row of a batch: x [n, ...] values (token sequences: ids padded with 0, lengths
    the ids per row), y [n] labels."""
    n = len(x)
    flat = np.asarray(x).reshape(n, -1)  # float32 rows stay float32: every check here is exact in it
    found: dict[int, Problem] = {}

    def add(bad: np.ndarray, problem) -> None:
        for i in np.flatnonzero(bad):
            if int(i) not in found:
                found[int(i)] = problem(int(i))

    labels = np.asarray(y, np.float64).reshape(n)
    add(~np.isfinite(labels), lambda i: Problem(i, rules.label, "label is NaN or infinite"))
    if rules.task == "classification":
        finite = np.where(np.isfinite(labels), labels, 0)
        add(finite != np.round(finite), lambda i: Problem(i, rules.label, f"label {_value(labels[i])} is not an integer "
                                                          "class id; use data.task: regression for real-valued targets"))
        add(finite < 0, lambda i: Problem(i, rules.label, f"label {_value(labels[i])} is negative; class ids are 0, 1, ..."))
        if rules.num_classes is not None:
            add(finite >= rules.num_classes, lambda i: Problem(
                i, rules.label, f"label {_value(labels[i])} is not below data.num_classes {rules.num_classes}"))
    if rules.vocab_size is not None:
        _token_problems(flat, lengths, rules, add)
    else:
        finite = np.isfinite(flat)
        add(~finite.all(axis=1), lambda i: Problem(i, _name(rules, int(np.argmin(finite[i]))),
                                                   "a value is NaN or infinite"))
        if rules.categorical:
            ids = flat[:, list(rules.categorical)]
            bad = (ids != np.round(ids)) | (ids < 0)
            add(bad.any(axis=1), lambda i: Problem(
                i, _name(rules, rules.categorical[int(np.argmax(bad[i]))]),
                f"{_value(ids[i, int(np.argmax(bad[i]))])} is not a category id (an integer >= 0), but "
                "data.categorical_columns lists it"))
    return [found[i] for i in sorted(found)]


def _token_problems(ids: np.ndarray, lengths: np.ndarray | None, rules: Rules, add) -> None:
    bad = ~np.isfinite(ids) | (ids != np.round(ids)) | (ids < 0) | (ids >= rules.vocab_size)
    add(bad.any(axis=1), lambda i: Problem(
        i, None, f"token {ids[i, int(np.argmax(bad[i]))]:g} at position {int(np.argmax(bad[i]))} is not an id in "
                 f"0..{rules.vocab_size - 1} (data.vocab_size)"))
    if rules.sequence_length is not None and lengths is not None:
        add(lengths > rules.sequence_length, lambda i: Problem(
            i, None, f"{int(lengths[i])} tokens, more than data.sequence_length {rules.sequence_length}; raise it"))


def _name(rules: Rules, position: int) -> str | None:
    return rules.feature_names[position].partition("[")[0] if position < len(rules.feature_names) else None


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{float(v):g}"
