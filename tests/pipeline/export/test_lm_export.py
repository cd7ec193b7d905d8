"""The export of a language model (model.kind causal_lm): a tiny model (1 block, width 16, context 32) trained for
one short epoch under mixed_float16, exported through `python -m pipeline export`: both signatures, pipeline.json's
language-model facts, the parity gate passing and failing in one line, a bfloat16-weights export with half the
bytes in its weights (embeddings included) and its cache and its recorded greedy agreement with float32, the op-set
check, verify, the refusals of the verbs built for rows, and the demo end to end."""

import json

import keras
import pytest
import tensorflow as tf

from pipeline import cli, precision
from pipeline.lm import causal_lm, generate
from pipeline.config import load_config
from pipeline.export import lm, lm_parity
from pipeline.verify import verify

pytestmark = pytest.mark.timeout(300)



@pytest.fixture(scope="module")
def workspace(tiny_lm_export):
    """The shared tiny model's folder and config file; its trained run is runs/tiny_lm/."""
    return tiny_lm_export.root, tiny_lm_export.config


def export(workspace, capsys, *more):
    """`python -m pipeline export` with overrides; returns (exit code, stdout, stderr)."""
    root, config = workspace
    code = cli.main(["export", str(config), "--force", *[arg for item in more for arg in ("--set", item)]])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


@pytest.fixture(scope="module")
def exported(tiny_lm_export):
    """The export under the trained policy (the session's, made by `python -m pipeline export`)."""
    return tiny_lm_export.version_dir


def test_export_writes_both_signatures_and_the_language_model_facts(exported):
    facts = json.loads((exported / "assets.extra" / "pipeline.json").read_text())
    assert facts["task"] == "language_model" and facts["serving_policy"]["name"] == "mixed_float16"
    assert facts["signatures"]["serving_default"]["inputs"] == {"ids": {"dtype": "int32", "shape": [None, None]}}
    assert facts["signatures"]["serving_default"]["outputs"]["logits"]["dtype"] == "float32"
    assert set(facts["signatures"]["generate"]["outputs"]) == {"completions", "ids", "lengths", "log_probs"}
    language_model = facts["language_model"]
    assert language_model["tokenizer"]["special_ids"] == {"pad": 256, "bos": 257, "eos": 258}
    assert language_model["context_length"] == 32
    # keys and values, 1 layer, width 16, float16: the compute dtype of mixed_float16
    assert language_model["kv_cache"] == {"dtype": "float16", "layers": 1, "width": 16, "bytes_per_token": 64,
                                          "bytes_per_sequence": 64 * 32}
    assert facts["metrics"]["val_nats_per_byte"] > 0 and facts["config"]["model"]["kind"] == "causal_lm"
    # The recorded sample is what the SavedModel's generate answers.
    sample = language_model["sample"]
    loaded = tf.saved_model.load(str(exported))
    again = lm_parity.greedy(loaded.signatures["generate"], [sample["prompt"].encode()], sample["max_new_tokens"])
    assert again["ids"][0, :again["lengths"][0]].tolist() == sample["ids"]
    logits = loaded.signatures["serving_default"](ids=tf.constant([[causal_lm.BOS, 84, 104, 101]]))["logits"]
    assert logits.dtype == tf.float32 and logits.shape == (1, 4, causal_lm.VOCAB_SIZE)


def test_the_gate_passes_and_is_recorded(exported):
    report = json.loads((exported / "assets.extra" / "parity.json").read_text())
    assert report["passed"] and report["task"] == "language_model"
    checks = {(c["kind"], c["path"]): c for c in report["checks"]}
    assert set(checks) == {("teacher forcing", "trained"), ("teacher forcing", "saved_model"),
                           ("cache", "float32 cached"), ("generate", "saved_model generate"),
                           ("stepped", "saved_model prefill + decode_step"),
                           ("frozen weights", "saved_model stepped, TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1")}
    trained = checks["teacher forcing", "trained"]
    assert trained["reference"] == "float32" and 0 < trained["max_rel_diff"] <= 0.05  # mixed_float16 rounds a little
    assert trained["positions"] == report["windows"] * 32
    assert checks["teacher forcing", "saved_model"]["max_abs_diff"] == 0  # the same graph
    cache = checks["cache", "float32 cached"]
    assert cache["identical_tokens"] and cache["max_log_prob_diff"] <= 1e-5 and cache["tokens"] == 32 - 1 - 8
    assert checks["generate", "saved_model generate"]["identical_tokens"]
    assert checks["stepped", "saved_model prefill + decode_step"]["identical_tokens"]
    # the server's switch (serving/frozen_weights.py), checked in a child process; this export serves its trained
    # mixed_float16, whose float16 compute is held to 0.05
    frozen = checks["frozen weights", "saved_model stepped, TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1"]
    assert frozen["passed"] and frozen["tokens"] == 32 - 1 - 8 and frozen["max_log_prob_diff"] <= 0.05


