"""`python -m pipeline` on bad input: one clean line on stderr, exit code 2, nothing written; and no TensorFlow
C++ log unless the user asks for it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli

REPO = Path(__file__).resolve().parents[2]
TINY = "# tiny\nexperiment: tiny\nmodel: {hidden_units: [8]}\ntrain: {epochs: 1}\n"

# (command and arguments, the config file's text, the one line expected on stderr); CONFIG is the file's path.
BAD_INPUTS = [
    (["train", "CONFIG"], "train:\n  epochs: 2\ntrain:\n  batch_size: 8\n",
     r"CONFIG: line 3: invalid YAML: duplicate key 'train' \(first on line 1\); each key may appear once per section"),
    (["train", "CONFIG"], "train: {epochs: 2, epochs: 3}\n", r"CONFIG: line 1: invalid YAML: duplicate key 'epochs'"),
    (["train", "CONFIG", "--fresh"], 'experiment: ".."\n', r"CONFIG: experiment: expected a name .*, got '\.\.'"),
    (["train", "CONFIG"], "experiment: .\n", r"CONFIG: experiment: expected a name .*, got '\.'"),
    (["train", "CONFIG", "--set", "experiment=../../logs"], TINY, r"CONFIG: experiment: .*got '\.\./\.\./logs'"),
    (["export", "CONFIG"], "export: {model_name: team/digits}\n", r"CONFIG: export\.model_name: .*got 'team/digits'"),
    (["export", "CONFIG", "--set", "export.model_name=../../x"], TINY, r"CONFIG: export\.model_name: .*'\.\./\.\./x'"),
    (["train", "CONFIG"], "train: {jit_compile: maybe}\n",
     r"CONFIG: train\.jit_compile: expected true, false or 'auto', got 'maybe'"),
    (["train", "CONFIG", "--set", "train.batch_size=1000000000"], TINY,
     r"train\.batch_size: 1000000000 is larger than the 1438 training examples \(each epoch would be a single step "
     r"of 1438\); use at most 1438"),
    (["train", "CONFIG"], "data: {source: synthetic, feature_shape: [100000, 100000]}\n",
     r"CONFIG: data\.feature_shape: 1,000 synthetic rows .* need about 291\.0 TiB of memory to generate"),
    (["verify", "models/nope"], None,
     r"error: models/nope: no numeric version directories .*; pass a version directory"),
    (["verify", "nope.txt"], None, r"error: nope\.txt: .*pass a version directory"),
    (["train", "CONFIG", "--set", "train.epochs=-1"], TINY, r"CONFIG: train\.epochs: expected a positive integer"),
    (["train", "CONFIG"], "trian: {epochs: 3}\n", r"CONFIG: trian: unknown key; did you mean 'train'\?"),
    (["demo", "CONFIG"], "precision: {policy: fp16}\n", r"CONFIG: precision\.policy: expected one of"),
    (["train", "CONFIG"], "precision: {loss_scale: none}\n", r"CONFIG: precision\.loss_scale: 'none' is unsafe"),
    (["compare", "CONFIG"], "precision: {policy: float32, loss_scale: 128}\n",
     r"CONFIG: precision\.loss_scale: a static loss scale \(128\) needs policy mixed_float16"),
    (["train", "CONFIG"], "data: {source: npz}\n", r"CONFIG: data\.path: required when data\.source is 'npz'"),
    (["diagnose", "CONFIG"], "data: {validation_split: 1.5}\n",
     r"CONFIG: data\.validation_split: expected a number < 1"),
    (["train", "CONFIG"], "model: {hidden_units: [8, 0]}\n", r"CONFIG: model\.hidden_units\.1: expected a positive"),
    (["train", "CONFIG"], "model: {normalize: 'yes'}\n", r"CONFIG: model\.normalize: expected true or false"),
    (["serve", "CONFIG"], "serving: {port: 70000}\n", r"CONFIG: serving\.port: expected a number <= 65535"),
    (["train", "CONFIG"], "train: {epochs: 3\n", r"CONFIG: line \d+: invalid YAML"),
    (["train", "missing.yaml"], None, r"missing\.yaml: config file not found"),
    (["train", "CONFIG", "--set", "epochs"], TINY, r"CONFIG: --set 'epochs': expected KEY=VALUE"),
    (["train", "CONFIG", "--set", "train.epochs=3"], "train: 5\n",
     r"CONFIG: --set 'train\.epochs=3': train is not a section"),
    (["train", "CONFIG"], "- a\n- b\n",
     r"CONFIG: expected a mapping of sections at the top level, got list"),
    (["predict", "CONFIG", "--local"], "data: {path: x.csv}\n",
     r"CONFIG: data\.path: not used by data\.source 'digits'"),
    (["train", "CONFIG"], "model: {builder: 'm:f'}\n", r"CONFIG: model\.builder: only for model\.kind 'custom'"),
    (["train", "CONFIG"], "data: {source: csv, path: absent.csv}\n", r"error: data\.path: .*absent\.csv"),
]


@pytest.mark.parametrize("argv, text, line", BAD_INPUTS, ids=[f"{i}-{c[0][0]}" for i, c in enumerate(BAD_INPUTS)])
def test_each_bad_input_costs_one_line_on_stderr_exit_2_and_writes_nothing(argv, text, line, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    if text is not None:
        Path("exp.yaml").write_text(text)
    (tmp_path / "nope.txt").write_text("not a model")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main([a.replace("CONFIG", "exp.yaml") for a in argv]) == cli.EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert re.fullmatch(line.replace("CONFIG", r"exp\.yaml") + ".*", err.strip()), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing written"


def test_thirty_kinds_of_bad_input_are_covered():
    assert len(BAD_INPUTS) == 30


@pytest.mark.subprocess  # real `python -m pipeline` processes: their whole stderr
def test_a_bad_input_in_a_real_process_prints_only_its_line_and_no_tensorflow_log(tmp_path):
    """The batch-size check runs after TensorFlow is imported and the data loaded: the worst case for noise."""
    (tmp_path / "exp.yaml").write_text(TINY)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-m", "pipeline", "train", "exp.yaml", "--set", "train.batch_size=5000"],
                            cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == ["train.batch_size: 5000 is larger than the 1438 training examples (each "
                                          "epoch would be a single step of 1438); use at most 1438"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


@pytest.mark.subprocess
def test_tensorflow_log_is_quiet_by_default_and_back_when_the_user_sets_its_level(tmp_path):
    code = "import tensorflow as tf; print(float(tf.constant(2.0) + 1))"  # loads TensorFlow and runs an op
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    script = f"from serving.tf_log import quiet_tensorflow; quiet_tensorflow('3'); {code}"
    quiet = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "3.0\n", "")
    loud = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"},
                          capture_output=True, text=True, timeout=120)
    assert loud.returncode == 0 and loud.stdout == "3.0\n"
    assert "WARNING: All log messages before absl::InitializeLog() is called" in loud.stderr  # TensorFlow's own


def test_quiet_tensorflow_leaves_a_level_the_user_chose():
    environ = {"TF_CPP_MIN_LOG_LEVEL": "0"}
    from serving.tf_log import quiet_tensorflow

    assert quiet_tensorflow("3", environ) is False and environ == {"TF_CPP_MIN_LOG_LEVEL": "0"}


def test_a_level_set_by_quiet_tensorflow_is_not_mistaken_for_the_users_choice():
    """A child process (or a second call) inherits the level quiet_tensorflow set, and still filters."""
    from serving.tf_log import quiet_tensorflow

    environ: dict[str, str] = {}
    assert quiet_tensorflow("3", environ) is True and environ["TF_CPP_MIN_LOG_LEVEL"] == "3"
    assert quiet_tensorflow("1", environ) is True and environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # the user changes it afterwards
    assert quiet_tensorflow("1", environ) is False and environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
