"""The op-level dtype audit: the numerically sensitive operations of the traced forward pass and loss, and the
dtype each computes in, wherever the code writes them. The layer audit (audit.py) sees layers; a layer's own
call can hold the math the float32 rule is about (docs/precision.md#the-float32-rule): causal_lm's attention
scores, softmax and weighted sum are ops inside its DecoderBlock, not layers of their own (pipeline/lm/causal_lm.py).

    Softmax, LogSoftmax                      probabilities: exp() overflows float16, small ones underflow
    BatchMatMulV2/V3                         a product of two activations: attention scores, the weighted sum
                                             (one with a weight, an EinsumDense's projection, is left out)
    Rsqrt                                    a normalisation's 1 / sqrt(variance + epsilon)
    the model output                         a language model's logits, a classifier's probabilities
    (Sparse)SoftmaxCrossEntropyWithLogits    the loss
    the loss value                           what the optimizer (and loss scaling) reads

One in float16 or bfloat16 is an error naming the layer whose call holds it (the innermost layer whose name
scope the op is in; ops of the loss are '(loss)'), with the fix when a config key covers it.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import tensorflow as tf

from pipeline.diagnose.findings import Finding, OpDtypes
from pipeline.diagnose.graph import producer
from pipeline.models.float32_rule import layer_paths

REDUCED = ("float16", "bfloat16")
ATTENTION = "a product of two activations (attention scores or their weighted sum)"
SENSITIVE_OPS = {
    "Softmax": "softmax", "LogSoftmax": "log-softmax", "BatchMatMulV2": ATTENTION, "BatchMatMulV3": ATTENTION,
    "Rsqrt": "a normalisation's 1/sqrt(variance + epsilon)",
    "SparseSoftmaxCrossEntropyWithLogits": "the cross-entropy", "SoftmaxCrossEntropyWithLogits": "the cross-entropy",
}
LOSS = "(loss)"
BATCHED_PRODUCTS = ("BatchMatMulV2", "BatchMatMulV3")
# What lies between a variable and the op that reads it: an EinsumDense's kernel reaches its BatchMatMul so.
_PASS_THROUGH = ("Cast", "Identity", "Reshape", "Transpose", "ExpandDims", "BroadcastTo")


def audit_ops(model: keras.Model, loss, x: np.ndarray, y: np.ndarray) -> tuple[list[OpDtypes], list[Finding]]:
    """The sensitive ops of model(x) and loss(y, model(x)) traced as one graph (the rows' shapes, any batch), each
    (layer, op, dtype) counted once, in graph order; and an error for each in a reduced dtype."""
    loss_fn = keras.losses.get(loss)
    specs = [tf.TensorSpec([None, *x.shape[1:]], keras.backend.standardize_dtype(
        keras.tree.flatten(model.inputs)[0].dtype)), tf.TensorSpec([None, *y.shape[1:]], tf.as_dtype(y.dtype))]

    def forward(rows, targets):
        prediction = keras.tree.flatten(model(rows, training=False))[0]  # the output the loss reads (probes.py)
        return prediction, loss_fn(targets, prediction)

    concrete = tf.function(forward).get_concrete_function(*specs)
    paths = {id(layer): path for path, layer in layer_paths(model).items()}
    counts: dict[tuple[str, str, str], int] = {}
    for op in concrete.graph.get_operations():
        if op.type in SENSITIVE_OPS and op.outputs and not (op.type in BATCHED_PRODUCTS and _reads_weights(op)):
            key = (_owner(op.name, model, paths), op.type, op.outputs[0].dtype.name)
            counts[key] = counts.get(key, 0) + 1
    prediction, value = concrete.structured_outputs
    counts[(producer(keras.tree.flatten(model.outputs)[0]) or model.name, "model output", prediction.dtype.name)] = 1
    counts[(LOSS, "loss value", value.dtype.name)] = 1
    rows = [OpDtypes(layer, op, count, dtype) for (layer, op, dtype), count in counts.items()]
    findings = [Finding("error", r.layer, _problem(r), _fix(r, model)) for r in rows if r.dtype in REDUCED]
    return rows, findings


def _reads_weights(op) -> bool:
    """A batched product with a weight (a projection, e.g. an EinsumDense's), not of two activations."""
    def from_variable(tensor, depth: int = 0) -> bool:
        source = tensor.op
        if source.type in ("ReadVariableOp", "VarHandleOp", "Const"):
            return True
        return (depth < 8 and source.type in _PASS_THROUGH and bool(source.inputs)
                and from_variable(source.inputs[0], depth + 1))

    return any(from_variable(tensor) for tensor in op.inputs)


def _problem(row: OpDtypes) -> str:
    if row.op == "model output":
        return f"the model's output (what the loss and serving read) is {row.dtype}"
    if row.op == "loss value":
        return f"the loss is computed in {row.dtype}: loss scaling and the optimizer need float32"
    return (f"{row.count} {row.op} op(s), {SENSITIVE_OPS[row.op]}, compute in {row.dtype} inside its call: "
            "the float32 rule keeps them in float32 (docs/precision.md)")


def _fix(row: OpDtypes, model: keras.Model) -> str:
    if row.layer == LOSS or row.layer == model.name:
        return "# compute the loss from float32 outputs, in float32 (models.compile_settings)"
    return (f"# cast to float32 inside {row.layer}'s call before this op, or keep the whole layer in float32:\n"
            f"precision:\n  float32_layers: [{row.layer}]")


def _owner(op_name: str, model: keras.Model, paths: dict[int, str]) -> str:
    """The full path of the innermost layer whose name scope holds the op: Keras opens a scope per layer call,
    suffixed with a counter in the graph ('block_1_1/query_1/MatMul'); a layer's call may call a sublayer's method
    (causal_lm's prefill calls attention.project), so each scope is looked up among all the layers inside the last."""
    scopes = op_name.split("/")[:-1]
    if not scopes or not _matches(model.name, scopes[0]):
        return LOSS
    owner: keras.layers.Layer = model
    for scope in scopes[1:]:
        inside = [layer for layer in layer_paths(owner).values() if _matches(layer.name, scope)]
        if not inside:
            break
        owner = min(inside, key=lambda layer: (layer.name != scope, -len(layer.name)))
    return paths.get(id(owner), model.name)


def _matches(name: str, scope: str) -> bool:
    return re.fullmatch(re.escape(name) + r"(_\d+)*", scope) is not None