def test_the_op_set_is_core_tensorflow(exported):
    assert generate.saved_model_op_types(exported) <= generate.SERVING_OPS


def test_a_perturbed_saved_model_weight_fails_the_gate_in_one_line(workspace, capsys, monkeypatch):
    root, _ = workspace
    real_save = generate.save

    def perturbed(generator, path):
        kernel = generator.model.get_layer("block_1").mlp_2.kernel
        original = kernel.numpy()
        kernel.assign(original + 0.5)
        try:
            real_save(generator, path)
        finally:
            kernel.assign(original)

    monkeypatch.setattr(lm.generate, "save", perturbed)
    code, out, err = export(workspace, capsys, f"export.base_path={root / 'perturbed'}")
    assert code == 1 and "\n" not in err and not out
    assert err.startswith("error: parity gate failed: saved_model vs trained (teacher forcing): max rel diff")
    assert "nothing was published" in err
    assert not (root / "perturbed" / "tiny_lm").exists() or not any((root / "perturbed" / "tiny_lm").iterdir())
    rejected = json.loads((root / "runs" / "tiny_lm" / "parity-rejected.json").read_text())
    assert not rejected["passed"]


def test_a_cache_that_disagrees_with_recompute_fails_the_gate(workspace, capsys, monkeypatch):
    """A stand-in `recompute` from another (untrained) model: other tokens, so the cache check must fail."""
    root, _ = workspace

    def other_model(model, tokenizer):
        keras.utils.set_random_seed(7)
        with precision.policy_scope("float32"):
            stranger = causal_lm.build_causal_lm(context_length=32, num_layers=1, num_heads=2, width=16, mlp_width=32)
        return generate.Generator(stranger).generate

    monkeypatch.setattr(lm.generate, "recompute_generate", other_model)
    code, _, err = export(workspace, capsys, f"export.base_path={root / 'cache'}")
    assert code == 1 and "\n" not in err
    assert "float32 cached vs float32 recomputed (cache): greedy tokens differ from step" in err


def test_an_op_outside_the_core_set_fails_the_export_in_one_line(workspace, capsys, monkeypatch):
    root, _ = workspace
    monkeypatch.setattr(lm.generate, "SERVING_OPS", generate.SERVING_OPS - {"TopKV2"})
    code, _, err = export(workspace, capsys, f"export.base_path={root / 'ops'}")
    assert code == 1 and "\n" not in err
    assert "ops outside the core set tensorflow_model_server runs: TopKV2; nothing was published" in err


