"""Exportable or refused early (pipeline/models/exportable.py): a builder's model that could not be loaded back from
model.keras is refused when it is built, before any training (issue 23: the Lambda variant trained, then the export
was a 40-line traceback)."""

import pytest

from pipeline import cli
from pipeline.errors import ModelError
from pipeline.train import train

UNREGISTERED = '''
import keras
from keras import layers


class Doubled(layers.Layer):
    def call(self, x):
        return x * 2


def halves(x):
    return x / 2


def _head(x, num_classes):
    return layers.Dense(num_classes, activation="softmax", dtype="float32")(layers.Dense(8)(x))


def custom_layer(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, _head(Doubled()(inputs), num_classes))


def named_function(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, _head(layers.Lambda(halves, name="halve")(inputs), num_classes))
'''


def test_a_lambda_of_a_python_lambda_is_refused_before_training(transactions, tmp_path, capsys):
    code = cli.main(["train", "configs/default.yaml", *(f"--set={o}" for o in transactions.overrides(
        tmp_path, "build_lambda"))])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == (
        "error: model.builder 'tests_transactions:build_lambda': layers 'amounts', 'ids' are each a keras.layers.Lambda "
        "of a Python lambda, which Keras will not load back from model.keras (safe mode), so the trained model could "
        "not be exported; write the operation on the tensor instead (e.g. x[:, :16], keras.ops.log1p(x)), use a Keras "
        "layer, or a function or layer class decorated with @keras.saving.register_keras_serializable()")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("builder, message", [
    ("custom_layer", "class 'Doubled' cannot be loaded back from model.keras (Keras finds only registered classes "
                     "there), so the trained model could not be exported; decorate it with "
                     "@keras.saving.register_keras_serializable() and give it get_config() for its arguments"),
    ("named_function", "function 'halves' cannot be loaded back from model.keras (Keras finds only registered "
                       "functions there), so the trained model could not be exported; decorate it with "
                       "@keras.saving.register_keras_serializable()"),
])
def test_unregistered_classes_and_functions_are_refused_before_training(builder_module, tmp_path, builder, message):
    from pipeline.config import load_config

    builder_module("tests_unregistered", UNREGISTERED)
    cfg = load_config(None, ["model.kind=custom", f"model.builder=tests_unregistered:{builder}",
                             f"train.runs_dir={tmp_path}"])
    with pytest.raises(ModelError) as refused:
        train(cfg)
    assert str(refused.value) == f"model.builder 'tests_unregistered:{builder}': {message}"
    assert not any(tmp_path.iterdir())
