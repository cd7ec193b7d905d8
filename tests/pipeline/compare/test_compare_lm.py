"""compare on a language model (model.kind causal_lm, issue 29): a tiny one (1 block, width 16, context 32) trained
under float32 and mixed_float16 in child processes; the report in the model's own terms (nats per byte and per
token, the baselines, tokens/s), the verdict against a tolerance in percent of float32's nats per byte, the plots
and the diagnosis of the mixed run from inside its blocks."""

import json

import pytest
import yaml

from pipeline import cli

from lm_helpers import write_texts

pytestmark = pytest.mark.timeout(600)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """`python -m pipeline compare` on a tiny language model, 2 epochs, in its own runs directory."""
    folder = write_texts(tmp_path_factory.mktemp("lm_compare"))
    config = folder / "tiny_lm.yaml"
    config.write_text(yaml.safe_dump({
        "experiment": "tiny_lm",
        "data": {"source": "text", "path": str(folder / "*.txt"), "sequence_length": 32, "validation_split": 0.25},
        "model": {"kind": "causal_lm", "num_layers": 1, "width": 16, "num_heads": 2, "mlp_units": 32},
        "train": {"epochs": 2, "batch_size": 16, "optimizer": "adam", "learning_rate": 0.01,
                  "runs_dir": str(folder / "runs")},
        "precision": {"policy": "mixed_float16"}}))
    code = cli.main(["compare", str(config), "--batches", "1"])
    directory = folder / "runs" / "tiny_lm" / "compare"
    return code, directory, json.loads((directory / "report.json").read_text())


@pytest.mark.subprocess  # compare trains each policy in a child process
def test_compare_reports_a_language_model_in_nats_per_byte_against_its_baselines(comparison):
    code, directory, report = comparison
    assert code == 0
    for name in ("curves.png", "loss_scale.png"):
        assert (directory / name).read_bytes()[:8] == PNG
    assert not list(directory.parent.glob(".tmp-*")), "no staging directory left behind"
    float32, mixed = report["policies"]
    assert (float32["policy"], mixed["policy"]) == ("float32", "mixed_float16")
    assert float32["metric"] == mixed["metric"] == "val_nats_per_byte" and float32["delta"] == 0
    assert mixed["delta_unit"] == "%"
    assert mixed["delta"] == pytest.approx((mixed["value"] - float32["value"]) / float32["value"] * 100, abs=1e-2)
    for row in (float32, mixed):
        metrics = json.loads((directory / row["run_dir"] / "metrics.json").read_text())
        assert metrics["policy"]["name"] == row["policy"] and row["value"] == metrics["val_nats_per_byte"]
        lm = row["language_model"]
        assert lm["unigram_nats_per_byte"] == metrics["baselines"]["unigram_nats_per_byte"]
        assert lm["bigram_nats_per_byte"] < lm["unigram_nats_per_byte"]
        assert lm["vs_unigram"] == pytest.approx(row["value"] / lm["unigram_nats_per_byte"], abs=1e-3)
        assert lm["tokens_per_second"] == pytest.approx(row["examples_per_second"] * 32, rel=1e-3)
        assert row["skipped_steps"] >= 0 and row["peak_memory_bytes"] > 0
    assert float32["final_loss_scale"] is None and mixed["final_loss_scale"] >= 1
    assert report["tolerance"] == 2.0  # a language model's default: issue 29's within 2% of float32
    assert report["verdict"].startswith("mixed_float16 ") and "val_nats_per_byte" in report["verdict"]


@pytest.mark.subprocess  # compare trains each policy in a child process
def test_the_language_model_report_shows_its_columns_and_the_diagnosis_inside_its_blocks(comparison):
    _, directory, report = comparison
    text = (directory / "report.md").read_text()
    assert f"**Verdict:** {report['verdict']}" in text
    assert ("| policy | val_nats_per_byte | Δ vs float32 | nats/token (val_loss) | × unigram | × bigram | tokens/s "
            "| × float32 | peak memory | skipped steps | final loss scale |") in text
    assert "| float32 | " in text and "| mixed_float16 | " in text and "the unigram baseline is " in text
    assert "## Numeric diagnosis of the mixed_float16 run" in text
    kinds = len(report["diagnosis"]["operations"])
    assert (f"(softmax, attention products, normalisation, output, loss): {kinds} of {kinds} (layer, op) pairs in "
            "float32.") in text
    diagnosis = report["diagnosis"]
    assert diagnosis["source"] == "compare/runs/mixed_float16/tiny_lm/model.keras" and diagnosis["ok"]
    assert {g["layer"] for g in diagnosis["gradients"]} >= {"block_1/mlp_1", "block_1/attention/query"}
    assert {(o["layer"], o["op"], o["dtype"]) for o in diagnosis["operations"]} >= {
        ("block_1", "Softmax", "float32"), ("(loss)", "loss value", "float32")}
