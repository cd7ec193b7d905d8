"""Which layer first turns finite values into inf or NaN, and the one line that says so with the fix.

A float16 overflow shows up far from where it happens: as outputs that "do not sum to 1", a NaN loss, a
collapsed loss scale. The build-time check (models), diagnose and the training guard's stop all run
first_nonfinite on training rows through the model as it computes and name the first layer, in graph
order, whose output holds inf or NaN: under the policy, what it read, and the fix, which adds the layer to
the user's precision.float32_layers (merged, never replacing them: issue 23).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
import numpy as np

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = float(np.finfo(np.float16).tiny)  # 2**-14 = 6.1e-5
# Rows per forward pass while looking, and at most this many rows in all.
BATCH_ROWS, MAX_ROWS = 256, 4096


@dataclasses.dataclass(frozen=True)
class NonFinite:
    layer: str  # the layer (or operation) whose output first holds inf or NaN
    kind: str  # its class, e.g. Rescaling
    compute_dtype: str  # what it computes in
    values: str  # "inf", "NaN" or "inf and NaN"
    input_max: float  # the largest magnitude it read on the rows that made them
    is_layer: bool = True  # False for an operation such as x[:, :16], which has no dtype policy of its own


def nodes_in_order(model: keras.Model) -> list:
    """The nodes of the model's own graph, each after the nodes it reads (its layers' calls, and operations such as
    slicing); [] for a subclassed model, which has no graph."""
    try:
        outputs = list(keras.tree.flatten(model.outputs))
    except (AttributeError, ValueError):
        return []
    order, done, stack = [], set(), [(tensor, False) for tensor in outputs]
    while stack:
        tensor, expanded = stack.pop()
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            continue
        node = history.operation._inbound_nodes[history.node_index]
        if id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((tensor, True))
        stack.extend((parent, False) for parent in node.input_tensors)
    return [node for node in order if not isinstance(node.operation, keras.layers.InputLayer)]


def probe_rows(x: np.ndarray, first: int = 8) -> np.ndarray:
    """The rows most likely to overflow: those that hold each feature's largest magnitude, then the first `first`
    rows; at most MAX_ROWS."""
    extremes = np.argmax(np.abs(x.reshape(len(x), -1)), axis=0).tolist()
    return x[list(dict.fromkeys([*extremes, *range(min(first, len(x)))]))[:MAX_ROWS]]


def first_nonfinite(model: keras.Model, rows: np.ndarray) -> NonFinite | None:
    """The first node, in graph order, whose output holds inf or NaN on any of rows (in batches, stopping at the
    first batch that has one); None when every output is finite or the model has no graph to walk."""
    nodes = nodes_in_order(model)
    if not nodes:
        return None
    tensors = [[t for t in keras.tree.flatten(node.outputs)] for node in nodes]
    tap = keras.Model(model.inputs, [t for group in tensors for t in group])
    for start in range(0, min(len(rows), MAX_ROWS), BATCH_ROWS):
        batch = rows[start:start + BATCH_ROWS]
        values = iter(keras.ops.convert_to_numpy(v) for v in keras.tree.flatten(tap([batch], training=False)))
        outputs = [[next(values) for _ in group] for group in tensors]
        found = _first_in(nodes, outputs, batch)
        if found is not None:
            return found
    return None


def _first_in(nodes: list, outputs: list[list[np.ndarray]], batch: np.ndarray) -> NonFinite | None:
    by_tensor = {}
    for node, values in zip(nodes, outputs):
        for tensor, value in zip(keras.tree.flatten(node.outputs), values):
            by_tensor[id(tensor)] = value
    for node, values in zip(nodes, outputs):
        flat = np.concatenate([np.asarray(v, np.float64).ravel() for v in values]) if values else np.zeros(0)
        if np.all(np.isfinite(flat)):
            continue
        read = [np.abs(np.asarray(by_tensor.get(id(t), batch), np.float64)).max(initial=0.0)
                for t in node.input_tensors]
        has_inf, has_nan = bool(np.isinf(flat).any()), bool(np.isnan(flat).any())
        operation = node.operation
        return NonFinite(operation.name, type(operation).__name__, _narrowest_dtype(operation, values),
                         " and ".join(w for w, present in (("inf", has_inf), ("NaN", has_nan)) if present),
                         float(max(read, default=0.0)), isinstance(operation, keras.layers.Layer))
    return None


def _narrowest_dtype(operation, values: list[np.ndarray]) -> str:
    """What a layer computes in, counting its sublayers (a MultiHeadAttention's projections keep the policy they
    were built under); an operation's output dtype."""
    if not isinstance(operation, keras.layers.Layer):
        return str(np.asarray(values[0]).dtype)
    dtypes = {layer.compute_dtype for layer in operation._flatten_layers(include_self=True)}
    return next((d for d in ("float16", "bfloat16") if d in dtypes), operation.compute_dtype)


def describe(found: NonFinite, policy: str, float32_layers: Sequence[str] = (),
             float16_layers: Sequence[str] = ()) -> str:
    """One line: the layer, under which policy, what it read, and the fix."""
    what = (f"layer '{found.layer}' ({found.kind}, computing in {found.compute_dtype})" if found.is_layer
            else f"operation '{found.layer}' ({found.kind})")
    read = (f"it reads values up to {found.input_max:.3g}, beyond float16's maximum 65504"
            if found.compute_dtype == "float16" and found.input_max > FLOAT16_MAX
            else f"from inputs of at most {found.input_max:.3g}")
    return f"under policy {policy}, {what} is the first to produce {found.values} ({read}); fix: " + fix_text(
        found, float32_layers, float16_layers)


def fix_text(found: NonFinite, float32_layers: Sequence[str] = (), float16_layers: Sequence[str] = ()) -> str:
    if found.layer in float16_layers:
        return (f"remove it from precision.float16_layers, which keeps it in float16: "
                f"{_flow(merged_float16_layers(float16_layers, found.layer))}")
    if found.layer in float32_layers and found.compute_dtype in ("float16", "bfloat16"):
        return (f"it is in precision.float32_layers, but sublayers of it still compute in {found.compute_dtype}; "
                "train under precision.policy mixed_bfloat16 or float32")
    if not found.is_layer or found.compute_dtype not in ("float16", "bfloat16"):
        return ("it does not compute in float16, so this is not a float16 overflow: check its math (a log or a "
                "division by 0) and the data, or set precision.check_numerics: true to find the op")
    return f"precision.float32_layers: {_flow(merged_float32_layers(float32_layers, found.layer))}"


def merged_float32_layers(float32_layers: Sequence[str], layer: str) -> list[str]:
    """The user's precision.float32_layers with the layer added: a fix never drops the user's own entries."""
    return list(dict.fromkeys([*float32_layers, layer]))


def merged_float16_layers(float16_layers: Sequence[str], layer: str) -> list[str]:
    return [name for name in float16_layers if name != layer]


def _flow(names: list[str]) -> str:
    return "[" + ", ".join(names) + "]"
