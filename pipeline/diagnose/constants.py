"""Constants that do not fit the dtype they compute in; no data needed, so `verify` runs it too. Each is an error:
  an epsilon below the smallest normal number of its layer's reduced compute dtype (float16: 6.1e-5): it becomes
  subnormal or zero there, and the division it guards can overflow;
  a standardisation (Normalization) divisor below the smallest normal number of the dtype its output is read in:
  Keras floors a variance of 0 at 1e-7, and a float16 layer reading that feature overflows as soon as a value
  differs from the training mean by 65504 * 1e-7 = 0.0066 (issue #14: NaN for every class).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

from pipeline.diagnose.findings import Finding
from pipeline.diagnose.graph import readers
from pipeline.diagnose.thresholds import LARGEST_FINITE, SMALLEST_NORMAL
from pipeline.models.float32_rule import layer_paths

KERAS_NORMALIZATION_FLOOR = 1e-7  # keras.backend.epsilon(): Normalization divides by max(sqrt(variance), this)


def constant_findings(model: keras.Model) -> list[Finding]:
    """The findings of the module docstring, one per layer."""
    read_by = readers(model)
    paths = layer_paths(model)
    model_dtype = _narrowest([layer.compute_dtype for layer in paths.values()])
    findings = []
    for path, layer in paths.items():
        epsilon = getattr(layer, "epsilon", None)
        floor = SMALLEST_NORMAL.get(layer.compute_dtype, 0.0)
        if isinstance(epsilon, (int, float)) and 0 < epsilon < floor:
            findings.append(Finding("error", path, f"epsilon {epsilon:g} is below {layer.compute_dtype}'s smallest "
                                                   f"normal number {floor:.2g}: it becomes subnormal or 0 there",
                                    f"precision:\n  float32_layers: [{path}]"))
        if isinstance(layer, layers.Normalization) and not layer.invert and layer.built:
            finding = _divisor_finding(layer, read_by.get(layer.name), model_dtype)
            if finding:
                findings.append(finding)
    return findings


def _divisor_finding(layer: layers.Normalization, reading: list | None, model_dtype: str) -> Finding | None:
    variance = np.asarray(keras.ops.convert_to_numpy(layer.variance), np.float64).ravel()
    divisors = np.maximum(np.sqrt(variance), KERAS_NORMALIZATION_FLOOR)
    # Read in its own dtype and its readers'; inside a subclassed model the readers are unknown: any layer's.
    dtypes = [layer.compute_dtype] + ([r.compute_dtype for r in reading] if reading is not None else [model_dtype])
    dtype = _narrowest(dtypes)
    floor = SMALLEST_NORMAL.get(dtype, 0.0)
    small = np.flatnonzero(divisors < floor)
    if not len(small):
        return None
    where = [r.name for r in reading if r.compute_dtype == dtype] if reading else []
    read = f"read by {', '.join(where)} in {dtype}" if where else f"read in {dtype}"
    problem = (f"divides {len(small)} feature(s) (e.g. feature {small[0]}) by {divisors[small[0]]:.2g}, below {dtype}'s "
               f"smallest normal number {floor:.2g} ({read}): a value {LARGEST_FINITE[dtype] * divisors[small[0]]:.2g} "
               "from the training mean already overflows")
    if layer.name == "standardize" or layer.name.startswith("pipeline_standardize"):
        fix = ("# the model predates the pipeline's standardisation floors: retrain it from scratch\n"
               "# (python -m pipeline train CONFIG --fresh; docs/precision.md#numerically-safe-by-default)")
    else:
        fix = (f"# floor {layer.name}'s variance in the model builder, e.g. at (0.01 * the feature's largest "
               "training value) ** 2, as the pipeline's standardisation does (docs/precision.md#numerically-safe-by-default)")
    return Finding("error", layer.name, problem, fix)


def _narrowest(dtypes: list[str]) -> str:
    """The dtype with the largest smallest-normal number (float16 before bfloat16 and float32)."""
    known = [d for d in dtypes if d in SMALLEST_NORMAL] or ["float32"]
    return max(known, key=lambda d: SMALLEST_NORMAL[d])
