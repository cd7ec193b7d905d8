"""The over-range rule: layers that meet values beyond float16's range on the training rows compute in float32
(pipeline/models/over_range.py), so the user's transactions model trains under mixed_float16 as it is (issue 23)."""

import logging

import keras
import numpy as np
import pytest

from pipeline import models
from pipeline.config import load_config
from pipeline.data import DataSpec, load_datasets
from pipeline.data.statistics import of_rows
from pipeline.models.over_range import keep_over_range_in_float32
from pipeline.precision import apply_policy
from pipeline.train import train

pytestmark = pytest.mark.timeout(300)

SPEC = DataSpec(input_name="features", input_shape=(4,), num_classes=3, label_names=("a", "b", "c"))


def _mlp(x, *overrides):
    cfg = load_config(None, ["model.hidden_units=[8]", "model.normalize=false", *overrides])
    apply_policy(cfg.precision)
    return models.build_model(cfg.model, SPEC, of_rows(x), cfg.precision.float32_layers, cfg.precision.float16_layers)


def test_the_transactions_model_trains_under_mixed_float16_as_it_is(transactions, tmp_path, caplog):
    # Issue 23's target: no precision.float32_layers written by hand. The builder's Rescaling reads amounts up to
    # ~1e7; cast to float16 they were inf, and the model's outputs NaN.
    cfg = transactions.config(tmp_path, "build", "train.epochs=10")
    assert cfg.precision.policy == "mixed_float16" and cfg.precision.float32_layers == []
    with caplog.at_level(logging.INFO, logger="pipeline.models.over_range"):
        run = train(cfg)
    [pinned] = [m for m in caplog.messages if m.startswith("precision: layer")]
    assert pinned.startswith("precision: layer 'amount_scale' meets values up to 1.15e+07 on the training rows, "
                             "beyond float16's maximum 65504: it computes in float32")
    assert run.model.get_layer("amount_scale").compute_dtype == "float32"
    assert run.model.get_layer("amount_proj").compute_dtype == "float16"  # reads rescaled amounts: stays float16
    assert run.metrics["val_accuracy"] >= 0.95, run.metrics  # the last epoch: 0.974 to 0.990 with the order rows come in


def test_a_layer_reading_raw_values_beyond_65504_computes_in_float32():
    x = np.random.default_rng(0).lognormal(np.log(13000), 1.63, (200, 4)).astype(np.float32)
    assert x.max() > 65504
    model = _mlp(x)
    assert model.get_layer("dense_1").compute_dtype == "float32"
    # logits reads dense_1's outputs, which the weights decide: left to the policy (and to model.normalize).
    assert model.get_layer("logits").compute_dtype == "float16"
    # Named in precision.float16_layers, it stays in float16 (and overflows).
    kept = _mlp(x, "precision.float16_layers=[dense_1]")
    assert kept.get_layer("dense_1").compute_dtype == "float16"


def test_values_within_range_change_nothing(caplog):
    cfg = load_config(None)
    apply_policy(cfg.precision)
    datasets = load_datasets(cfg.data, seed=cfg.seed)
    with caplog.at_level(logging.INFO, logger="pipeline.models.over_range"):
        model = models.build_model(cfg.model, datasets.spec, datasets.statistics)
    assert [layer.name for layer in model.layers[1:] if layer.compute_dtype == "float16"] == ["dense_1", "dense_2",
                                                                                               "logits"]
    assert not [m for m in caplog.messages if m.startswith("precision: layer")]
    assert keep_over_range_in_float32(model, datasets.train.x * 1000) == []  # standardised first: still in range


def test_the_weights_take_no_part_so_every_build_decides_alike():
    x = np.full((16, 4), 1e5, np.float32)
    for seed in (0, 1):
        keras.utils.set_random_seed(seed)
        model = _mlp(x, "model.hidden_units=[8, 8]")
        # dense_1 reads the raw rows; dense_2 reads dense_1's output, which the weights decide: not measured.
        assert [model.get_layer(name).compute_dtype for name in ("dense_1", "dense_2")] == ["float32", "float16"]
