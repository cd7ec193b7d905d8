"""Walking a model's graph: the tensors the probes tap, a tensor's producer, and the layers that read a layer's
output (every layer at any depth, by full path, is models.layer_paths).

The probes tap each layer's output in *this* model's graph, found from the model's outputs back through each
tensor's history: `layer.output` is the output of the layer's first call, which for a builder's layer shared into
the pipeline's model is the builder's own graph (docs/keras3-mixed-precision.md §8).
"""

from __future__ import annotations

import keras


class ProbeError(Exception):
    """A probe cannot run on this model; str() is the one line that says why."""


def taps(model: keras.Model) -> list[tuple[keras.layers.Layer, object]]:
    """(layer, its output tensor in this model's graph) for every non-input top-level layer with one output, in
    the model's layer order. A nested model is one tap (its output)."""
    nodes = _nodes(model)
    return [(layer, nodes[id(layer)].outputs[0]) for layer in model.layers
            if id(layer) in nodes and not isinstance(layer, keras.layers.InputLayer)
            and len(nodes[id(layer)].outputs) == 1]


def probed_layers(model: keras.Model) -> list:
    """The layers a probe taps (taps' layers)."""
    return [layer for layer, _ in taps(model)]


def readers(model: keras.Model) -> dict[str, list]:
    """Layer name → the layers that read its output, in this model's graph and the graphs of nested functional
    models; a layer inside a subclassed model has no entry."""
    try:
        nodes = _nodes(model)
    except ProbeError:
        return {}
    result: dict[str, list] = {}
    for layer in model.layers:
        node = nodes.get(id(layer))
        for tensor in node.input_tensors if node else []:
            name = producer(tensor)
            if name is not None and layer not in result.setdefault(name, []):
                result[name].append(layer)
        if isinstance(layer, keras.Model):
            for name, inner in readers(layer).items():
                result.setdefault(name, []).extend(inner)
    return result


def producer(tensor) -> str | None:
    history = getattr(tensor, "_keras_history", None)
    return history.operation.name if history else None


def _nodes(model: keras.Model) -> dict[int, object]:
    """id(layer) → the node of that layer in this model's graph (the first found for a layer called twice)."""
    try:
        stack = list(keras.tree.flatten(model.outputs))
    except (AttributeError, ValueError):
        raise ProbeError(f"model {model.name!r} is subclassed: it has no graph of layers to tap") from None
    if len(keras.tree.flatten(model.inputs)) != 1:
        raise ProbeError(f"model {model.name!r} has {len(keras.tree.flatten(model.inputs))} inputs; "
                         "the probes feed the data's one input")
    nodes, seen = {}, set()
    while stack:
        tensor = stack.pop()
        history = getattr(tensor, "_keras_history", None)
        if history is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        node = history.operation._inbound_nodes[history.node_index]
        nodes.setdefault(id(history.operation), node)
        stack.extend(node.input_tensors)
    return nodes
