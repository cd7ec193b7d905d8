"""pipeline audit of a language model: a tiny causal_lm (mixed_float16) exported through the pipeline, served in this
process with every generate call logged (greedy and sampled, gRPC Predict and the openai client), and its log
teacher-forced through the served SavedModel and the float32 twin, step by step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from pipeline import cli
from pipeline.lm import tokenizers
from pipeline.audit import audit
from pipeline.audit.report import REPRODUCERS_FILE
from serving.app import ServerThread, build
from serving.flags import parse
from lm_helpers import grpc_generate
from server_helpers import logged_models_config

pytestmark = pytest.mark.timeout(300)

CONTEXT = 32


@pytest.fixture(scope="module")
def exported(tiny_lm_export) -> Path:
    """The tiny language model trained and exported (serving mixed_float16): its base path."""
    return tiny_lm_export.base_path


@pytest.fixture(scope="module")
def served_log(exported, tmp_path_factory) -> Path:
    """Five generate calls logged by the real server: greedy and sampled over gRPC, greedy and sampled (streamed)
    through the openai client."""
    log_dir = tmp_path_factory.mktemp("lm_log")
    config = logged_models_config(log_dir, "tiny_lm", exported)
    options = parse([f"--model_config_file={config}", "--port=0", "--rest_api_port=-1"])
    with ServerThread(options, build(options)) as running:
        grpc_generate(running.grpc_address, ["The cat", "A dog ran", "é"], 12, 0.0, model_name="tiny_lm")
        grpc_generate(running.grpc_address, ["The sun is", "B"], 10, 0.9, seed=5, model_name="tiny_lm")
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        client.completions.create(model="tiny_lm", prompt=["Birds sing", "The"], max_tokens=16, temperature=0)
        list(client.completions.create(model="tiny_lm", prompt="x", max_tokens=8, temperature=0.7, seed=3,
                                       stream=True))
        client.completions.create(model="tiny_lm", prompt="The mat", max_tokens=CONTEXT - 9, temperature=0)
    [path] = log_dir.glob("requests-tiny_lm-*.tfrecord")
    return path


def read_log(path: Path) -> list:
    return [prediction_log_pb2.PredictionLog.FromString(raw) for raw in tf.data.TFRecordDataset(str(path))
            .as_numpy_iterator()]


def write_log(records: list, path: Path) -> Path:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record.SerializeToString())
    return path


def generated_tokens(records: list, greedy_only: bool = False) -> int:
    """Every id the server generated (EOS included, PAD after it left out)."""
    return sum(int(np.sum(tf.make_ndarray(r.predict_log.response.outputs["ids"]) != tokenizers.PAD)) for r in records
               if not greedy_only or float(tf.make_ndarray(r.predict_log.request.inputs["temperature"])) == 0)


def test_a_served_language_models_log_is_within_the_tolerance_step_by_step(exported, served_log, tmp_path, capsys):
    records = read_log(served_log)
    assert len(records) == 5 and {r.predict_log.request.model_spec.signature_name for r in records} == {"generate"}
    output = tmp_path / "audit"
    code = cli.main(["audit", str(exported), "--log", str(served_log), "--output", str(output)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((output / "report.json").read_text())
    assert report["task"] == "language_model" and report["requests"] == 5 and report["rows"] == 9  # prompts
    version = report["versions"]["1"]
    logits = version["outputs"]["logits"]
    assert version["served_policy"] == "mixed_float16" and version["tolerance"] == 0.05
    assert logits["rows"] == version["rows"] == generated_tokens(records)  # one compared row per generated step
    assert 0 < logits["max_rel_diff"] <= 0.05 and logits["rows_beyond_tolerance"] == 0  # float16 is never exact
    assert version["argmax_agreement"] >= version["min_argmax_agreement"] == 0.98
    replay = version["replay"]
    assert replay["greedy_tokens"] == generated_tokens(records, greedy_only=True) > 0
    assert replay["tokens_beyond_tolerance"] == 0 and replay["max_gap"] <= 0.05
    assert version["parity_json"]["max_abs_diff_per_output"]["logits"] > 0
    assert (output / "audit.png").is_file() and not (output / REPRODUCERS_FILE).exists()
    assert (output / "reference" / "tiny_lm" / "1" / "saved_model.pb").is_file()
    assert "OK: every logged answer within the tolerance" in out and "PASS  replay" in out


def test_a_prompt_longer_than_the_context_is_replayed_as_generate_kept_it(exported, generate_log, tmp_path):
    """The version's own generate signature on a prompt of 3 contexts (BOS and its last tokens kept): a log of
    it replays with every greedy token the served model's own choice, which it is only at the kept positions."""
    prompts = [("The cat sat on the mat. " * 4).encode(), b"A dog"]
    log = generate_log(exported / "1", "tiny_lm", [{"prompts": prompts, "max_new_tokens": 6, "temperature": 0.0,
                                                     "top_k": 0, "seed": 0}], tmp_path / "long.tfrecord")
    found = audit(exported, [str(log)], output=tmp_path / "audit")
    replay = found["versions"]["1"]["replay"]
    assert found["ok"] and replay["greedy_tokens"] == generated_tokens(read_log(log)) > 0
    assert replay["max_gap"] <= 0.05


