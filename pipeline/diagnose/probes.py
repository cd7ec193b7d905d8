"""The probes, on the float32 twin (the same graph and weights, every layer in float32), so values are seen
before float16 would clip them:

Range probe (real validation batches): per layer the share of activations that overflow float16
(|x| > 65504), that would be subnormal (|x| < 6.1e-5) or flush to zero (|x| < 6e-8, zeros not counted),
and the largest magnitude; layers ranked most at risk first.
Gradient probe (a few real training batches, the compiled loss): per layer the gradients of the loss with
respect to its output and its weights, which float16 layers compute in float16, as they are (unscaled) and
multiplied by the loss scale (the run's final scale, else the configured initial or static one), with the
same float16 shares.
Divergence locator (one validation batch through the model as configured and through its float32 twin):
per layer in graph order the relative error ||mixed - float32|| / ||float32||, and the first layer where
it exceeds DIVERGENCE_TOLERANCE, which is where reduced precision first changes the numbers.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from pipeline import models
from pipeline.diagnose.graph import probed_layers, producer
from pipeline.diagnose.thresholds import (DIVERGENCE_TOLERANCE, FLOAT16_MAX, FLOAT16_MIN_NORMAL,
                                      FLOAT16_MIN_SUBNORMAL)
from pipeline.diagnose.findings import LayerDivergence, LayerGradients, LayerRange


def probe_ranges(model: keras.Model, batches: list[np.ndarray], twin: keras.Model | None = None) -> list[LayerRange]:
    """Per-layer activation statistics against float16's range, most at risk first."""
    probed = probed_layers(model)
    twin = twin or float32_twin(model)
    taps = keras.Model(twin.inputs, [twin.get_layer(layer.name).output for layer in probed])
    stats = {layer.name: [] for layer in probed}
    for batch in batches:
        values = taps([batch], training=False)
        for layer, value in zip(probed, values):
            stats[layer.name].append(np.abs(keras.ops.convert_to_numpy(value).astype(np.float64)).ravel())
    ranges = []
    for layer in probed:
        magnitudes = np.concatenate(stats[layer.name])
        ranges.append(LayerRange(layer.name, layer.compute_dtype, len(magnitudes), _max(magnitudes),
                                 *_float16_fractions(magnitudes)))
    # Layers that compute in float16 first: a float32 layer's range is shown but is at no risk.
    return sorted(ranges, key=lambda r: (r.compute_dtype == "float16", *r.risk), reverse=True)


def probe_gradients(model: keras.Model, batches: list[tuple[np.ndarray, np.ndarray]], loss: str,
                    loss_scale: float, twin: keras.Model | None = None) -> list[LayerGradients]:
    """Per-layer gradient statistics against float16's range, unscaled and times loss_scale, most at risk first.

    Computed in the float32 twin (values before float16 clips them) with the compiled loss averaged over
    the batch, as a train step does; a layer's gradients are those of the loss with respect to its output
    and its trainable weights."""
    probed = probed_layers(model)
    twin = twin or float32_twin(model)
    names = [layer.name for layer in probed]
    head = producer(keras.tree.flatten(twin.outputs)[0])
    # The model's output is read from its probed layer, so that the head's own gradient is recorded too.
    taps = keras.Model(twin.inputs, [twin.get_layer(name).output for name in names]
                       + ([] if head in names else [keras.tree.flatten(twin.outputs)[0]]))
    loss_fn = keras.losses.get(loss)
    stats = {layer.name: [] for layer in probed}
    for x, y in batches:
        x = tf.convert_to_tensor(x, tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(x)  # so the ops before the first layer with weights are recorded too
            outputs = taps([x], training=False)
            prediction = outputs[names.index(head)] if head in names else outputs.pop()
            value = keras.ops.mean(loss_fn(y, prediction))
        weights = [twin.get_layer(layer.name).trainable_variables for layer in probed]
        output_grads, weight_grads = tape.gradient(value, [outputs, weights])
        for layer, output_grad, grads in zip(probed, output_grads, weight_grads):
            parts = [g for g in (output_grad, *grads) if g is not None]
            stats[layer.name] += [np.abs(keras.ops.convert_to_numpy(g).astype(np.float64)).ravel() for g in parts]
    result = []
    for layer in probed:
        if not stats[layer.name]:  # no gradient flows through it, e.g. a softmax whose loss reads its logits
            continue
        magnitudes = np.concatenate(stats[layer.name])
        result.append(LayerGradients(layer.name, layer.compute_dtype, len(magnitudes), _max(magnitudes), loss_scale,
                                     *_float16_fractions(magnitudes), *_float16_fractions(magnitudes * loss_scale)))
    return sorted(result, key=lambda g: (g.compute_dtype == "float16", *g.risk), reverse=True)


def _float16_fractions(magnitudes: np.ndarray) -> tuple[float, float, float]:
    """Shares that overflow float16 (inf and NaN included), would be subnormal, or flush to zero (zeros not counted)."""
    n = max(len(magnitudes), 1)
    return (float(np.sum(~(magnitudes <= FLOAT16_MAX)) / n),
            float(np.sum((magnitudes >= FLOAT16_MIN_SUBNORMAL) & (magnitudes < FLOAT16_MIN_NORMAL)) / n),
            float(np.sum((magnitudes > 0) & (magnitudes < FLOAT16_MIN_SUBNORMAL)) / n))


def _max(magnitudes: np.ndarray) -> float:
    return float(np.max(magnitudes)) if len(magnitudes) else 0.0


def locate_divergence(model: keras.Model, batch: np.ndarray, twin: keras.Model | None = None) -> list[LayerDivergence]:
    """Per layer, in graph order, how far the model's output departs from its float32 twin's on one batch."""
    probed = probed_layers(model)
    twin = twin or float32_twin(model)
    mixed = keras.Model(model.inputs, [layer.output for layer in probed])([batch], training=False)
    exact = keras.Model(twin.inputs, [twin.get_layer(layer.name).output for layer in probed])([batch], training=False)
    result = []
    for layer, low, high in zip(probed, mixed, exact):
        low = keras.ops.convert_to_numpy(low).astype(np.float64)
        high = keras.ops.convert_to_numpy(high).astype(np.float64)
        if not np.all(np.isfinite(low)):
            error = math.inf
        else:
            error = float(np.linalg.norm(low - high) / max(np.linalg.norm(high), np.finfo(np.float32).tiny))
        result.append(LayerDivergence(layer.name, layer.compute_dtype, error))
    return result


def first_divergence(divergence: list[LayerDivergence], tolerance: float = DIVERGENCE_TOLERANCE) -> str | None:
    return next((d.layer for d in divergence if not d.relative_error <= tolerance), None)


def float32_twin(model: keras.Model) -> keras.Model:
    """The same graph and weights, every layer computing in float32, so activations are measured before
    float16 clips them (mixed policies keep float32 variables, so the weights carry over exactly)."""
    def clone_function(layer):
        return layer.__class__.from_config({**layer.get_config(), "dtype": "float32"})

    twin = keras.models.clone_model(model, clone_function=clone_function)
    models.copy_weights(model, twin)
    return twin
