"""Column kinds: data.categorical_columns declares id columns, which the standardisation passes unchanged; an
undeclared id column about to be standardised into an Embedding is warned about before training (issue 23: the
transactions model trained silently to val_accuracy 0.55 on standardised merchant ids)."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline import models
from pipeline.models import columns
from pipeline.config import ConfigError, load_config
from pipeline.data import DataError, load_datasets
from pipeline.precision import apply_policy


def _build(cfg):
    apply_policy(cfg.precision)
    datasets = load_datasets(cfg.data, seed=cfg.seed)
    model = models.build_model(cfg.model, datasets.spec, datasets.statistics, cfg.precision.float32_layers,
                               cfg.precision.float16_layers)
    return model, datasets


def test_declared_ids_pass_the_standardisation_unchanged(transactions, tmp_path):
    cfg = transactions.config(tmp_path, "build", "model.normalize=true", "data.categorical_columns=[merchant_*]")
    model, datasets = _build(cfg)
    assert datasets.spec.categorical == tuple(range(16))
    assert datasets.spec.feature_name(0) == "merchant_0" and datasets.spec.feature_name(16) == "amount_0"
    standardized = keras.ops.convert_to_numpy(model.get_layer("standardize")(datasets.sample_x[:64]))
    np.testing.assert_array_equal(standardized[:, :16], datasets.sample_x[:64, :16])  # the ids, exactly
    assert np.abs(standardized[:, 16:]).max() < 100  # the amounts, standardised


def test_undeclared_ids_about_to_be_standardised_into_an_embedding_warn_with_the_fix(transactions, tmp_path, caplog):
    cfg = transactions.config(tmp_path, "build", "model.normalize=true")
    model, datasets = _build(cfg)
    with caplog.at_level(logging.WARNING, logger="pipeline.models.columns"):
        flagged = columns.warn_if_ids_are_standardised(model, datasets.spec, datasets.sample_x)
    assert flagged == list(range(16))  # the amounts are not ids; only the merchants reach the Embedding
    assert caplog.messages == [
        "data: 16 columns (merchant_0, merchant_1, ... merchant_15) hold category ids (0..49) and reach Embedding "
        "'merchant_embedding' standardised by model.normalize, so it looks up standardised values instead of the "
        "ids; declare them, data.categorical_columns: [merchant_*] (docs/configuration.md#column-kinds), or set "
        "model.normalize: false"]
    declared = transactions.config(tmp_path, "build", "model.normalize=true", "data.categorical_columns=[merchant_*]")
    model, datasets = _build(declared)
    assert columns.warn_if_ids_are_standardised(model, datasets.spec, datasets.sample_x) == []


def test_integer_columns_without_an_embedding_are_no_ids():
    cfg = load_config(None)  # digits: integer pixels 0..16, an MLP
    model, datasets = _build(cfg)
    assert columns.undeclared_ids(model, datasets.spec, datasets.sample_x) is None


def test_train_warns_before_training(transactions, tmp_path, caplog):
    from pipeline.train import train

    cfg = transactions.config(tmp_path, "build", "model.normalize=true", "train.epochs=1",
                              "precision.policy=float32")
    with caplog.at_level(logging.WARNING, logger="pipeline.models.columns"):
        train(cfg)
    assert len([m for m in caplog.messages if "data.categorical_columns: [merchant_*]" in m]) == 1


def test_a_value_that_is_no_id_names_the_line_and_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("merchant,amount,label\n3,120.5,0\n7.5,99.0,1\n2,13000,1\n")
    with pytest.raises(DataError, match=r"^data\.path: .*t\.csv line 3, column 'merchant': 7\.5 is not a category id "
                                        r"\(an integer >= 0\), but data\.categorical_columns lists it$"):
        load_datasets(load_config(None, ["data.source=csv", f"data.path={path}",
                                         "data.categorical_columns=[merchant]"]).data, seed=0)
    with pytest.raises(DataError, match=r"data\.categorical_columns: 'shop\*' names no feature of data\.path: .*; its "
                                        r"features are: merchant, amount$"):
        load_datasets(load_config(None, ["data.source=csv", f"data.path={path}",
                                         "data.categorical_columns=['shop*']"]).data, seed=0)


def test_tfrecord_features_and_npz_positions(tmp_path):
    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(str(tmp_path / "t.tfrecord")) as writer:
        for i in range(20):
            feature = {"merchant": tf.train.Feature(int64_list=tf.train.Int64List(value=rng.integers(0, 50, 3))),
                       "amount": tf.train.Feature(float_list=tf.train.FloatList(value=rng.random(3))),
                       "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    spec = load_datasets(load_config(None, [
        "data.source=tfrecord", f"data.path={tmp_path / 't.tfrecord'}", "data.categorical_columns=[merchant]",
        "data.feature_spec={merchant: {dtype: int64, shape: [3]}, amount: {shape: [3]}}"]).data, seed=0).spec
    assert spec.categorical == (0, 1, 2) and spec.feature_names[:4] == ("merchant[0]", "merchant[1]", "merchant[2]",
                                                                        "amount[0]")
    np.savez(tmp_path / "t.npz", x_train=np.c_[rng.integers(0, 9, 30), rng.random(30)], y_train=np.arange(30) % 2)
    spec = load_datasets(load_config(None, ["data.source=npz", f"data.path={tmp_path / 't.npz'}",
                                            "data.categorical_columns=[0]"]).data, seed=0).spec
    assert spec.categorical == (0,)


@pytest.mark.parametrize("overrides, message", [
    (["data.source=csv", "data.path=x.csv", "data.categorical_columns=[3]"],
     r"data\.categorical_columns: data\.source 'csv' takes column names or patterns \(e\.g\. 'merchant_\*'\), got 3"),
    (["data.categorical_columns=[merchant]"],
     r"data\.categorical_columns: data\.source 'digits' takes positions in the flattened row \(0, 1, \.\.\.\), "
     r"got 'merchant'"),
    (["data.categorical_columns=[-1]"],
     r"data\.categorical_columns: expected column names or positions in the row \(integers >= 0\), got -1"),
    (["data.categorical_columns=[0]", "data.image_shape=[8, 8, 1]"],
     r"data\.categorical_columns: not for image rows \(data\.image_shape\)"),
])
def test_bad_categorical_columns_are_one_config_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(None, overrides)
    assert len(str(refused.value).splitlines()) == 1