def test_a_bfloat16_export_halves_the_blocks_weights_and_the_cache(workspace, capsys):
    root, _ = workspace
    base = root / "precisions"
    for policy in ("float32", "bfloat16"):
        code, _, err = export(workspace, capsys, f"export.base_path={base}", f"export.serving_policy={policy}")
        assert code == 0, err
    float32, bfloat16 = (json.loads((base / "tiny_lm" / v / "assets.extra" / "pipeline.json").read_text())
                         for v in ("1", "2"))
    assert float32["weights"]["bytes_by_dtype"].keys() == {"float32"}
    weights = bfloat16["weights"]["bytes_by_dtype"]
    # Everything but the norms is stored in bfloat16, the embedding table and the positions included: half the bytes.
    assert weights["bfloat16"] * 2 + weights["float32"] == float32["weights"]["bytes_by_dtype"]["float32"]
    # the block's four 16x16 attention projections, 16x32 and 32x16 MLP, with biases (2,160 values), the 260x16
    # embedding table (259 ids and the row of stray ids) and the 32x16 positions, 2 bytes each
    assert weights["bfloat16"] == 2 * (4 * (16 * 16 + 16) + (16 * 32 + 32) + (32 * 16 + 16) + 260 * 16 + 32 * 16)
    assert weights["float32"] == 4 * 3 * (16 + 16)  # norm_1, norm_2 and final_norm: gamma and beta
    cache32, cache16 = float32["language_model"]["kv_cache"], bfloat16["language_model"]["kv_cache"]
    assert cache16["dtype"] == "bfloat16" and cache16["bytes_per_token"] * 2 == cache32["bytes_per_token"]
    report = json.loads((base / "tiny_lm" / "2" / "assets.extra" / "parity.json").read_text())
    serving = next(c for c in report["checks"] if c["path"] == "serving")
    assert serving["passed"] and serving["tolerance"]["policy"] == "bfloat16"
    # the recorded agreements (not judged): float32 against itself is 1.0 both ways, bfloat16 is a share
    for version, policy in (("1", "float32"), ("2", "bfloat16")):
        facts = json.loads((base / "tiny_lm" / version / "assets.extra" / "pipeline.json").read_text())
        agreement = facts["parity"]["greedy_agreement_vs_float32"]
        assert agreement["policy"] == policy and agreement["judged"] is False
        assert agreement["prompts"] == report["windows"] and agreement["steps"] == 32 - 1 - 8
        assert set(agreement) >= {"same_prefix", "free_running"}
        if policy == "float32":
            assert agreement["same_prefix"]["agreement"] == agreement["free_running"]["agreement"] == 1.0
        else:
            assert all(0 <= agreement[way]["agreement"] <= 1 for way in ("same_prefix", "free_running"))
            assert agreement == report["greedy_agreement_vs_float32"]


def test_verify_passes_the_language_model_checks(exported):
    report = verify(exported)
    statuses = {check.name: check.status for check in report.checks}
    assert report.ok, report.text()
    for name in ("signature serving_default", "signature generate", "policy", "weights", "op set", "runner",
                 "generate"):
        assert statuses[name] == "PASS", report.text()


def test_verify_fails_when_the_recorded_sample_is_not_what_generate_answers(exported, tmp_path):
    import shutil

    copy = tmp_path / "tiny_lm" / "1"
    shutil.copytree(exported, copy)
    path = copy / "assets.extra" / "pipeline.json"
    facts = json.loads(path.read_text())
    facts["language_model"]["sample"]["ids"] = [ord("x")] * facts["language_model"]["sample"]["max_new_tokens"]
    path.write_text(json.dumps(facts))
    report = verify(copy)
    assert not report.ok and {c.name for c in report.checks if c.status == "FAIL"} == {"generate"}


def test_predict_refuses_a_causal_lm_config_in_one_line(workspace, capsys):
    _, config = workspace
    assert cli.main(["predict", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: predict does not take a language model (model.kind causal_lm)")


def test_score_refuses_a_language_model_export_in_one_line(exported, capsys):
    assert cli.main(["score", str(exported), "--input", "x", "--output", "y"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not take a language model" in err


@pytest.mark.subprocess
def test_the_demo_serves_the_greedy_completion_equal_to_in_process(workspace, capsys):
    """make demo with the tiny config: its run is finished (train resumes nothing), so this is export, the server
    in a child process, one gRPC Predict on generate, one completion streamed as Server-Sent Events, and the
    comparison."""
    from pipeline.demo import run_demo

    root, config = workspace
    cfg = load_config(str(config), [f"export.base_path={root / 'demo'}"])
    result = run_demo(cfg)
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.strip().splitlines()[-4:]]
    assert lines[0].startswith("in-process: 'The ") and lines[1].startswith("over gRPC:  'The ")
    assert lines[2].startswith("streamed:   'The ")
    assert lines[0].split(":", 1)[1].strip() == lines[1].split(":", 1)[1].strip() and lines[3].startswith("equal (")
    assert result["greedy_tokens"] > 0


def test_the_export_has_a_generate_warmup_record_that_the_server_replays(exported):
    from serving.servable import warmup
    from serving.servable.runner import Runner

    runner = Runner.load(exported)
    try:
        assert warmup.run_warmup(runner, exported) == 1  # the generate record (and the decode protocol, run once)
    finally:
        runner.close()
