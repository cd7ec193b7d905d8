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
FAR_BEYOND training ranges past either end (digits: -1600 and 1616), what a broken client may send. A language
model's ids have no range to go beyond: its rows are each token id repeated over the longest context, and ids
outside the vocabulary (token_rows).

The probes tap the layers of the model's own graph and the leaf sublayers of its subclassed layers (graph.taps) and
pair them with the twin's by position. One
that cannot run on a model raises graph.ProbeError (or whatever Keras raises), which run.py reports in one line.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from pipeline import models
from pipeline.models.float32_rule import layer_paths
from pipeline.data import Statistics
from pipeline.diagnose.graph import ProbeError, Tap, recording, taps
from pipeline.diagnose.thresholds import (DIVERGENCE_TOLERANCE, EDGE_MAX_FEATURES, FLOAT16_MAX, FLOAT16_MIN_NORMAL,
                                          FLOAT16_MIN_SUBNORMAL)
from pipeline.diagnose.findings import LayerDivergence, LayerGradients, LayerRange


def probe_ranges(model: keras.Model, batches: list[np.ndarray], twin: keras.Model | None = None) -> list[LayerRange]:
    """Per-layer activation statistics against float16's range, most at risk first."""
    twin = twin or float32_twin(model)
    probed, exact = _paired_taps(model, twin)
    stats = {tap.name: [] for tap in probed}
    dtypes = _compute_dtypes(model, probed, batches[0]) if batches else {}
    for batch in batches:
        values, _ = _run_taps(twin, exact, batch)
        for tap, value in zip(probed, values):
            if value is not None:
                stats[tap.name].append(np.abs(keras.ops.convert_to_numpy(value).astype(np.float64)).ravel())
    ranges = []
    for tap in probed:
        if not stats[tap.name]:  # a sublayer its layer never called
            continue
        magnitudes = np.concatenate(stats[tap.name])
        ranges.append(LayerRange(tap.name, dtypes[tap.name], len(magnitudes), _max(magnitudes),
                                 *_float16_fractions(magnitudes)))
    # Layers that compute in float16 first: a float32 layer's range is shown but is at no risk.
    return sorted(ranges, key=lambda r: (r.compute_dtype == "float16", *r.risk), reverse=True)


