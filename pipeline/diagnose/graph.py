"""Walking a model's graph: the tensors the probes tap, a tensor's producer, and the layers that read a layer's
output (every layer at any depth, by full path, is models.layer_paths).

The probes tap each layer's output in *this* model's graph, found from the model's outputs back through each
tensor's history: `layer.output` is the output of the layer's first call, which for a builder's layer shared into
the pipeline's model is the builder's own graph (docs/keras3-mixed-precision.md §8). A layer called twice is
tapped at each call (causal_lm's tied embedding: the ids' embeddings, then the logits).

A subclassed layer with layers inside (causal_lm's DecoderBlock, a MultiHeadAttention) is one node of the graph:
its output may be float32 while its insides compute in float16. Its leaf sublayers are tapped too, as the layer
calls them (`recording`: Keras layers have no forward hooks, so each one's `call` is wrapped for the duration of
the probe), named by full path ('block_1/mlp_1'), which precision.float32_layers takes.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras

from pipeline.models.float32_rule import layer_paths


@dataclasses.dataclass(frozen=True)
class Tap:
    """A value a probe reads: a layer's output in the model's graph (tensor), or a sublayer's, recorded as the
    layer around it calls it (tensor None)."""

    name: str  # the layer's name ('name (call 2)' for its second call), or a sublayer's full path
    layer: keras.layers.Layer
    tensor: object = None


class ProbeError(Exception):
    """A probe cannot run on this model; str() is the one line that says why."""


def taps(model: keras.Model) -> list[Tap]:
    """A Tap for every call of a non-input top-level layer with one output, in the model's layer order (a layer's
    later calls after the layer that each reads from), each subclassed layer's leaf sublayers just before it. A
    nested model is one tap (its output)."""
    calls = _calls(model)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    found: list[Tap] = []
    for layer in layers:
        first = calls.get(id(layer), [None])[0]
        if first is not None and len(first.outputs) == 1:
            found += [*inner_taps(layer), Tap(layer.name, layer, first.outputs[0])]
    for layer in layers:
        for index, node in enumerate(calls.get(id(layer), [])[1:], 2):
            if len(node.outputs) != 1:
                continue
            read = [i for i, tap in enumerate(found) if any(tap.tensor is x for x in node.input_tensors)]
            found.insert(max(read, default=len(found) - 1) + 1, Tap(f"{layer.name} (call {index})", layer,
                                                                     node.outputs[0]))
    return found


def inner_taps(layer: keras.layers.Layer) -> list[Tap]:
    """The leaf sublayers of a subclassed layer (not a nested model), by full path; Dropout left out (the
    probes run inference, where it passes its input on)."""
    if isinstance(layer, keras.Model):
        return []
    return [Tap(f"{layer.name}/{path}", inner) for path, inner in layer_paths(layer).items()
            if not layer_paths(inner) and not isinstance(inner, keras.layers.Dropout)]


@contextlib.contextmanager
def recording(layers):
    """Records each layer's latest output while the block runs: {id(layer): output}. Each layer's `call` is
    wrapped by an instance attribute, which is removed on the way out (so the class's method shows through again),
    or put back where the layer had one of its own."""
    recorded: dict[int, object] = {}
    wrapped: dict[int, tuple] = {}  # id(layer) → (layer, its own instance attribute `call`, if any)
    try:
        for layer in layers:
            if id(layer) in wrapped:
                continue
            wrapped[id(layer)] = (layer, layer.__dict__.get("call"))

            def call(*args, _call=layer.call, _key=id(layer), **kwargs):
                output = _call(*args, **kwargs)
                recorded[_key] = output
                return output
            layer.call = call
        yield recorded
    finally:
        for layer, own in wrapped.values():
            if own is not None:
                layer.call = own
            else:
                del layer.call


def probed_layers(model: keras.Model) -> list[str]:
    """The names of what the probes tap (taps' names), in graph order."""
    return [tap.name for tap in taps(model)]


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


def _calls(model: keras.Model) -> dict[int, list]:
    """id(layer) → the nodes of that layer in this model's graph, in the order the layer was called."""
    nodes = _nodes(model, every=True)
    return {key: sorted(found, key=lambda node: next(i for i, n in enumerate(node.operation._inbound_nodes)
                                                     if n is node))
            for key, found in nodes.items()}


def _nodes(model: keras.Model, every: bool = False) -> dict:
    """id(layer) → the node of that layer in this model's graph (the first found for a layer called twice), or
    with every, the list of all of them."""
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
        if every:
            found = nodes.setdefault(id(history.operation), [])
            if not any(n is node for n in found):
                found.append(node)
        else:
            nodes.setdefault(id(history.operation), node)
        stack.extend(node.input_tensors)
    return nodes
