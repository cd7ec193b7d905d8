"""model.kind cnn: the mixed-precision articles' convolutional network."""

from __future__ import annotations

from keras import layers

from pipeline.config import ModelConfig
from pipeline.data import DataSpec, Statistics
from pipeline.errors import ModelError
from pipeline.models import preprocessing


def body(inputs, config: ModelConfig, spec: DataSpec, statistics: Statistics, dtype, sensitive):
    """The mixed-precision articles' CNN: [standardize per channel] → (Conv 3×3+ReLU → MaxPool 2×2)×N
    → Flatten → (Dense+ReLU)×M. 'same' padding, so small images (digits' 8×8) keep a spatial extent."""
    x = preprocessing.as_images(inputs, spec, config.kind)
    if spec.categorical:
        raise ModelError("data.categorical_columns: model.kind 'cnn' reads images, standardised per channel; "
                         "category ids need model.kind 'mlp' or 'custom'")
    if config.normalize:
        x = preprocessing.standardize(x, statistics, sensitive("standardize"))
    for i, filters in enumerate(config.filters, start=1):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv_{i}", dtype=dtype(f"conv_{i}"))(x)
        x = layers.MaxPooling2D(2, padding="same", name=f"pool_{i}", dtype=dtype(f"pool_{i}"))(x)
    x = layers.Flatten(name="flatten", dtype=dtype("flatten"))(x)
    for i, units in enumerate(config.hidden_units, start=1):
        x = layers.Dense(units, activation="relu", name=f"dense_{i}", dtype=dtype(f"dense_{i}"))(x)
    return x
