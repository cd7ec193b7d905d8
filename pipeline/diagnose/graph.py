"""Walking a model's graph: its layers (nested models flattened), the layers the probes tap, a tensor's producer."""

from __future__ import annotations

import keras


def all_layers(model: keras.Model):
    return [layer for layer in model.layers if not isinstance(layer, keras.Model)] + [
        inner for layer in model.layers if isinstance(layer, keras.Model) for inner in all_layers(layer)]


def probed_layers(model: keras.Model) -> list:
    """The layers a probe taps: every non-input layer with a single output tensor."""
    return [layer for layer in all_layers(model) if not isinstance(layer, keras.layers.InputLayer)
            and len(keras.tree.flatten(layer.output)) == 1]


def producer(tensor) -> str | None:
    history = getattr(tensor, "_keras_history", None)
    return history.operation.name if history else None