def test_a_log_whose_ids_were_altered_fails_the_replay_naming_the_token(exported, served_log, tmp_path, capsys):
    records = read_log(served_log)
    ids = tf.make_ndarray(records[0].predict_log.response.outputs["ids"])  # the first greedy gRPC call
    ids[1, 2] = ord("Q") if ids[1, 2] != ord("Q") else ord("Z")
    records[0].predict_log.response.outputs["ids"].CopyFrom(tf.make_tensor_proto(ids))
    log = write_log(records, tmp_path / "altered.tfrecord")
    output = tmp_path / "audit"
    assert cli.main(["audit", str(exported), "--log", str(log), "--output", str(output)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  replay" in out and f"record 0 row 1 step 2: logged token {ids[1, 2]}," in out, out
    assert "FAILED: version 1 beyond the tolerance" in out
    reproducers = json.loads((output / "reproducers.json").read_text())
    assert {(r["output"], r["record"], r["row"], r["step"]) for r in reproducers} >= {("replay", 0, 1, 2)}
    [kept] = read_log(output / REPRODUCERS_FILE)  # the altered record itself: re-audit it
    assert kept == records[0]


def test_a_saved_model_whose_weights_were_perturbed_fails_on_its_logits(exported, served_log, tmp_path, capsys):
    """The served SavedModel's weights moved after export: the float32 twin (rebuilt from the run) disagrees with
    every logged step far beyond the tolerance."""
    base = tmp_path / "tiny_lm"
    shutil.copytree(exported / "1" / "assets.extra", base / "1" / "assets.extra")  # pipeline.json, parity.json
    loaded = tf.saved_model.load(str(exported / "1"))
    rng = np.random.default_rng(0)
    for variable in loaded.model_variables:
        if variable.shape.rank == 2:
            variable.assign(variable + rng.normal(0, 0.3, variable.shape).astype(variable.dtype.as_numpy_dtype))
    tf.saved_model.save(loaded, str(base / "1"), signatures=dict(loaded.signatures))
    code = cli.main(["audit", str(base), "--log", str(served_log), "--output", str(tmp_path / "audit")])
    out = capsys.readouterr().out
    assert code == 1, out
    line = next(line for line in out.splitlines() if line.strip().startswith("FAIL  logits"))
    assert "generated steps beyond the tolerance" in line and "FAILED: version 1 beyond the tolerance" in out
    assert (tmp_path / "audit" / REPRODUCERS_FILE).is_file()


def test_a_log_with_no_generate_call_to_replay_fails_saying_what_was_skipped(exported, served_log, tmp_path, capsys):
    records = read_log(served_log)
    for record in records:
        record.predict_log.request.model_spec.signature_name = "serving_default"
    log = write_log(records, tmp_path / "not_generate.tfrecord")
    assert cli.main(["audit", str(exported), "--log", str(log), "--output", str(tmp_path / "audit")]) == 1
    out = capsys.readouterr().out
    assert "FAIL  no generated step of this version could be replayed" in out
    assert "not replayed: predict_log (not a generate call) 5" in out, out


def test_against_the_served_policy_the_logits_agree_within_the_exports_parity_tolerance(exported, served_log,
                                                                                          tmp_path):
    """--against mixed_float16: the reference computes as the served graph does, so it is held to
    export.parity_tolerance (the SavedModel against the Keras model it was exported from)."""
    found = audit(exported, [str(served_log)], against="mixed_float16", output=tmp_path / "audit")
    version = found["versions"]["1"]
    assert version["tolerance_source"] == "export.parity_tolerance (same compute dtype)"
    assert found["ok"] and version["outputs"]["logits"]["max_rel_diff"] <= version["tolerance"] == 1e-5
    assert version["argmax_agreement"] == 1.0
