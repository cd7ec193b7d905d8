"""model.kind custom: the user's own Keras model (`model.builder: "module:function"`), behind the pipeline's raw
float32 input and standardisation, held to the float32 rule and checked on training rows before it trains."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence

import keras
import numpy as np

from pipeline.config import ModelConfig
from pipeline.data import DataSpec, Statistics
from pipeline.errors import ModelError
from pipeline.models import exportable, float32_rule, nonfinite, over_range, preprocessing


def import_builder(builder: str) -> Callable:
    """The function model.builder names ("module:function"), imported (its module may register layers that
    model.keras needs); a module that does not import, or has no such function, is one ModelError line."""
    module_name, _, function_name = builder.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module, reported in one line
        raise ModelError(f"model.builder: cannot import module {module_name!r} of {builder!r}: "
                         f"{type(e).__name__}: {e} (it must be importable from the working directory or PYTHONPATH)") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelError(f"model.builder: module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
                         f"{function_name!r}")
    return function


def build_custom(config: ModelConfig, spec: DataSpec, statistics: Statistics, float32_layers: Sequence[str],
                 float16_layers: Sequence[str], checks: bool = True) -> keras.Model:
    """The user's model, called as builder(input_shape=..., num_classes=..., **model.params) under the
    current policy, behind the pipeline's raw float32 input and standardisation, with its numerically
    sensitive layers and float32_layers computing in float32."""
    function = import_builder(config.builder)
    kwargs = {"input_shape": spec.input_shape, "num_classes": spec.num_outputs, **config.params}
    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as e:
        raise ModelError(f"model.builder {config.builder!r} cannot be called with input_shape, num_classes and "
                         f"model.params {sorted(config.params)}: {e}") from None
    user = function(**kwargs)
    if not isinstance(user, keras.Model):
        raise ModelError(f"model.builder {config.builder!r} returned {type(user).__name__}, not a keras.Model")
    n_inputs, n_outputs = _count_tensors(user, "inputs"), _count_tensors(user, "outputs")
    if n_inputs > 1 or n_outputs > 1:
        raise ModelError(f"model.builder {config.builder!r}: the pipeline feeds one input and serves one output; "
                         f"the model has {n_inputs} inputs and {n_outputs} outputs")
    float32_rule.apply_precision_rules(user, float32_layers, float16_layers)

    # The builder may use any names, the pipeline's own included: ours give way (the signature's input name
    # is spec.input_name whatever the Keras input layer is called).
    taken = {layer.name for layer in float32_rule.layer_paths(user).values()}
    inputs = keras.Input(shape=spec.input_shape, name=_free_name(spec.input_name, taken), dtype="float32")
    x = inputs
    if config.normalize and not spec.tokens:  # token ids are categories: the builder gets them as they are
        name = _free_name("standardize", taken)
        x = preprocessing.standardize(inputs, statistics, float32_rule.sensitive_dtype_for(float16_layers)(name), name=name,
                         categorical=spec.categorical)
    try:
        outputs = _call_inlined(user, inputs, x)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - a shape the user's model cannot take
        raise ModelError(f"model.builder {config.builder!r}: the model cannot take inputs of shape "
                         f"{list(spec.input_shape)}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    model = keras.Model(inputs, outputs, name=user.name)
    over_range.keep_over_range_in_float32(model, statistics.sample_x, float16_layers, statistics.largest_magnitude())
    _check_custom_output(model, config.builder, spec, statistics.sample_x if checks else None, float32_layers,
                         float16_layers)
    _check_follows_policy(model, config.builder)
    if checks:
        exportable.check_exportable(model, config.builder)
    return model


def _free_name(name: str, taken: set[str]) -> str:
    """name, or the first of pipeline_name, pipeline_name_2, ... that the user's model does not use."""
    candidates = [name, f"pipeline_{name}"] + [f"pipeline_{name}_{i}" for i in range(2, len(taken) + 3)]
    return next(candidate for candidate in candidates if candidate not in taken)


def _count_tensors(model: keras.Model, attr: str) -> int:
    """len(model.inputs/outputs); 1 for a subclassed or unbuilt model, which has none until called."""
    try:
        return len(keras.tree.flatten(getattr(model, attr)))
    except (AttributeError, ValueError):
        return 1


