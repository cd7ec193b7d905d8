"""Numerical failures named as numerical (pipeline/models/nonfinite.py): the build-time check and the training guard's stop
name the first layer whose output is inf or NaN, the policy, what it read and the fix, merged into the user's
precision.float32_layers (issue 23: the build said "its outputs do not sum to 1")."""

import re

import pytest

from pipeline import cli
from pipeline.models import nonfinite
from pipeline.config import load_config
from pipeline.errors import ModelError, TrainingError
from pipeline.train import train

pytestmark = pytest.mark.timeout(300)


def test_a_layer_kept_in_float16_is_named_with_the_policy_and_the_fix(transactions, tmp_path):
    # precision.float16_layers opts amount_scale out of the over-range rule: its float16 cast of ~1e7 is inf.
    cfg = transactions.config(tmp_path, "build", "precision.float16_layers=[amount_scale, norm]")
    with pytest.raises(ModelError) as refused:
        train(cfg)
    assert str(refused.value) == (
        "model.builder 'tests_transactions:build': the model's outputs are inf or NaN on training rows: under policy "
        "mixed_float16, layer 'amount_scale' (Rescaling, computing in float16) is the first to produce inf (it reads "
        "values up to 1.15e+07, beyond float16's maximum 65504); fix: remove it from precision.float16_layers, which "
        "keeps it in float16: [norm]")
    assert not (tmp_path / "runs").exists()


def test_the_fix_adds_the_layer_to_the_users_float32_layers(transactions, tmp_path):
    # Amounts x10 stay float32 through the layers the data decides (over_range); the Add that reads them is float16.
    cfg = transactions.config(tmp_path, "build", "model.params={scale: 10.0}", "precision.float32_layers=[norm]")
    with pytest.raises(ModelError, match=re.escape(
            "under policy mixed_float16, layer 'event' (Add, computing in float16) is the first to produce inf (it "
            "reads values up to 4.71e+07, beyond float16's maximum 65504); fix: precision.float32_layers: "
            "[norm, event]")):
        train(cfg)


def test_cli_the_refusal_is_one_line_exit_1_and_nothing_written(transactions, tmp_path, capsys):
    code = cli.main(["train", "configs/default.yaml",
                     *(f"--set={o}" for o in transactions.overrides(tmp_path, "build",
                                                                      "precision.float16_layers=[amount_scale]"))])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "layer 'amount_scale' (Rescaling" in err
    assert not (tmp_path / "runs").exists()


def test_a_stopped_training_names_the_first_layer_to_overflow(tmp_path):
    # A learning rate of 10 blows the weights up within a step; the guard stops, naming where the forward overflows.
    cfg = load_config(None, ["experiment=blowup", "train.learning_rate=10", "train.epochs=1",
                             f"train.runs_dir={tmp_path}", "model.hidden_units=[16, 16]"])
    with pytest.raises(TrainingError) as stopped:
        train(cfg)
    message = str(stopped.value)
    assert message.startswith("training stopped at step") and len(message.splitlines()) == 1
    assert re.search(r"; under policy mixed_float16, layer 'dense_\d' \(Dense, computing in float16\) is the first to "
                     r"produce (inf|NaN|inf and NaN) \(.*\); fix: precision\.float32_layers: \[dense_\d\]$", message)


@pytest.mark.parametrize("found, float32_layers, float16_layers, fix", [
    (nonfinite.NonFinite("proj", "Dense", "float16", "inf", 70000.0), ["a"], [], "precision.float32_layers: [a, proj]"),
    (nonfinite.NonFinite("proj", "Dense", "float16", "inf", 70000.0), ["proj"], [],
     "it is in precision.float32_layers, but sublayers of it still compute in float16; train under precision.policy "
     "mixed_bfloat16 or float32"),
    (nonfinite.NonFinite("log", "Activation", "float32", "NaN", 3.0), [], [],
     "it does not compute in float16, so this is not a float16 overflow: check its math (a log or a division by 0) "
     "and the data, or set precision.check_numerics: true to find the op"),
    (nonfinite.NonFinite("get_item", "GetItem", "float32", "inf", 1.0, is_layer=False), [], [],
     "it does not compute in float16, so this is not a float16 overflow: check its math (a log or a division by 0) "
     "and the data, or set precision.check_numerics: true to find the op"),
])
def test_the_fix_fits_what_the_layer_is(found, float32_layers, float16_layers, fix):
    assert nonfinite.fix_text(found, float32_layers, float16_layers) == fix
    assert nonfinite.describe(found, "mixed_float16", float32_layers, float16_layers).endswith(f"; fix: {fix}")
