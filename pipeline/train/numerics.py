"""Turns a precision.check_numerics failure into one line naming the op and Keras layer that made inf/NaN.

Under tf.debugging.enable_check_numerics the first inf/NaN op fails with an InvalidArgumentError whose
message names the op's graph node but not the layer, and runs over many lines; loops.run catches it and
raises TrainingError(describe_nonfinite_op(...)) instead, with the fix that goes with it.
"""

from __future__ import annotations

import re

import keras


def describe_nonfinite_op(error: Exception, model: keras.Model) -> str | None:
    """One line naming the first op and Keras layer that produced inf/NaN under tf.debugging.enable_check_numerics,
    or None when the error is not a numerics check's."""
    message = str(error)
    if "Detected Infinity or NaN" not in message:
        return None
    op_type = re.search(r'graph op "([^"]+)"', message) or re.search(r'eagerly-executing op "([^"]+)"', message)
    node = re.search(r"\{\{node ([^}]+?)(?:/CheckNumericsV2)?\}\}", message)
    kind = re.search(r"Tensor had ([^\n]+?) values", message)
    op_name = node.group(1) if node else "unknown"
    layer = layer_of_op(op_name, model)
    return (f"precision.check_numerics: the first {kind.group(1) if kind else 'inf/NaN'} value came from op "
            f"'{op_name}' ({op_type.group(1) if op_type else 'unknown type'}) in "
            f"{'the gradient of ' if op_name.startswith('gradient_tape/') else ''}layer "
            f"'{layer or 'unknown'}'; compute that layer in float32 (precision.float32_layers: [{layer or '...'}]), "
            "normalize its inputs, or train under precision.policy mixed_bfloat16")


def layer_of_op(op_name: str, model: keras.Model) -> str | None:
    """The model's layer an op belongs to, from its name scope: 'functional_1/boom_1/mul' → 'boom'.

    Graph name scopes are made unique with a _N suffix, so a scope matches a layer name exactly or without it;
    the innermost match wins (a nested model's layer rather than the model)."""
    names = {layer.name for layer in model._flatten_layers(include_self=False)}
    found = None
    for part in op_name.split("/"):
        if part in names:
            found = part
        elif re.sub(r"_\d+$", "", part) in names:
            found = re.sub(r"_\d+$", "", part)
    return found