def _call_inlined(user: keras.Model, inputs, x):
    """Applies the user's layers to x inside the pipeline's graph, so they appear (and can be found by
    name) in the pipeline's model, sharing their weights. A subclassed model cannot be taken apart and is
    called as one layer."""
    if isinstance(user, keras.Sequential):
        for layer in user.layers:
            if isinstance(layer, keras.Model):  # a fresh graph for a nested model: see clone_model below
                layer = keras.models.clone_model(layer, clone_function=lambda inner: inner, recursive=True)
            x = layer(x)
        return x

    def call_function(layer, *args, **kwargs):  # feeds the standardized tensor where the raw input went
        return layer(*keras.tree.map_structure(lambda t: x if t is inputs else t, args), **kwargs)

    try:
        # recursive: nested models get graphs of their own layers anew, so their outputs take the dtypes
        # apply_precision_rules set (called as one layer, a model reuses its old output dtype: docs/keras3-mixed-precision.md §8).
        inlined = keras.models.clone_model(user, input_tensors=inputs, clone_function=lambda layer: layer,
                                           call_function=call_function, recursive=True)
    except ValueError as e:
        if "only supported" not in str(e):
            raise
        return user(x)
    return inlined.output


def _check_custom_output(model: keras.Model, builder: str, spec: DataSpec, sample_x: np.ndarray | None,
                         float32_layers: Sequence[str] = (), float16_layers: Sequence[str] = ()) -> None:
    """The output has the task's width and, on training rows (unless sample_x is None), is finite and, for
    classification, holds probabilities (a softmax); a non-finite output names the layer that made it."""
    width = model.output.shape[-1] if len(model.output.shape) > 1 else 1
    if width != spec.num_outputs or len(model.output.shape) > 2:
        what = f"{spec.num_classes} class probabilities" if spec.task == "classification" else "1 prediction"
        raise ModelError(f"model.builder {builder!r}: the model's output has shape {list(model.output.shape)}; "
                         f"the task needs [batch, {spec.num_outputs}] ({what} per row)")
    float32_rule.check_float32_outputs(model)
    if sample_x is None:
        return
    rows = nonfinite.probe_rows(sample_x)
    scores = keras.ops.convert_to_numpy(model(rows, training=False))
    if not np.all(np.isfinite(scores)):
        found = nonfinite.first_nonfinite(model, rows)
        cause = (nonfinite.describe(found, keras.config.dtype_policy().name, float32_layers, float16_layers)
                 if found else "set precision.check_numerics: true to find the op")
        raise ModelError(f"model.builder {builder!r}: the model's outputs are inf or NaN on training rows: {cause}")
    if spec.task == "classification":
        if not (np.all(scores >= 0) and np.allclose(scores.sum(axis=-1), 1.0, atol=1e-3)):
            raise ModelError(f"model.builder {builder!r}: for classification the model must output class probabilities "
                             "(end with keras.layers.Activation('softmax', dtype='float32')); its outputs do not sum to 1")


def _check_follows_policy(model: keras.Model, builder: str) -> None:
    """At least one layer with a kernel computes in the policy's compute dtype; otherwise the builder
    fixed every dtype itself, and the export would contradict the policy it records."""
    compute_dtype = keras.config.dtype_policy().compute_dtype
    kernels = [layer for layer in float32_rule.layer_paths(model).values() if getattr(layer, "kernel", None) is not None]
    if kernels and compute_dtype != "float32" and not any(layer.compute_dtype == compute_dtype for layer in kernels):
        policy = keras.config.dtype_policy().name
        if all(float32_rule.numerically_sensitive(layer) for layer in kernels):
            raise ModelError(f"model.builder {builder!r}: no layer computes in {compute_dtype}, the compute dtype of "
                             f"policy {policy}: its only layers with weights ({', '.join(l.name for l in kernels)}) are "
                             "numerically sensitive and compute in float32; train it under precision.policy float32")
        raise ModelError(f"model.builder {builder!r}: no layer computes in {compute_dtype}, the compute dtype of policy "
                         f"{policy}; build layers without a dtype so they follow the policy "
                         "(use precision.float32_layers for the ones that must stay float32)")
