"""A tiny language model with data.tokenizer sentencepiece (1 block, width 16, context 32 tokens, 300 ids) through the
pipeline: trained under mixed_float16 with its tokenizer trained from the training files and stored in the run,
nats per token and per byte against the baselines, a resume that reuses the tokenizer and one refused when the text
changed, the export behind the gate with the proto inside the SavedModel and pipeline.json saying TF Text's ops are
needed, verify, and a vocabulary the text cannot fill refused in one line (exit 2)."""

import json

import keras
import numpy as np
import pytest

from pipeline import cli
from pipeline.lm import generate, tokenizers
from pipeline.config import load_config
from pipeline.train import train
from pipeline.verify import verify

from lm_helpers import TINY_LM_MODEL

pytestmark = pytest.mark.timeout(300)

SENTENCES = ["The cat sat on the mat. ", "A dog ran to the park and back. ", "The sun is warm in the morning. ",
             "Birds sing when the rain stops. ", "Ünïcödé and emoji 🙂 too. "]
TINY_LM = ["experiment=tiny_sp", *TINY_LM_MODEL, "data.tokenizer=sentencepiece", "data.vocab_size=300", "train.epochs=2",
           "train.batch_size=8", "train.optimizer=adam", "train.learning_rate=0.01"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Four text files, a config file with the tiny model, and its trained run."""
    root = tmp_path_factory.mktemp("lm_sentencepiece")
    for i in range(4):
        rng = np.random.default_rng(i)
        (root / f"doc{i}.txt").write_text("".join(rng.choice(SENTENCES, 60)))
    config = root / "lm.yaml"
    config.write_text(load_config(None, [*TINY_LM, f"data.path={root}/*.txt", f"train.runs_dir={root / 'runs'}",
                                         f"export.base_path={root / 'models'}"]).to_yaml())
    run = train(load_config(str(config)))
    keras.config.set_dtype_policy("float32")
    return root, config, run


@pytest.fixture(scope="module")
def exported(workspace):
    root, config, _ = workspace
    assert cli.main(["export", str(config)]) == 0
    return root / "models" / "tiny_sp" / "1"


def test_it_trains_with_its_own_tokenizer_and_reports_nats_per_token_and_per_byte(workspace):
    root, _, run = workspace
    data_dir = run.run_dir / "data"
    stored = tokenizers.read_sentencepiece(data_dir)
    assert stored.vocab_size == 300 and stored.proto == run.datasets.tokenizer.proto
    assert stored.record["trained_on"]["bytes"] == run.datasets.corpus.train.bytes
    history = json.loads((run.run_dir / "history.json").read_text())
    metrics = json.loads((run.run_dir / "metrics.json").read_text())
    assert all(np.isfinite(h["val_nats_per_byte"]) and np.isfinite(h["val_nats_per_token"]) for h in history)
    # a token is more than a byte here, so a token carries more nats than a byte
    assert metrics["val_nats_per_token"] > 1.3 * metrics["val_nats_per_byte"]
    assert metrics["val_nats_per_byte"] < metrics["baselines"]["unigram_nats_per_byte"]
    assert metrics["val_nats_per_byte_vs_bigram"] == pytest.approx(
        metrics["val_nats_per_byte"] / metrics["baselines"]["bigram_nats_per_byte"], abs=1e-4)
    assert (run.run_dir / "samples.txt").read_text().count("--- epoch") == 2


def test_a_resume_reuses_the_tokenizer_and_refuses_one_trained_on_changed_text(workspace, tmp_path, caplog):
    import shutil

    root, config, run = workspace
    runs = tmp_path / "runs"
    shutil.copytree(run.run_dir, runs / "tiny_sp")
    for name in ("metrics.json", "model.keras"):
        (runs / "tiny_sp" / name).unlink()
    more = ["--set", f"train.runs_dir={runs}"]
    assert cli.main(["train", str(config), *more]) == 0  # resumes after the last checkpoint: nothing retrained
    assert tokenizers.read_sentencepiece(runs / "tiny_sp" / "data").proto == run.datasets.tokenizer.proto
    training_file = next(name for name in run.datasets.corpus.train.names)
    text = open(training_file).read()
    try:
        with open(training_file, "a") as file:
            file.write("A brand new sentence changes the training text. ")
        (runs / "tiny_sp" / "metrics.json").unlink()
        assert cli.main(["train", str(config), *more, "--set", "train.epochs=3"]) == 1
    finally:
        with open(training_file, "w") as file:
            file.write(text)


def test_the_export_carries_the_tokenizer_inside_and_says_tf_text_ops_are_needed(exported, workspace):
    _, _, run = workspace
    facts = json.loads((exported / "assets.extra" / "pipeline.json").read_text())
    assert facts["op_libraries"] == ["tensorflow_text"]
    tokenizer = facts["language_model"]["tokenizer"]
    assert (tokenizer["kind"], tokenizer["vocab_size"], tokenizer["sha256"]) == (
        "sentencepiece", 300, run.datasets.tokenizer.sha256)
    assert tokenizer["special_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert facts["signatures"]["generate"]["inputs"]["prompts"]["dtype"] == "string"
    parity = json.loads((exported / "assets.extra" / "parity.json").read_text())
    assert parity["passed"]
    ops = generate.saved_model_op_types(exported)
    assert {"SentencepieceOp", "SentencepieceTokenizeOp"} <= ops and "SentencepieceDetokenizeOp" not in ops
    assert not [path for path in exported.rglob("*.model")]  # no tokenizer file beside the graph
    assert facts["language_model"]["sample"]["completion"]  # the SavedModel's greedy completion of the prompt


def test_verify_passes_a_sentencepiece_export(exported):
    report = verify(exported)
    statuses = {check.name: check.status for check in report.checks}
    assert report.ok, report.text()
    for name in ("op set", "runner", "generate"):
        assert statuses[name] == "PASS", report.text()


def test_the_op_check_refuses_tf_text_ops_in_a_bytes_export(exported, tmp_path):
    from pipeline.errors import ExportError
    from pipeline.export import lm

    with pytest.raises(ExportError, match=r"ops outside the core set tensorflow_model_server runs: .*SentencepieceOp"):
        lm._check_saved_model(exported, None, tokenizers.BYTES)  # the op set is checked first


def test_a_vocabulary_the_text_cannot_fill_is_one_line_and_exit_2(workspace, capsys):
    root, config, _ = workspace
    code = cli.main(["train", str(config), "--set", "data.vocab_size=5000", "--set", "experiment=too_big"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "data.vocab_size: 5000 is more than sentencepiece can learn from the training text (at most" in err
    assert not (root / "runs" / "too_big").exists()


def test_audit_replays_its_generate_calls_through_its_own_tokenizer(exported, generate_log, tmp_path, capsys):
    """pipeline audit encodes the logged prompts with the run's sentencepiece model (pipeline/audit/lm.py): greedy
    and sampled calls, the served mixed_float16 version against its float32 twin, within the tolerance."""
    calls = [{"prompts": ["The cat", "Ünïcödé"], "max_new_tokens": 8, "temperature": 0.0, "top_k": 0, "seed": 0},
             {"prompts": ["A dog"], "max_new_tokens": 6, "temperature": 0.8, "top_k": 20, "seed": 3}]
    log = generate_log(exported, "tiny_sp", calls, tmp_path / "requests.tfrecord")
    assert cli.main(["audit", str(exported.parent), "--log", str(log), "--output", str(tmp_path / "audit")]) == 0
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    version = report["versions"]["1"]
    assert report["requests"] == 2 and version["outputs"]["logits"]["rows"] > 0
    assert version["replay"]["greedy_tokens"] > 0 and version["replay"]["tokens_beyond_tolerance"] == 0
