"""diagnose and verify on models users bring (issue #14 point 2): custom builders whose names collide with the
pipeline's own, nested and subclassed models, and models a probe cannot run on (one line says which and why)."""


import keras
import numpy as np
import pytest
from keras import layers

from pipeline import cli
from pipeline.config import load_config
from pipeline.diagnose import diagnose
from pipeline.diagnose.graph import ProbeError
from pipeline.diagnose.probes import locate_divergence, probe_ranges
from pipeline.verify import verify

pytestmark = pytest.mark.timeout(300)

BUILDERS = '''
import itertools

import keras
from keras import layers


def named_like_the_pipeline(input_shape, num_classes):
    """The input is called 'features' and layers take the pipeline's own names, the standardisation's included."""
    inputs = keras.Input(input_shape, name="features")
    x = layers.Dense(16, activation="relu", name="standardize")(inputs)
    x = layers.Dense(16, activation="relu", name="dense_1")(x)
    logits = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, layers.Activation("softmax", dtype="float32", name="probabilities")(logits))


def nested(input_shape, num_classes):
    block = keras.Sequential([layers.Dense(16, activation="relu", name="inner"),
                              layers.LayerNormalization(name="inner_norm")], name="block")
    head = keras.Sequential([layers.Dense(num_classes, activation="softmax", name="scores")], name="head")
    inputs = keras.Input(input_shape, name="features")
    return keras.Model(inputs, head(block(inputs)), name="nested")


class Net(keras.Model):
    def __init__(self, num_classes, depth=1):
        super().__init__(name="net")
        self.hidden = [layers.Dense(16, activation="relu", name=f"hidden_{i}") for i in range(depth)]
        self.out = layers.Dense(num_classes, activation="softmax", dtype="float32", name="probs")

    def call(self, x):
        for layer in self.hidden:
            x = layer(x)
        return self.out(x)


def subclassed(input_shape, num_classes):
    return Net(num_classes)


_calls = itertools.count(1)


def different_each_call(input_shape, num_classes):
    """One more hidden layer on every call: the float32 twin cannot be rebuilt with this model's weights."""
    return Net(num_classes, depth=next(_calls))
'''


@pytest.fixture(scope="module", autouse=True)
def builders_module(builder_module):
    """tests_foreign_builders.py, importable as model.builder 'tests_foreign_builders:<function>'."""
    builder_module("tests_foreign_builders", BUILDERS)


def custom(tmp_path, builder, *overrides):
    return load_config(None, ["model.kind=custom", f"model.builder=tests_foreign_builders:{builder}",
                              f"train.runs_dir={tmp_path / 'runs'}", f"export.base_path={tmp_path / 'models'}",
                              "train.batch_size=64", *overrides])


def test_a_builder_using_the_pipelines_names_is_trained_exported_verified_and_diagnosed(tmp_path, capsys):
    # Regression: 'The name "features" is used 2 times in the model' from the divergence locator.
    from pipeline.export import export
    from pipeline.train import train

    cfg = custom(tmp_path, "named_like_the_pipeline", "train.epochs=1")
    untrained = diagnose(cfg, probe_batches=1)
    assert untrained.skipped == [] and untrained.divergence and untrained.edge["nonfinite"] == 0
    run = train(cfg)
    assert [layer.name for layer in run.model.layers][:3] == ["features", "pipeline_standardize", "standardize"]
    version_dir = export(cfg)
    keras.config.set_dtype_policy("float32")
    report = verify(version_dir)
    assert report.ok, report.text()
    assert {c.name for c in report.checks} >= {"parity", "constants", "input limits"}

    trained = diagnose(cfg, probe_batches=1)
    assert trained.source.endswith("model.keras") and trained.skipped == []
    assert [d.layer for d in trained.divergence] == ["pipeline_standardize", "standardize", "dense_1", "logits",
                                                     "probabilities"]
    assert cli.main(["diagnose", str(_write(tmp_path, cfg)), "--batches", "1"]) == 0
    assert "SKIPPED" not in capsys.readouterr().out


def _write(tmp_path, cfg):
    import yaml

    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def test_nested_and_subclassed_models_are_probed(tmp_path):
    nested = diagnose(custom(tmp_path, "nested"), probe_batches=1)
    assert nested.skipped == []
    taps = {r.layer: r.compute_dtype for r in nested.ranges}
    assert taps == {"standardize": "float32", "block": "float32", "head": "float32"}  # their last layers' dtypes
    assert {d.name: d.compute_dtype for d in nested.layers}["block/inner"] == "float16"  # inner layers, by full path
    assert {d.name: d.compute_dtype for d in nested.layers}["head/scores"] == "float32"  # a softmax: pinned

    subclassed = diagnose(custom(tmp_path, "subclassed"), probe_batches=1)
    assert subclassed.skipped == []  # its twin is the model rebuilt under float32: it has no layer configs
    assert {r.layer for r in subclassed.ranges} == {"standardize", "net"}
    assert subclassed.first_divergence is None


def test_a_probe_that_cannot_run_costs_one_line_and_the_report_still_comes_out(tmp_path, capsys):
    cfg = custom(tmp_path, "different_each_call")
    diagnosis = diagnose(cfg, probe_batches=1)
    assert [line.split(":")[0] for line in diagnosis.skipped] == [
        "float32 twin", "range probe", "gradient probe", "divergence locator"]
    assert all("\n" not in line for line in diagnosis.skipped)
    assert diagnosis.skipped[1] == "range probe: needs the float32 twin, which could not be built"
    assert diagnosis.layers and diagnosis.edge["nonfinite"] == 0  # the audit and the input-limits probe ran
    assert diagnosis.ok
    text = diagnosis.text()
    assert "SKIPPED  float32 twin: ValueError:" in text and "input limits probe: 130 rows" in text
    assert "no findings from the checks that ran" in text  # not a plain "no findings": the probes did not run
    assert cli.main(["diagnose", str(_write(tmp_path, cfg)), "--batches", "1"]) == 0  # skipped probes: still 0
    assert "SKIPPED  gradient probe" in capsys.readouterr().out


def test_probes_name_why_they_cannot_run_on_a_two_input_model():
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    model = keras.Model([a, b], layers.Dense(2, name="out")(layers.Concatenate()([a, b])))
    with pytest.raises(ProbeError, match=r"^model '.*' has 2 inputs; the probes feed the data's one input$"):
        probe_ranges(model, [np.ones((2, 4), np.float32)], twin=model)
    with pytest.raises(ProbeError, match=r"has 2 inputs"):
        locate_divergence(model, np.ones((2, 4), np.float32), twin=model)
