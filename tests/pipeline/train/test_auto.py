"""precision.policy auto on a CPU with native bfloat16 and no accelerator: train steps under float32 and
mixed_bfloat16 are timed before training, and the run trains under the faster, recorded with the rates.

Which policy wins depends on the CPU running the tests, so these tests assert relations (the pick is the highest
recorded rate, the reason names the rates), never a winner. The hardware is played by a Hardware value with
avx512_bf16, so the measuring path runs on any CPU."""

import json

import keras
import pytest

from pipeline import precision
from pipeline.config import load_config
from pipeline.train import auto, checkpoints, train

EPYC = precision.Hardware(cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}), cpu_model="AMD EPYC (played)")


@pytest.fixture(scope="module")
def measured(tiny_config_path, tmp_path_factory):
    """The tiny config trained one epoch under auto on the played EPYC."""
    runs = tmp_path_factory.mktemp("auto_runs")
    cfg = load_config(tiny_config_path, ["precision.policy=auto", "experiment=tiny_auto", "train.epochs=1",
                                         f"train.runs_dir={runs}"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precision, "detect_hardware", lambda: EPYC)
        run = train(cfg)
    keras.config.set_dtype_policy("float32")
    return cfg, run


def test_the_run_trains_under_the_candidate_with_the_highest_recorded_rate(measured):
    cfg, run = measured
    record = run.policy.measured
    batch = str(cfg.train.batch_size)
    rates = {name: by_size[batch] for name, by_size in record["rates"].items()}
    assert set(rates) == set(precision.TRAIN_CANDIDATES) and all(rate > 0 for rate in rates.values())
    assert run.policy.name == max(rates, key=rates.get) and run.policy.requested == "auto"
    ratio = rates["mixed_bfloat16"] / rates["float32"]
    assert run.policy.reason.startswith(f"measured: mixed_bfloat16 {ratio:.2f}x float32 at batch {batch} (")
    assert run.policy.reason.endswith(f"steps/s); picked {run.policy.name}")
    assert record["unit"] == "steps/s" and record["machine"]["cpu"] == "AMD EPYC (played)"
    assert "2 warm-up steps, then the median of 5 to 50 interleaved steps" in record["method"]
    dense = [layer for layer in run.model.layers if isinstance(layer, keras.layers.Dense)]
    assert {layer.compute_dtype for layer in dense} == {keras.DTypePolicy(run.policy.name).compute_dtype}


def test_metrics_json_and_every_checkpoint_record_the_choice_with_its_rates(measured):
    cfg, run = measured
    recorded = run.policy.to_dict()
    assert json.loads((cfg.run_dir / "metrics.json").read_text())["policy"] == recorded
    assert checkpoints.recorded_policy(cfg.run_dir) == recorded


def test_export_restores_the_recorded_choice_without_measuring(measured, monkeypatch):
    cfg, run = measured
    monkeypatch.setattr(precision, "detect_hardware", lambda: pytest.fail("a recorded run must not re-detect"))
    restored = precision.restore_trained_policy(cfg.precision, cfg.run_dir)
    assert restored == run.policy


def test_a_resumed_run_keeps_the_recorded_choice_and_measures_nothing(measured, tiny_config_path, monkeypatch):
    cfg, run = measured
    monkeypatch.setattr(precision, "detect_hardware", lambda: EPYC)
    monkeypatch.setattr(auto, "measure", lambda *args: pytest.fail("a resumed run must not measure again"))
    longer = load_config(tiny_config_path, ["precision.policy=auto", "experiment=tiny_auto", "train.epochs=2",
                                            f"train.runs_dir={cfg.run_dir.parent}"])
    resumed = train(longer)
    assert resumed.policy == run.policy and resumed.metrics["epochs"] == 2


def test_measuring_leaves_no_trace_in_the_trained_weights(measured, tiny_config_path, tmp_path):
    cfg, run = measured
    same = load_config(tiny_config_path, [f"precision.policy={run.policy.name}", "experiment=tiny_auto",
                                          "train.epochs=1", f"train.runs_dir={tmp_path}"])
    explicit = train(same)
    assert explicit.metrics["weights_sha1"] == run.metrics["weights_sha1"]


UNNAMED = '''
import keras
from keras import layers


def build(input_shape, num_classes):
    """Layers named by Keras (dense, dense_1): what every candidate's build must name them too."""
    inputs = keras.Input(input_shape)
    logits = layers.Dense(num_classes)(layers.Dense(16, activation="relu")(inputs))
    return keras.Model(inputs, layers.Activation("softmax", dtype="float32")(logits))
'''


def test_layers_keras_names_keep_their_names_so_float32_layers_still_finds_them(builder_module, tmp_path,
                                                                                monkeypatch):
    builder_module("tests_unnamed", UNNAMED)
    monkeypatch.setattr(precision, "detect_hardware", lambda: EPYC)
    cfg = load_config(None, ["precision.policy=auto", "experiment=tiny_unnamed", "train.epochs=1",
                                         "model.kind=custom", "model.builder=tests_unnamed:build",
                                         "precision.float32_layers=[dense]", f"train.runs_dir={tmp_path}"])
    run = train(cfg)
    dense = {layer.name: layer.compute_dtype for layer in run.model._flatten_layers()
             if isinstance(layer, keras.layers.Dense)}
    assert dense == {"dense": "float32", "dense_1": keras.DTypePolicy(run.policy.name).compute_dtype}
