"""Column kinds: category ids and the layers that index by them.

Columns listed in data.categorical_columns hold category ids and pass into the model unchanged
(models._standardize gives them mean 0 and variance 1). An id column that is not listed would be
standardised with the rest by model.normalize, and a layer that looks values up by id (an Embedding)
then indexes by standardised values: the model trains without an error on the wrong inputs (issue 23:
val_accuracy 0.55 instead of 0.99). undeclared_ids finds such columns before training, so that train
can warn with the fix.
"""

from __future__ import annotations

import fnmatch
import logging
import re

import keras
import numpy as np
from keras import layers

from pipeline.data import DataSpec

log = logging.getLogger(__name__)

# Layers whose input is an id to look up, not a quantity.
INDEXING_LAYERS = (layers.Embedding, layers.IntegerLookup, layers.CategoryEncoding, layers.Hashing)
# More distinct integers than this reads as a count or a measurement rather than a category.
MAX_ID_VALUES = 1000


def warn_if_ids_are_standardised(model: keras.Model, spec: DataSpec, train_x: np.ndarray) -> list[int]:
    """Logs one warning naming the undeclared id columns that reach an indexing layer through the standardisation,
    and the fix; returns their positions in a flat row (none: no warning)."""
    found = undeclared_ids(model, spec, train_x)
    if not found:
        return []
    positions, layer = found
    flat = train_x.reshape(len(train_x), -1)[:, positions]
    names = [spec.feature_name(j) for j in positions]
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ... {names[-1]}"
    log.warning("data: %d column%s (%s) hold category ids (%s..%s) and reach %s %r standardised by model.normalize, "
                "so it looks up standardised values instead of the ids; declare them, data.categorical_columns: %s "
                "(docs/configuration.md#column-kinds), or set model.normalize: false",
                len(names), "s" if len(names) > 1 else "", shown, _number(flat.min()), _number(flat.max()),
                type(layer).__name__, layer.name, _suggested_list(spec, positions))
    return positions


def undeclared_ids(model: keras.Model, spec: DataSpec, train_x: np.ndarray) -> tuple[list[int], layers.Layer] | None:
    """(positions, layer): the columns that look like ids (integers >= 0, at most MAX_ID_VALUES distinct values), are
    not in data.categorical_columns, and feed an indexing layer of the model; None when there are none. When the
    model's graph cannot be traced to the layer (a subclassed model), every such column counts."""
    indexing = [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, INDEXING_LAYERS)]
    if not indexing:
        return None
    candidates = _id_like_columns(train_x.reshape(len(train_x), -1), spec.categorical)
    if not candidates:
        return None
    traced = _layer_inputs(model, indexing)
    if not traced:
        return candidates, indexing[0]
    for layer, tensor in traced:
        fed = _columns_feeding(model, tensor, train_x, candidates)
        if fed:
            return fed, layer
    return None


def _id_like_columns(flat: np.ndarray, declared: tuple[int, ...]) -> list[int]:
    integral = np.all(flat == np.round(flat), axis=0) & np.all(flat >= 0, axis=0)
    return [j for j in np.flatnonzero(integral) if j not in declared and len(np.unique(flat[:, j])) <= MAX_ID_VALUES]


def _layer_inputs(model: keras.Model, wanted: list[layers.Layer]) -> list[tuple[layers.Layer, object]]:
    """(layer, the tensor it reads in this model's graph) for each wanted layer called in the model's own graph."""
    try:
        stack = list(keras.tree.flatten(model.outputs))
    except (AttributeError, ValueError):  # a subclassed model: no graph
        return []
    found, seen = {}, set()
    while stack:
        history = getattr(stack.pop(), "_keras_history", None)
        if history is None or (id(history.operation), history.node_index) in seen:
            continue
        seen.add((id(history.operation), history.node_index))
        node = history.operation._inbound_nodes[history.node_index]
        if any(history.operation is layer for layer in wanted) and node.input_tensors:
            found.setdefault(id(history.operation), (history.operation, node.input_tensors[0]))
        stack.extend(node.input_tensors)
    return list(found.values())


def _columns_feeding(model: keras.Model, tensor, train_x: np.ndarray, candidates: list[int]) -> list[int]:
    """The candidate columns whose value changes what the layer reads: one row, then that row with each candidate
    moved by 1, through the graph up to the layer's input."""
    reads = keras.Model(model.inputs, tensor)
    base = train_x[:1].reshape(1, -1)
    rows = np.repeat(base, len(candidates) + 1, axis=0)
    for k, j in enumerate(candidates, start=1):
        rows[k, j] += 1
    values = keras.ops.convert_to_numpy(reads([rows.reshape(-1, *train_x.shape[1:])], training=False))
    return [j for k, j in enumerate(candidates, start=1) if not np.array_equal(values[k], values[0])]


def _suggested_list(spec: DataSpec, positions: list[int]) -> str:
    """The data.categorical_columns value to paste: a pattern where the names share a stem ('merchant_*')."""
    if not spec.feature_names:
        return "[" + ", ".join(str(j) for j in positions) + "]"
    bases = list(dict.fromkeys(spec.feature_name(j).partition("[")[0] for j in positions))
    stems = {re.sub(r"\d+$", "", base) for base in bases}
    if len(bases) > 2 and len(stems) == 1 and next(iter(stems)):
        pattern = next(iter(stems)) + "*"
        matched = {name.partition("[")[0] for name in spec.feature_names if fnmatch.fnmatchcase(name, pattern)}
        if matched == set(bases):  # the pattern names these columns and no others
            return f"[{pattern}]"
    return "[" + ", ".join(bases) + "]"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