def probe_gradients(model: keras.Model, batches: list[tuple[np.ndarray, np.ndarray]], loss,
                    loss_scale: float, twin: keras.Model | None = None) -> list[LayerGradients]:
    """Per-layer gradient statistics against float16's range, unscaled and times loss_scale, most at risk first.

    Computed in the float32 twin (values before float16 clips them) with the compiled loss (a name or a Loss)
    averaged over the batch, as a train step does; a layer's gradients are those of the loss with respect to its
    output and its trainable weights."""
    twin = twin or float32_twin(model)
    probed, exact = _paired_taps(model, twin)
    output = keras.tree.flatten(twin.outputs)[0]
    # The model's output is read from its tap, so that the head's own gradient is recorded too.
    head = next((i for i, tap in enumerate(exact) if tap.tensor is output), None)
    loss_fn = keras.losses.get(loss)
    stats = {tap.name: [] for tap in probed}
    input_dtype = keras.backend.standardize_dtype(keras.tree.flatten(twin.inputs)[0].dtype)
    dtypes = _compute_dtypes(model, probed, batches[0][0]) if batches else {}
    for x, y in batches:
        x = tf.convert_to_tensor(x, input_dtype)
        with tf.GradientTape() as tape:
            if x.dtype.is_floating:
                tape.watch(x)  # so the ops before the first layer with weights are recorded too
            outputs, extra = _run_taps(twin, exact, x, [] if head is not None else [output])
            prediction = outputs[head] if head is not None else extra[0]
            value = keras.ops.mean(loss_fn(y, prediction))
        found = [(i, value_) for i, value_ in enumerate(outputs) if value_ is not None]
        weights = [exact[i].layer.trainable_variables for i, _ in found]
        output_grads, weight_grads = tape.gradient(value, [[v for _, v in found], weights])
        for (i, _), output_grad, grads in zip(found, output_grads, weight_grads):
            parts = [g for g in (output_grad, *grads) if g is not None]
            stats[probed[i].name] += [np.abs(keras.ops.convert_to_numpy(g).astype(np.float64)).ravel() for g in parts]
    result = []
    for tap in probed:
        if not stats[tap.name]:  # no gradient flows through it, e.g. a softmax whose loss reads its logits
            continue
        magnitudes = np.concatenate(stats[tap.name])
        result.append(LayerGradients(tap.name, dtypes[tap.name], len(magnitudes), _max(magnitudes),
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
    mixed, _ = _run_taps(model, probed, batch)
    reference, _ = _run_taps(twin, exact, batch)
    result = []
    for tap, low, high in zip(probed, mixed, reference):
        if low is None or high is None:
            continue
        low_dtype = keras.backend.standardize_dtype(low.dtype)
        low = keras.ops.convert_to_numpy(low).astype(np.float64)
        high = keras.ops.convert_to_numpy(high).astype(np.float64)
        if not np.all(np.isfinite(low)):
            error = math.inf
        else:
            error = float(np.linalg.norm(low - high) / max(np.linalg.norm(high), np.finfo(np.float32).tiny))
        result.append(LayerDivergence(tap.name, _compute_dtype(tap, low_dtype), error))
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
    # Filled in place as float32: an image's 2 + 2 * 1024 rows are 1.2 GB, a list of float64 copies was 2.5 GB more.
    m = len(features)
    rows = np.empty((2 + 2 * m, n), np.float32)
    rows[0], rows[1] = low, high
    labels = [f"every feature at {named[0]}", f"every feature at {named[1]}"]
    for start, value, rest, others in ((2, high, low, named[2]), (2 + m, low, high, named[3])):
        rows[start:start + m] = rest
        rows[start + np.arange(m), features] = value[features]
        labels += [f"feature {j} at {value[j]:g}, the others at {others}" for j in features]
    return rows.reshape(-1, *row_shape), labels


def token_rows(vocab_size: int, context_length: int, outside: bool = False) -> tuple[np.ndarray, list[str]]:
    """A language model's input limits: int32 rows of the longest context, each one token id repeated (a repeated
    id is the most one-sided attention and the largest sums a block sees); with outside, ids no tokenizer makes
    (-1, vocab_size, the int32 extremes), which a client may still send to serving_default."""
    ids = [-2 ** 31, -1, vocab_size, 2 ** 31 - 1] if outside else list(range(vocab_size))
    rows = np.repeat(np.asarray(ids, np.int32)[:, None], context_length, axis=1)
    return rows, [f"id {i} repeated over the {context_length} positions" for i in ids]


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


def _paired_taps(model: keras.Model, twin: keras.Model) -> tuple[list[Tap], list[Tap]]:
    """The model's taps and the twin's, position by position (a rebuilt twin may name auto-named layers anew)."""
    mine, theirs = taps(model), taps(twin)
    if [type(tap.layer) for tap in mine] != [type(tap.layer) for tap in theirs]:
        raise ProbeError("the float32 twin's layers differ from the model's")
    return mine, theirs


def _run_taps(model: keras.Model, tapped: list[Tap], x, extra_outputs=()) -> tuple[list, list]:
    """The tapped values on x (None for a sublayer its layer did not call) and extra_outputs' values: one call
    of a model from model's input to the tapped tensors of its graph, recording the sublayers meanwhile."""
    outer = [tap.tensor for tap in tapped if tap.tensor is not None]
    tap_model = keras.Model(model.inputs, outer + list(extra_outputs))
    with recording([tap.layer for tap in tapped if tap.tensor is None]) as recorded:
        values = keras.tree.flatten(tap_model([x], training=False))
    graph_values = iter(values[:len(outer)])
    found = [next(graph_values) if tap.tensor is not None else recorded.get(id(tap.layer)) for tap in tapped]
    return found, values[len(outer):]


def _compute_dtypes(model: keras.Model, probed: list[Tap], x) -> dict[str, str]:
    """Tap name → the dtype its values are computed in (_compute_dtype), from the model as it computes on one row."""
    values, _ = _run_taps(model, probed, x[:1])
    return {tap.name: _compute_dtype(tap, keras.backend.standardize_dtype(value.dtype) if value is not None else None)
            for tap, value in zip(probed, values)}


def _compute_dtype(tap: Tap, output_dtype: str | None) -> str:
    """A layer's compute dtype; for a nested model or a layer with layers inside, the dtype its output actually has
    (a DecoderBlock declares its policy's float16 but returns the float32 residual stream around its float16 MLP)."""
    if output_dtype and tap.tensor is not None and (isinstance(tap.layer, keras.Model) or layer_paths(tap.layer)):
        return output_dtype
    return tap.layer.compute_dtype
