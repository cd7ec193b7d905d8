"""The dtype audit (no training needed): every layer's policy, compute and variable dtype, at any depth and named
by its full path (a MultiHeadAttention's sublayers as 'block_1_attention/query'; models.layer_paths), and
findings, each with the fix as YAML to paste into the experiment file:
  error    a model output, or a softmax/sigmoid (the layer the loss reads, or attention's), computing in float16
           or bfloat16: probabilities lose precision or overflow, and serving would return float16.
  warning  a normalization layer computing in float16 (means and variances need float32's range).
  warning  attention's query or key projection, or an embedding, computing in float16 (models.sensitive_layers:
           query·key logits overflow, a token's summed gradient overflows).
  warning  under float16 compute, Dense units / Conv filters / input features or the batch size
           not a multiple of 8: Tensor Cores need multiples of 8 (NVIDIA's mixed-precision guide). Only on a
           machine with an NVIDIA GPU that has them: a CPU gets no alignment advice (issue 23: on a CPU it
           suggested float32_layers for a layer that reads 1 feature).
"""

from __future__ import annotations

import keras
from keras import layers

from pipeline import precision
from pipeline.config import Config
from pipeline.diagnose.graph import producer
from pipeline.diagnose.findings import Finding, LayerDtypes
from pipeline.models.float32_rule import NORMALIZATION_LAYERS as NORMALIZATION, PROBABILITY_ACTIVATIONS, layer_paths, sensitive_layers


REDUCED = ("float16", "bfloat16")


def audit_model(model: keras.Model, cfg: Config) -> tuple[list[LayerDtypes], list[Finding]]:
    """Every layer's dtypes, and the findings of the dtype audit (module docstring)."""
    dtypes, findings = [], []
    tensor_cores = has_tensor_cores(precision.detect_hardware())
    outputs = {producer(t) for t in keras.tree.flatten(model.outputs)}
    sensitive = sensitive_layers(model)
    for path, layer in layer_paths(model).items():
        if isinstance(layer, keras.Model):  # a nested model computes in its layers' dtypes, listed by path
            continue
        dtypes.append(LayerDtypes(path, type(layer).__name__, layer.dtype_policy.name, layer.compute_dtype,
                                  layer.variable_dtype))
        findings += _dtype_findings(layer, path, path in outputs, sensitive.get(path))
        findings += _tensor_core_findings(layer, cfg) if tensor_cores else []
    findings += _batch_size_findings(model, cfg) if tensor_cores else []
    return dtypes, findings


def has_tensor_cores(hardware: precision.Hardware) -> bool:
    """An NVIDIA GPU of compute capability 7.0 or more (or one whose capability TensorFlow does not report)."""
    return any(capability is None or tuple(capability) >= (7, 0) for _, capability in hardware.gpus)


def _dtype_findings(layer, path: str, is_output: bool, sensitive: str | None) -> list[Finding]:
    if layer.compute_dtype not in REDUCED:
        return []
    fix = f"precision:\n  float32_layers: [{path}]"
    activation = _activation_name(layer)
    if is_output:
        return [Finding("error", path, f"model output computed in {layer.compute_dtype} (serving returns it as "
                                       f"{layer.compute_dtype}; the loss reads rounded values)", fix)]
    if isinstance(layer, layers.Softmax) or activation in PROBABILITY_ACTIVATIONS:
        return [Finding("error", path, f"{activation or 'softmax'} computed in {layer.compute_dtype}: "
                                       "exp() overflows float16 and small probabilities underflow", fix)]
    if isinstance(layer, NORMALIZATION):
        return [Finding("warning", path, f"{type(layer).__name__} computes in {layer.compute_dtype}; "
                                         "means and variances need float32's range and precision", fix)]
    if sensitive:
        return [Finding("warning", path, f"computes in {layer.compute_dtype}: {sensitive}", fix)]
    return []


def _tensor_core_findings(layer, cfg: Config) -> list[Finding]:
    """Units/filters and input features of float16 Dense/Conv layers that are not multiples of 8."""
    if layer.compute_dtype != "float16" or not isinstance(layer, (layers.Dense, layers.Conv1D, layers.Conv2D,
                                                                   layers.Conv3D)):
        return []
    findings = []
    width = layer.units if isinstance(layer, layers.Dense) else layer.filters
    what = "units" if isinstance(layer, layers.Dense) else "filters"
    if width % 8 and layer.name not in ("logits", "head"):  # the head's width is the task's, not a choice
        findings.append(Finding("warning", layer.name, f"{what} {width} is not a multiple of 8 (Tensor Cores)",
                                _size_fix(layer.name, cfg)))
    kernel = getattr(layer, "kernel", None)
    features = int(kernel.shape[-2]) if kernel is not None else None
    if features and features % 8:
        findings.append(Finding("warning", layer.name, f"{features} input features are not a multiple of 8 "
                                                       "(Tensor Cores)",
                                _features_fix(layer.name, features, cfg)))
    return findings


def _size_fix(name: str, cfg: Config) -> str:
    m = cfg.model
    if name.startswith("dense_") and m.hidden_units:
        return f"model:\n  hidden_units: {_rounded(m.hidden_units)}"
    if name.startswith("conv_") and m.kind == "cnn":
        return f"model:\n  filters: {_rounded(m.filters)}"
    return f"# {name}: round its size up to a multiple of 8 in the model's builder (model.params)"


def _features_fix(name: str, features: int, cfg: Config) -> str:
    m = cfg.model
    index = int(name.split("_")[-1]) if name.startswith("dense_") and name.split("_")[-1].isdigit() else 0
    if index > 1 and m.hidden_units:  # fed by the previous hidden layer
        return f"model:\n  hidden_units: {_rounded(m.hidden_units)}"
    if name.startswith("conv_") and index > 1 and m.kind == "cnn":
        return f"model:\n  filters: {_rounded(m.filters)}"
    padded = -(-features // 8) * 8
    return (f"# {name} reads {features} features from the data: pad each row to {padded} "
            f"(e.g. {padded - features} zero columns), or keep this layer in float32:\n"
            f"precision:\n  float32_layers: [{name}]")


def _batch_size_findings(model: keras.Model, cfg: Config) -> list[Finding]:
    if cfg.train.batch_size % 8 == 0 or not any(layer.compute_dtype == "float16" for layer in layer_paths(model).values()):
        return []
    return [Finding("warning", "(batch)", f"train.batch_size {cfg.train.batch_size} is not a multiple of 8 "
                                          "(Tensor Cores)",
                    f"train:\n  batch_size: {-(-cfg.train.batch_size // 8) * 8}")]



def _activation_name(layer) -> str | None:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) if activation is not None else None


def _rounded(sizes: list[int]) -> list[int]:
    return [-(-size // 8) * 8 for size in sizes]
