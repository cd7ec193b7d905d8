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
Input limits (edge_rows, nonfinite_rows): rows with every feature, and each feature alone, at the smallest and
largest value of any feature in the training rows (digits: 0 and 16), through the model as it computes: legal
inputs the validation rows may never show, such as a pixel that was always 0 in training; and the same rows
FAR_BEYOND training ranges past either end (digits: -1600 and 1616), what a broken client may send.

The probes tap the layers of the model's own graph (graph.taps) and pair them with the twin's by position. One
that cannot run on a model raises graph.ProbeError (or whatever Keras raises), which run.py reports in one line.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from pipeline import models
from pipeline.data import Statistics
from pipeline.diagnose.graph import ProbeError, taps
from pipeline.diagnose.thresholds import (DIVERGENCE_TOLERANCE, EDGE_MAX_FEATURES, FLOAT16_MAX, FLOAT16_MIN_NORMAL,
                                          FLOAT16_MIN_SUBNORMAL)
from pipeline.diagnose.findings import LayerDivergence, LayerGradients, LayerRange


def probe_ranges(model: keras.Model, batches: list[np.ndarray], twin: keras.Model | None = None) -> list[LayerRange]:
    """Per-layer activation statistics against float16's range, most at risk first."""
    twin = twin or float32_twin(model)
    probed, exact = _paired_taps(model, twin)
    tapped = _tap_model(twin, exact)
    stats = {layer.name: [] for layer, _ in probed}
    for batch in batches:
        values = tapped([batch], training=False)
        for (layer, _), value in zip(probed, values):
            stats[layer.name].append(np.abs(keras.ops.convert_to_numpy(value).astype(np.float64)).ravel())
    ranges = []
    for layer, tensor in probed:
        magnitudes = np.concatenate(stats[layer.name])
        ranges.append(LayerRange(layer.name, _compute_dtype(layer, tensor), len(magnitudes), _max(magnitudes),
                                 *_float16_fractions(magnitudes)))
    # Layers that compute in float16 first: a float32 layer's range is shown but is at no risk.
    return sorted(ranges, key=lambda r: (r.compute_dtype == "float16", *r.risk), reverse=True)


