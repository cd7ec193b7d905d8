"""What the built-in kinds do to their raw float32 input inside the model: the standardisation and the image reshape.

The model takes raw features (the export serves the rows a client has), so the training rows' statistics are
baked into a Normalization layer. Each divisor is floored (standardization_divisors), so that a feature that
barely varied in training cannot scale a legal input past float16's range.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
from keras import layers

from pipeline.data import DataSpec, Statistics
from pipeline.errors import ModelError
from pipeline.models.nonfinite import FLOAT16_SMALLEST_NORMAL

# A feature's standardisation divisor is at least this share of its largest training magnitude, so a legal
# value of a feature that barely varied in training is amplified at most ~2/STD_FLOOR_SHARE, not by 1e7.
STD_FLOOR_SHARE = 0.01


def standardization_divisors(std: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per feature (or channel), what the standardisation divides by: the training standard deviation, floored at
    STD_FLOOR_SHARE of the feature's largest training magnitude (scale) and at float16's smallest normal number;
    1 for a feature that was always 0 (it is only centred). Keras' own floor, 1e-7, turns a legal value of a pixel
    that was always 0 in training into ~1e8, which overflows the float16 layer that reads it (issue #14)."""
    divisors = np.maximum(std, np.maximum(STD_FLOOR_SHARE * scale, FLOAT16_SMALLEST_NORMAL))
    return np.where(scale == 0, 1.0, divisors)


def standardize(x, statistics: Statistics, dtype: str | None = "float32", name: str = "standardize",
                categorical: Sequence[int] = ()) -> keras.KerasTensor:
    """Per last axis of x (features, or an image's channels): the training mean and the floored standard deviation,
    from the statistics pass (float64, computed once per run: docs/data.md#statistics). The layer computes in
    float32 unless float16_layers names it. Category ids (data.categorical_columns) pass unchanged: mean 0,
    variance 1."""
    mean, variance, largest = statistics.standardization(x.shape[-1])
    mean = mean.astype(np.float32)
    variance = np.square(standardization_divisors(np.sqrt(variance), largest)).astype(np.float32)
    mean[list(categorical)], variance[list(categorical)] = 0.0, 1.0
    standardize = layers.Normalization(axis=-1, name=name, dtype=dtype)
    standardize.build(x.shape)  # its mean and variance weights, as adapt() would leave them
    standardize.adapt_mean.assign(mean)
    standardize.adapt_variance.assign(variance)
    standardize.count.assign(statistics.value_rows)
    standardize.finalize_state()
    return standardize(x)


def as_images(inputs, spec: DataSpec, kind: str):
    """The rows as [height, width, channels] images (a float32 reshape: the raw values stay exact)."""
    if len(spec.input_shape) == 3:
        return inputs
    if spec.image_shape is None:
        raise ModelError(f"model.kind '{kind}' needs image-shaped rows, but the rows are {list(spec.input_shape)} "
                         "features; set data.image_shape: [height, width, channels]")
    return layers.Reshape(spec.image_shape, name="to_image", dtype="float32")(inputs)
