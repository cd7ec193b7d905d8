"""Config loading: defaults, overrides, and one clear line per bad value (exit code 2, nothing written)."""

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config, validate_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_match_the_guide_setup():
    cfg = load_config(None)
    assert cfg.precision.policy == "mixed_float16"
    assert cfg.precision.loss_scale == "dynamic"
    assert cfg.train.optimizer == "rmsprop"
    assert cfg.export.base_path == "models"
    assert cfg.export.model_name == cfg.experiment  # defaults to the run name


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_open_with_a_header(path):
    cfg = load_config(path)
    assert cfg.experiment
    assert path.read_text().startswith("#"), "each config opens with a comment saying what it trains"


def test_overrides_are_parsed_as_yaml_scalars():
    cfg = load_config(None, ["train.epochs=3", "precision.policy=float32", "export.base_path=build/models",
                             "train.learning_rate=1e-3", "model.hidden_units=[8, 8]"])
    assert cfg.train.epochs == 3
    assert cfg.precision.policy == "float32"
    assert cfg.export.base_path == "build/models"
    assert cfg.train.learning_rate == pytest.approx(1e-3)
    assert cfg.model.hidden_units == [8, 8]


@pytest.mark.parametrize("raw, message", [
    ({"train": {"epochs": -1}}, r"^x\.yaml: train\.epochs: expected a positive integer, got -1$"),
    ({"train": {"epochs": "three"}}, r"train\.epochs: expected an integer, got 'three'"),
    ({"train": {"learning_rate": 0}}, r"train\.learning_rate: expected a positive number, got 0"),
    ({"trian": {"epochs": 3}}, r"trian: unknown key; did you mean 'train'\?"),
    ({"train": {"epohcs": 3}}, r"train\.epohcs: unknown key; did you mean 'epochs'\?"),
    ({"precision": {"policy": "fp16"}}, r"precision\.policy: expected one of 'float32', 'mixed_float16' or 'mixed_bfloat16', got 'fp16'"),
    ({"precision": {"policy": "float32", "loss_scale": 128}}, r"precision\.loss_scale: a static loss scale \(128\) needs policy mixed_float16, got policy float32"),
    ({"precision": {"loss_scale": "none"}}, r"precision\.loss_scale: 'none' is unsafe under mixed_float16"),
    ({"precision": {"loss_scale": -4}}, r"precision\.loss_scale: expected 'dynamic', 'none' or a positive finite number, got -4"),
    ({"data": {"source": "npz"}}, r"data\.path: required when data\.source is 'npz'"),
    ({"data": {"validation_split": 1.5}}, r"data\.validation_split: expected a number < 1"),
    ({"model": {"hidden_units": [8, 0]}}, r"model\.hidden_units\.1: expected a positive integer, got 0"),
    ({"model": {"normalize": "yes"}}, r"model\.normalize: expected true or false, got 'yes'"),
    ({"train": 5}, r"train: expected a mapping of keys, got 5"),
    ({"serving": {"port": 70000}}, r"serving\.port: expected a number <= 65535, got 70000"),
    ({"experiment": ".."}, r"^x\.yaml: experiment: expected a name of 1-200 letters, digits, '\.', '_' or '-' "
                           r"\(not '\.', no '\.\.'\), got '\.\.'$"),
    ({"experiment": "."}, r"experiment: expected a name .*, got '\.'$"),
    ({"experiment": "runs/x"}, r"experiment: expected a name .*, got 'runs/x'$"),
    ({"experiment": "a" * 201}, r"experiment: expected a name of 1-200 "),
    ({"export": {"model_name": "team/digits"}}, r"export\.model_name: expected a name .*, got 'team/digits'$"),
    ({"export": {"model_name": "../../x"}}, r"export\.model_name: expected a name .*, got '\.\./\.\./x'$"),
    ({"export": {"model_name": "v1..2"}}, r"export\.model_name: expected a name .*, got 'v1\.\.2'$"),
    ({"model": {"kind": "transformer", "num_heads": 3}},
     r"^x\.yaml: model\.num_heads: 3 heads do not divide model\.width 64; pick a divisor \(e\.g\. 2\)$"),
    ({"model": {"num_layers": 4}}, r"^x\.yaml: model\.num_layers: only for model\.kind 'transformer' or 'causal_lm', got kind 'mlp'$"),
    ({"model": {"kind": "transformer", "dropout": 1.0}}, r"model\.dropout: expected a number < 1\.0, got 1\.0"),
    ({"model": {"kind": "transformer", "patch_size": 0}}, r"model\.patch_size: expected a positive integer, got 0"),
    ({"model": {"kind": "transformer", "hidden_units": [8]}},
     r"model\.hidden_units: not used by model\.kind 'transformer'; the blocks' MLP width is model\.mlp_units"),
    ({"data": {"source": "pointer"}},
     r"^x\.yaml: model\.kind: token sequences \(data\.source\) need kind 'transformer' or 'custom', got 'mlp'$"),
    ({"data": {"source": "pointer", "vocab_size": 30}, "model": {"kind": "transformer"}},
     r"data\.vocab_size: data\.source 'pointer' sets its own vocabulary"),
    ({"data": {"vocab_size": 30}, "model": {"kind": "transformer"}},
     r"^x\.yaml: data\.vocab_size: data\.source 'digits' holds numeric features, not token ids"),
    ({"data": {"sequence_length": 8}}, r"^x\.yaml: data\.sequence_length: only for token sequences"),
    ({"data": {"source": "pointer", "sequence_length": 2}, "model": {"kind": "transformer"}},
     r"data\.sequence_length: expected a number >= 3, got 2"),
    ({"data": {"source": "csv", "path": "x.csv", "vocab_size": 9, "task": "regression"},
      "model": {"kind": "transformer"}}, r"data\.task: token sequences are classified here"),
    ({"data": {"source": "tfrecord", "path": "x", "vocab_size": 9, "feature_spec": {"t": {"dtype": "int64", "shape": [4]}}},
      "model": {"kind": "transformer"}}, r"data\.feature_spec: token sequences are one int64 feature of any length"),
    ({"train": {"learning_rate_schedule": "linear"}},
     r"train\.learning_rate_schedule: expected one of 'constant' or 'cosine', got 'linear'"),
    ({"train": {"warmup_steps": -1}}, r"train\.warmup_steps: expected a number >= 0, got -1"),
    ({"train": {"global_clipnorm": 0}}, r"train\.global_clipnorm: expected a positive number, got 0"),
    ({"train": {"learning_rate": float("inf")}}, r"^x\.yaml: train\.learning_rate: expected a finite number, got \.inf$"),
    ({"train": {"learning_rate": float("nan")}}, r"^x\.yaml: train\.learning_rate: expected a finite number, got \.nan$"),
    ({"precision": {"loss_scale": float("inf")}},
     r"^x\.yaml: precision\.loss_scale: expected 'dynamic', 'none' or a positive finite number, got \.inf$"),
    ({"export": {"parity_tolerance": float("inf")}}, r"export\.parity_tolerance: expected a finite number, got \.inf$"),
    ({"train": {"jit_compile": "maybe"}},
     r"^x\.yaml: train\.jit_compile: expected true, false or 'auto', got 'maybe'$"),
    # a language model over text (issue 29): each side needs the other, and the keys of other sources are refused
    ({"model": {"kind": "causal_lm"}}, r"^x\.yaml: model\.kind: 'causal_lm' is a language model over text; set "
     r"data\.source: text .*got source 'digits'$"),
    ({"data": {"source": "text"}}, r"^x\.yaml: data\.source: 'text' trains model\.kind 'causal_lm', got kind 'mlp'$"),
    ({"data": {"source": "text", "tokenizer": "bpe"}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.tokenizer: expected one of 'bytes', 'sentencepiece' or 'gpt2', got 'bpe'$"),
    # a pretrained checkpoint (docs/pretrained.md): the two keys need each other, and it sets the architecture
    ({"data": {"source": "text", "tokenizer": "gpt2"}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.tokenizer: 'gpt2' reads vocab\.json and merges\.txt from the checkpoint of model\.init_from, "
     r"which is not set"),
    ({"data": {"source": "text"}, "model": {"kind": "causal_lm", "init_from": "gpt2/"}},
     r"^x\.yaml: data\.tokenizer: model\.init_from's checkpoint speaks GPT-2's byte-level BPE; set data\.tokenizer: "
     r"gpt2, got 'bytes'$"),
    ({"data": {"source": "text", "tokenizer": "gpt2"}, "model": {"kind": "causal_lm", "init_from": "gpt2/",
                                                                  "width": 96}},
     r"^x\.yaml: model\.width: the architecture comes from model\.init_from's config\.json; remove it$"),
    ({"model": {"init_from": "gpt2/"}},
     r"^x\.yaml: model\.init_from: a GPT-2-family checkpoint is a causal_lm, got kind 'mlp'"),
    # the sentencepiece tokenizer's size (the trainer's own refusals: tests/pipeline/test_tokenizers.py)
    ({"data": {"source": "text", "tokenizer": "sentencepiece", "vocab_size": 260}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.vocab_size: 260 is too small for sentencepiece: .*; use at least 261 \(default 512\)$"),
    ({"data": {"source": "text", "vocab_size": 300}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.vocab_size: not for data\.source 'text': data\.tokenizer 'bytes' has its fixed ids \(259 for bytes"),
    ({"data": {"tokenizer": "sentencepiece"}},
     r"^x\.yaml: data\.tokenizer: only for data\.source 'text', got source 'digits'; remove it$"),
    ({"data": {"source": "text", "validation_path": "val/*.txt"}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.validation_path: data\.source 'text' splits data\.path itself by data\.validation_split"),
    ({"data": {"source": "text", "cache": True}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.cache: not for data\.source 'text': .*; remove it$"),
    ({"data": {"source": "text", "task": "classification"}, "model": {"kind": "causal_lm"}},
     r"^x\.yaml: data\.task: data\.source 'text' is a language_model dataset, got 'classification'$"),
    ({"data": {"source": "csv", "path": ["a.csv", "b.csv"]}},
     r"^x\.yaml: data\.path: a list of globs is only for data\.source 'text', got source 'csv'; give one path or glob$"),
    ({"data": {"source": "text"}, "model": {"kind": "causal_lm", "patch_size": 4}},
     r"^x\.yaml: model\.patch_size: only for model\.kind 'transformer', got kind 'causal_lm'$"),
    ({"model": {"tied_embeddings": False}}, r"^x\.yaml: model\.tied_embeddings: only for model\.kind 'causal_lm', "
     r"got kind 'mlp'$"),
    ({"model": {"tied_embedings": False}}, r"^x\.yaml: model\.tied_embedings: unknown key; did you mean "
     r"'tied_embeddings'\?$"),
    ({"data": {"source": "text"}, "model": {"kind": "causal_lm", "width": 30, "num_heads": 4}},
     r"^x\.yaml: model\.num_heads: 4 heads do not divide model\.width 30"),
    ({"data": {"source": "text"}, "model": {"kind": "causal_lm"}, "precision": {"float16_layers": ["block_1"]}},
     r"^x\.yaml: precision\.float16_layers: model\.kind 'causal_lm' sets which of its parts compute in float32"),
    ({"data": {"source": "synthetic", "feature_shape": [100000, 100000]}},
     r"^x\.yaml: data\.feature_shape: 1,000 synthetic rows of shape \[100000, 100000\] \(10,000,000,000,000 values\) "
     r"need about 291\.0 TiB of memory to generate, more than this machine's .*; lower data\.num_examples or "
     r"data\.feature_shape$"),
])
def test_each_bad_value_gets_one_line_naming_the_key(raw, message):
    with pytest.raises(ConfigError, match=message) as info:
        validate_config(raw, "x.yaml")
    assert len(str(info.value).splitlines()) == 1


def test_a_warmup_as_long_as_the_run_is_refused_once_the_data_is_read(tmp_path):
    from pipeline.train import train

    cfg = load_config(None, ["train.epochs=1", "train.batch_size=512", "train.warmup_steps=3",
                             f"train.runs_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^train\.warmup_steps: 3 is not below the run's 3 updates \(3 steps \(1 epoch "
                                          r"of 3, batch 512; 1 pass over the training rows\) of 1438 training "
                                          r"examples\); lower it$"):
        train(cfg)
    assert not (tmp_path / cfg.experiment).exists()


def test_names_that_stay_one_directory_are_accepted():
    cfg = load_config(None, ["experiment=digits-v1.2_b", "export.model_name=Team.Digits-2"])
    assert (cfg.run_dir, cfg.model_base_path) == (Path("runs/digits-v1.2_b"), Path("models/Team.Digits-2"))
    assert load_config(None, ["experiment=x"]).export.model_name == "x"


def test_duplicate_keys_are_an_error_naming_both_lines(tmp_path):
    top = tmp_path / "top.yaml"
    top.write_text("# exp\ntrain:\n  epochs: 2\nseed: 1\ntrain:\n  batch_size: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(top)
    assert str(info.value) == (f"{top}: line 5: invalid YAML: duplicate key 'train' (first on line 2); each key may "
                               "appear once per section")
    nested = tmp_path / "nested.yaml"
    nested.write_text("train: {epochs: 2, batch_size: 8, epochs: 3}\n")
    with pytest.raises(ConfigError, match=r"line 1: invalid YAML: duplicate key 'epochs' \(first on line 1\)"):
        load_config(nested)


def test_an_empty_file_gives_the_defaults_and_says_so(tmp_path, caplog):
    for text in ("", "# only a comment\n", "{}\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        caplog.clear()
        assert load_config(empty) == load_config(None)
        assert [r.getMessage() for r in caplog.records] == [
            f"{empty} sets no keys (the file is empty): every key takes its default, e.g. experiment 'digits_mlp' "
            "(docs/configuration.md lists them)"]


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        validate_config({"train": {"epochs": 0, "batch_size": -2}, "precision": {"policy": "x"}})
    assert len(info.value.problems) == 3


def test_float32_with_dynamic_scaling_is_allowed_and_means_no_scaling():
    cfg = load_config(None, ["precision.policy=float32"])
    assert cfg.precision.loss_scale == "dynamic"  # the default; precision.apply_policy resolves it to 'none'


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {epochs: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: line \d+: invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"--set 'epochs': expected KEY=VALUE"):
        load_config(None, ["epochs"])


def test_cli_rejects_bad_config_with_exit_2_one_line_and_nothing_written(tmp_path):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(f"# test\nexperiment: e\ntrain:\n  runs_dir: {tmp_path / 'runs'}\n")
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "train", str(cfg), "--set", "train.epochs=-1",
         "--set", f"export.base_path={tmp_path / 'models'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"{cfg}: train.epochs: expected a positive integer, got -1"
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


def test_cli_config_prints_the_resolved_config():
    result = subprocess.run([sys.executable, "-m", "pipeline", "config", str(REPO / "configs/default.yaml"),
                             "--set", "train.epochs=3"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    resolved = validate_config(__import__("yaml").safe_load(result.stdout))
    assert resolved.train.epochs == 3
    assert resolved.export.model_name == "digits_mlp"


def test_docs_document_every_config_key():
    """docs/configuration.md is the config reference: a table row "| `key` |" for each leaf key, and no other."""
    import re

    from pydantic import BaseModel

    from pipeline.config import Config

    reference = (REPO / "docs" / "configuration.md").read_text()
    keys = []

    def collect(model, prefix):
        for key, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                collect(field.annotation, f"{prefix}{key}.")
            else:
                keys.append(prefix + key)

    collect(Config, "")
    missing = [key for key in keys if f"| `{key}` |" not in reference]
    assert not missing, f"docs/configuration.md's config table lacks {missing}"
    documented = re.findall(r"^\| `([\w.]+)` \|", reference, flags=re.MULTILINE)
    stale = sorted(set(documented) - set(keys))
    assert not stale, f"docs/configuration.md documents keys the config does not have: {stale}"


@pytest.mark.parametrize("raw, message", [
    ({"source": "csv"}, r"data\.path: required when data\.source is 'csv'"),
    ({"source": "tfrecord", "path": "x.tfrecord"}, r"data\.feature_spec: required when data\.source is 'tfrecord'"),
    ({"source": "synthetic", "validation_path": "v.csv"}, r"data\.validation_path: not used by data\.source 'synthetic'"),
    ({"source": "diabetes", "task": "classification"}, r"data\.task: data\.source 'diabetes' is a regression dataset"),
    ({"source": "synthetic", "task": "regression", "num_classes": 3}, r"data\.num_classes: only for classification"),
    ({"source": "synthetic", "num_classes": 3, "label_names": ["a", "b"]}, r"data\.label_names: 2 names for data\.num_classes 3"),
    ({"source": "csv", "path": "x.csv", "feature_columns": ["a", "label"]}, r"data\.feature_columns: includes the label column 'label'"),
    ({"source": "tfrecord", "path": "x", "feature_spec": {"a": {"dtype": "string"}}},
     r"data\.feature_spec\.a\.dtype: expected one of 'float32' or 'int64', got 'string'"),
    ({"image_shape": [8, 8]}, r"data\.image_shape: expected \[height, width, channels\], got \[8, 8\]"),
    ({"num_classes": 1}, r"data\.num_classes: expected a number >= 2, got 1"),
    ({"source": "images", "path": "photos"}, r"data\.image_shape: required when data\.source is 'images'"),
    ({"source": "images", "path": "photos", "image_shape": [8, 8, 2]}, r"data\.image_shape: images decode to 1 \(grey\)"),
    ({"source": "csv", "path": "x.csv", "cache": True}, r"data\.cache: data\.source 'csv' is streamed"),
    ({"source": "csv", "path": "x.csv", "statistics_rows": 1000}, r"data\.statistics_rows: a sample cannot tell how "
                                                                  r"many classes .*; set data\.num_classes"),
    ({"statistics_rows": 1000}, r"data\.statistics_rows: data\.source 'digits' is held in memory"),
    ({"source": "tfrecord", "path": "x", "feature_spec": {"a": {}}, "service": "dispatcher"},
     r"data\.service: expected a dispatcher address such as grpc://data-dispatcher:5050, got 'dispatcher'"),
    ({"service": "grpc://d:5050"}, r"data\.service: a tf\.data service reads files; data\.source 'digits' is held"),
])
def test_data_settings_that_do_not_fit_are_config_errors(raw, message):
    from pipeline.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message) as info:
        validate_config({"data": raw})
    assert len(str(info.value).splitlines()) == 1


def test_task_and_synthetic_classes_are_resolved_in_the_config():
    assert load_config(None, ["data.source=diabetes"]).data.task == "regression"
    synthetic = load_config(None, ["data.source=synthetic"]).data
    assert (synthetic.task, synthetic.num_classes) == ("classification", 2)


def test_sentencepiece_without_its_packages_is_one_config_line_naming_them(monkeypatch):
    import importlib.util

    from pipeline.config import ConfigError

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "tensorflow_text" else found(name))
    with pytest.raises(ConfigError, match=r"^<defaults>: data\.tokenizer: 'sentencepiece' needs tensorflow-text, not installed "
                                          r"here \(pip install -e '\.\[text\]'\); or use 'bytes'$"):
        load_config(None, ["data.source=text", "model.kind=causal_lm", "data.tokenizer=sentencepiece"])


def test_text_defaults_to_a_language_model_with_a_256_id_context_and_takes_a_list_of_globs():
    cfg = load_config(None, ["data.source=text", "model.kind=causal_lm", "data.path=[docs/*.md, notes/*.txt]"])
    assert (cfg.data.task, cfg.data.sequence_length, cfg.data.tokenizer) == ("language_model", 256, "bytes")
    assert cfg.data.vocab_size is None
    piece = load_config(None, ["data.source=text", "model.kind=causal_lm", "data.tokenizer=sentencepiece"])
    assert (piece.data.tokenizer, piece.data.vocab_size) == ("sentencepiece", 512)
    assert cfg.data.path == ["docs/*.md", "notes/*.txt"] and cfg.model.tied_embeddings
    assert load_config(None, ["data.source=text", "model.kind=causal_lm"]).data.path is None  # the embedded corpus