def probe_gradients(model: keras.Model, batches: list[tuple[np.ndarray, np.ndarray]], loss: str,
                    loss_scale: float, twin: keras.Model | None = None) -> list[LayerGradients]:
    """Per-layer gradient statistics against float16's range, unscaled and times loss_scale, most at risk first.

    Computed in the float32 twin (values before float16 clips them) with the compiled loss averaged over
    the batch, as a train step does; a layer's gradients are those of the loss with respect to its output
    and its trainable weights."""
    twin = twin or float32_twin(model)
    probed, exact = _paired_taps(model, twin)
    output = keras.tree.flatten(twin.outputs)[0]
    # The model's output is read from its tap, so that the head's own gradient is recorded too.
    head = next((i for i, (_, tensor) in enumerate(exact) if tensor is output), None)
    tapped = _tap_model(twin, exact, [] if head is not None else [output])
    loss_fn = keras.losses.get(loss)
    stats = {layer.name: [] for layer, _ in probed}
    for x, y in batches:
        x = tf.convert_to_tensor(x, tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(x)  # so the ops before the first layer with weights are recorded too
            outputs = list(tapped([x], training=False))
            prediction = outputs[head] if head is not None else outputs.pop()
            value = keras.ops.mean(loss_fn(y, prediction))
        weights = [layer.trainable_variables for layer, _ in exact]
        output_grads, weight_grads = tape.gradient(value, [outputs, weights])
        for (layer, _), output_grad, grads in zip(probed, output_grads, weight_grads):
            parts = [g for g in (output_grad, *grads) if g is not None]
            stats[layer.name] += [np.abs(keras.ops.convert_to_numpy(g).astype(np.float64)).ravel() for g in parts]
    result = []
    for layer, tensor in probed:
        if not stats[layer.name]:  # no gradient flows through it, e.g. a softmax whose loss reads its logits
            continue
        magnitudes = np.concatenate(stats[layer.name])
        result.append(LayerGradients(layer.name, _compute_dtype(layer, tensor), len(magnitudes), _max(magnitudes),
                                     loss_scale, *_float16_fractions(magnitudes),
                                     *_float16_fractions(magnitudes * loss_scale)))
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
    twin = twin or float32_twin(model)
    probed, exact = _paired_taps(model, twin)
    mixed = _tap_model(model, probed)([batch], training=False)
    reference = _tap_model(twin, exact)([batch], training=False)
    result = []
    for (layer, tensor), low, high in zip(probed, mixed, reference):
        low = keras.ops.convert_to_numpy(low).astype(np.float64)
        high = keras.ops.convert_to_numpy(high).astype(np.float64)
        if not np.all(np.isfinite(low)):
            error = math.inf
        else:
            error = float(np.linalg.norm(low - high) / max(np.linalg.norm(high), np.finfo(np.float32).tiny))
        result.append(LayerDivergence(layer.name, _compute_dtype(layer, tensor), error))
    return result


def first_divergence(divergence: list[LayerDivergence], tolerance: float = DIVERGENCE_TOLERANCE) -> str | None:
    return next((d.layer for d in divergence if not d.relative_error <= tolerance), None)


def float32_twin(model: keras.Model) -> keras.Model:
    """The same graph and weights, every layer computing in float32, so activations are measured before
    float16 clips them (mixed policies keep float32 variables, so the weights carry over exactly). Layers are
    recreated from their configs, nested models too; raises for a layer that has no usable config (run.py
    then rebuilds the model under float32 instead)."""
    def clone_function(layer):
        return layer.__class__.from_config({**layer.get_config(), "dtype": "float32"})

    twin = keras.models.clone_model(model, clone_function=clone_function, recursive=True)
    models.copy_weights(model, twin)
    return twin


def edge_rows(statistics: Statistics, row_shape: tuple[int, ...], beyond: float = 0.0,
              max_features: int = EDGE_MAX_FEATURES, *, per_column: bool = False,
              ids: tuple[int, ...] = ()) -> tuple[np.ndarray, list[str]]:
    """Rows at the input limits and what each one is: every feature at its low limit, every feature at its high
    limit, then each feature alone at its high limit (the others low) and alone at its low limit (the others high).
    Beyond max_features features, a fixed sample of them.

    The limits are each feature's own training minimum and maximum with per_column (tabular rows, whose columns
    mean different things: an id column stays among its ids, issue 23), else the smallest and largest value of any
    feature (images, whose pixels share one range: a pixel always 0 in training may still be 16, issue #14). With
    beyond, each limit moves that many training ranges (max - min) past its end: inputs no client should send;
    the category-id columns at flat positions `ids` (DataSpec.categorical) keep their training limits, since an id
    is one the model knows or not, never far."""
    n = statistics.width
    if per_column:
        low, high = statistics.minimum.copy(), statistics.maximum.copy()
    else:
        low, high = np.full(n, statistics.minimum.min()), np.full(n, statistics.maximum.max())
    moved = np.ones(n, bool)
    moved[list(ids)] = False
    low, high = low - moved * beyond * (high - low), high + moved * beyond * (high - low)
    if per_column:
        past = f"{beyond:g} training ranges past " if beyond else ""
        named = (f"{past}its training minimum", f"{past}its training maximum", f"{past}their minimum",
                 f"{past}their maximum")
    else:
        named = (f"{low[0]:g}", f"{high[0]:g}", f"{low[0]:g}", f"{high[0]:g}")
    features = np.arange(n)
    if n > max_features:
        features = np.sort(np.random.default_rng(0).choice(n, max_features, replace=False))
    rows = [low, high]
    labels = [f"every feature at {named[0]}", f"every feature at {named[1]}"]
    for value, rest, others in ((high, low, named[2]), (low, high, named[3])):
        for j in features:
            row = rest.copy()
            row[j] = value[j]
            rows.append(row)
            labels.append(f"feature {j} at {value[j]:g}, the others at {others}")
    return np.asarray(rows, np.float32).reshape(-1, *row_shape), labels


def nonfinite_rows(model: keras.Model, rows: np.ndarray, batch_size: int = 256) -> list[int]:
    """Indices of the rows for which any output of the model (as it computes) is NaN or inf."""
    bad = []
    for start in range(0, len(rows), batch_size):
        outputs = keras.tree.flatten(model(rows[start:start + batch_size], training=False))
        finite = np.ones(min(batch_size, len(rows) - start), bool)
        for output in outputs:
            values = keras.ops.convert_to_numpy(output).astype(np.float64)
            finite &= np.isfinite(values.reshape(len(values), -1)).all(axis=1)
        bad += [start + int(i) for i in np.flatnonzero(~finite)]
    return bad


def _paired_taps(model: keras.Model, twin: keras.Model):
    """The model's taps and the twin's, position by position (a rebuilt twin may name auto-named layers anew)."""
    mine, theirs = taps(model), taps(twin)
    if [type(layer) for layer, _ in mine] != [type(layer) for layer, _ in theirs]:
        raise ProbeError("the float32 twin's layers differ from the model's")
    return mine, theirs


def _tap_model(model: keras.Model, tapped, extra_outputs=()):
    """A function from model's input to the tapped tensors of its graph (plus extra_outputs), as a list."""
    tap = keras.Model(model.inputs, [tensor for _, tensor in tapped] + list(extra_outputs))
    return lambda x, training: keras.tree.flatten(tap(x, training=training))


def _compute_dtype(layer, tensor) -> str:
    """The dtype a tap's values are computed in: the layer's compute dtype, or a nested model's output dtype."""
    if isinstance(layer, keras.Model):
        return keras.backend.standardize_dtype(tensor.dtype)
    return layer.compute_dtype
