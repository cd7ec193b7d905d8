"""model.kind mlp: the mixed-precision guide's model."""

from __future__ import annotations

from keras import layers

from pipeline.config import ModelConfig
from pipeline.data import DataSpec, Statistics
from pipeline.models import preprocessing


def body(inputs, config: ModelConfig, spec: DataSpec, statistics: Statistics, dtype, sensitive):
    """The mixed-precision guide's MLP: [standardize] → (Dense+ReLU)×N; images are flattened first."""
    x = inputs
    if len(spec.input_shape) > 1:
        x = layers.Flatten(name="flatten", dtype="float32")(x)  # a reshape: keep the raw values exact
    if config.normalize:
        x = preprocessing.standardize(x, statistics, sensitive("standardize"), categorical=spec.categorical)
    for i, units in enumerate(config.hidden_units, start=1):
        x = layers.Dense(units, activation="relu", name=f"dense_{i}", dtype=dtype(f"dense_{i}"))(x)
    return x
