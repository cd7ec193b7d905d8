"""Exportable or refused early: a builder's model must come back from model.keras before it is trained.

Training saves the model as model.keras and export reads it back with keras.saving.load_model in safe mode
(models.load_trained_model). A layer Keras cannot rebuild from that file (a Lambda of a Python lambda, a
custom layer or function that is not registered) used to cost the whole training and then a 40-line
traceback at export (issue 23). The round trip of the model's config, what load_model does before it reads
the weights, finds the same failures in milliseconds at build time.
"""

from __future__ import annotations

import re

import keras
from keras import layers

from pipeline.errors import ModelError

_LAMBDA_FIX = ("write the operation on the tensor instead (e.g. x[:, :16], keras.ops.log1p(x)), use a Keras layer, or "
               "a function or layer class decorated with @keras.saving.register_keras_serializable()")


def check_exportable(model: keras.Model, builder: str) -> None:
    """Raises ModelError, in one line naming the layer and the fix, when model.keras could not be loaded back."""
    lambdas = [layer.name for layer in model._flatten_layers(include_self=False)
               if isinstance(layer, layers.Lambda) and getattr(layer.function, "__name__", "") == "<lambda>"]
    if lambdas:
        raise ModelError(f"model.builder {builder!r}: {_names('layer', lambdas)} a keras.layers.Lambda of a Python "
                         "lambda, which Keras will not load back from model.keras (safe mode), so the trained model "
                         f"could not be exported; {_LAMBDA_FIX}")
    try:
        keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model), safe_mode=True)
    except Exception as error:  # noqa: BLE001 - whatever stops the rebuild would stop the export
        problem, fix = _reason(error)
        raise ModelError(f"model.builder {builder!r}: {problem}, so the trained model could not be exported; "
                         f"{fix}") from None


def _names(noun: str, names: list[str]) -> str:
    return f"{noun} {names[0]!r} is" if len(names) == 1 else f"{noun}s {', '.join(map(repr, names))} are each"


def _reason(error: Exception) -> tuple[str, str]:
    """(what cannot be loaded, the fix), from the innermost cause in Keras' nested message."""
    message = str(error)
    missing = re.search(r"Could not locate (class|function) '([^']+)'", message)
    if missing:
        kind, name = missing.groups()
        plural = "classes" if kind == "class" else "functions"
        return (f"{kind} {name!r} cannot be loaded back from model.keras (Keras finds only registered {plural} there)",
                "decorate it with @keras.saving.register_keras_serializable()"
                + (" and give it get_config() for its arguments" if kind == "class" else ""))
    inner = message.split("Exception encountered: ")[-1].strip().splitlines()[0]
    return (f"the model cannot be loaded back from model.keras ({type(error).__name__}: {inner[:300]})",
            "give custom layers get_config() and register them with @keras.saving.register_keras_serializable()")
