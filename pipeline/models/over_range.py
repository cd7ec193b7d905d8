"""The over-range rule: a layer that would read or compute values beyond float16's range from the training rows
computes in float32, whatever the policy.

float16 stops at 65504. A builder that rescales raw amounts (median 13k, 16% above 65504: issue 23) casts them to
float16 in its Rescaling layer, where they become inf before the rescaling could bring them down; the outputs
are then NaN and nothing says why. The rule looks at what the data alone decides: the part of the model's graph
that computes from the inputs without trainable weights (slicing, reshaping, rescaling, the standardisation)
and the layers that read it, all computed in float32 on every training row. Each float16 layer there that reads
(or, without weights, produces) a value beyond 65504 computes in float32 instead, and the build logs it. The
weights take no part, so every build of the model from the same rows (training, export, diagnose) decides alike,
and a model loaded from model.keras keeps the float32 layers it trained with. Naming a layer in
precision.float16_layers keeps it in float16; the build-time check then names it as the layer that overflows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import keras
import numpy as np
from keras import layers

from pipeline.models.nonfinite import FLOAT16_MAX, nodes_in_order

log = logging.getLogger(__name__)

_BATCH_ROWS = 4096


def keep_over_range_in_float32(model: keras.Model, rows: np.ndarray, float16_layers: Sequence[str] = (),
                               input_max: float | None = None) -> list[tuple[str, float]]:
    """Applies the rule in place; returns (layer name, largest value it would meet) for each layer it set to
    float32. rows: training rows (the statistics' sample: the first rows and each feature's extreme row);
    input_max: the largest input magnitude over every training row (default: the rows')."""
    nodes = nodes_in_order(model)
    if not any(getattr(node.operation, "compute_dtype", None) == "float16" for node in nodes):
        return []
    region, readers = _data_only(nodes, model)
    largest = _largest_values(model, region, readers, rows, input_max)
    pinned = []
    for node in [*region, *readers]:
        layer = node.operation
        if (not isinstance(layer, layers.Layer) or isinstance(layer, keras.Model) or layer.compute_dtype != "float16"
                or layer.name in float16_layers):
            continue
        seen = [largest[id(t)] for t in node.input_tensors if id(t) in largest]
        if node in region:
            seen += [largest[id(t)] for t in keras.tree.flatten(node.outputs)]
        if max(seen, default=0.0) > FLOAT16_MAX:
            _set_float32(layer)
            pinned.append((layer.name, max(seen)))
    for name, value in pinned:
        log.info("precision: layer %r meets values up to %.3g on the training rows, beyond float16's maximum 65504: "
                 "it computes in float32 (precision.float16_layers keeps it in float16)", name, value)
    return pinned


def _data_only(nodes: list, model: keras.Model) -> tuple[list, list]:
    """(region, readers): the nodes that compute from the inputs alone, without trainable weights, and the other
    nodes that read what the region computes."""
    known = {id(t) for t in keras.tree.flatten(model.inputs)}
    region, readers = [], []
    for node in nodes:
        inputs = [id(t) for t in node.input_tensors]
        if not inputs or not all(i in known for i in inputs):
            if any(i in known for i in inputs):
                readers.append(node)
            continue
        operation = node.operation
        if isinstance(operation, keras.Model) or getattr(operation, "trainable_weights", None):
            readers.append(node)
            continue
        region.append(node)
        known.update(id(t) for t in keras.tree.flatten(node.outputs))
    return region, readers


def _largest_values(model: keras.Model, region: list, readers: list, rows: np.ndarray,
                    input_max: float | None) -> dict[int, float]:
    """id(tensor) → its largest magnitude on the training rows, computed in float32: the region's layers are set
    to float32 for the measurement and back afterwards."""
    inputs = {id(t) for t in keras.tree.flatten(model.inputs)}
    largest = dict.fromkeys(inputs, float(np.abs(rows).max(initial=0.0)) if input_max is None else input_max)
    tensors = {}
    for node in region:
        tensors.update((id(t), t) for t in keras.tree.flatten(node.outputs))
    keys = list(tensors)
    largest.update(dict.fromkeys(keys, 0.0))
    if not keys:
        return largest
    changed = [op for op in {id(n.operation): n.operation for n in region}.values()
               if isinstance(op, layers.Layer) and op.compute_dtype != "float32"]
    previous = [layer.dtype_policy for layer in changed]
    try:
        for layer in changed:
            _set_float32(layer)
        tap = keras.Model(model.inputs, [tensors[key] for key in keys])
        for start in range(0, len(rows), _BATCH_ROWS):
            values = keras.tree.flatten(tap([rows[start:start + _BATCH_ROWS]], training=False))
            for key, value in zip(keys, values):
                magnitude = np.abs(keras.ops.convert_to_numpy(value).astype(np.float64))
                largest[key] = max(largest[key], float(np.nan_to_num(magnitude, nan=np.inf).max(initial=0.0)))
    finally:
        for layer, policy in zip(changed, previous):
            layer.dtype_policy = policy
            if isinstance(layer, layers.Normalization):
                layer.finalize_state()
    return largest


def _set_float32(layer: layers.Layer) -> None:
    layer.dtype_policy = "float32"
    if isinstance(layer, layers.Normalization):  # its mean and variance are cast to the compute dtype here
        layer.finalize_state()
