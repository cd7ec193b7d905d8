"""A run from a pretrained GPT-2 checkpoint (model.init_from + data.tokenizer gpt2, docs/pretrained.md), end to end:
a fresh run starts from the checkpoint's weights and records its tokenizer, the export encodes with GPT-2's BPE
inside its graph (core ops, the export's own gates passed), a server answers completions with it, and a resumed run
keeps its own weights. The checkpoint is a tiny random one (gpt2.write_random: GPT-2's first 200 merges)."""

import http.client
import json
import logging
import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from lm_helpers import write_texts
from pipeline import cli
from pipeline.config import load_config
from pipeline.lm import bpe, causal_lm, gpt2
from pipeline.lm.safetensors_file import TensorFile
from pipeline.train import train
from serving.app import ServerThread, build
from serving.flags import parse

pytestmark = pytest.mark.timeout(300)
CONTEXT = 64


def write_checkpoint(directory: Path, seed: int = 43) -> Path:
    """A tiny random GPT-2 with the pipeline's 457-id vocabulary (what `gpt2-checkpoint --output` writes)."""
    return gpt2.write_random(directory, num_layers=2, width=32, num_heads=4, context_length=CONTEXT, seed=seed)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The checkpoint, and one epoch from it at learning rate 1e-12 (so the trained weights are its own within
    1e-9), exported."""
    root = tmp_path_factory.mktemp("pretrained")
    checkpoint = write_checkpoint(root / "checkpoint")
    config = root / "gpt2.yaml"
    config.write_text(load_config(None, [
        "experiment=tiny_gpt2", "data.source=text", f"data.path={write_texts(root / 'texts')}/*.txt",
        "data.tokenizer=gpt2", "data.sequence_length=32", "data.validation_split=0.25", "model.kind=causal_lm",
        f"model.init_from={checkpoint}", "precision.policy=mixed_bfloat16", "train.epochs=1", "train.batch_size=16",
        "train.optimizer=sgd", "train.learning_rate=1e-12", f"train.runs_dir={root / 'runs'}",
        f"export.base_path={root / 'models'}"]).to_yaml())
    train(load_config(str(config)))
    keras.config.set_dtype_policy("float32")
    assert cli.main(["export", str(config)]) == 0
    return root, checkpoint, config


def test_a_fresh_run_starts_from_the_checkpoints_weights(run):
    root, checkpoint, _ = run
    trained = keras.saving.load_model(root / "runs" / "tiny_gpt2" / "model.keras", compile=False)
    gpt2.save(trained, root / "written_back")
    original, written = (TensorFile(d / gpt2.WEIGHTS_FILE) for d in (checkpoint, root / "written_back"))
    assert sorted(written.names()) == sorted(original.names())
    for name in original.names():  # a random start would be ~0.02 away
        np.testing.assert_allclose(written.read(name), original.read(name), rtol=0, atol=1e-9, err_msg=name)


def test_the_run_records_the_checkpoints_tokenizer(run):
    root, checkpoint, _ = run
    for name in (bpe.VOCAB_FILE, bpe.MERGES_FILE):
        assert (root / "runs" / "tiny_gpt2" / "data" / name).read_bytes() == (checkpoint / name).read_bytes()


def test_the_export_tokenizes_with_gpt2s_bpe_inside_its_graph(run):
    root, checkpoint, config = run
    version = root / "models" / "tiny_gpt2" / "1"
    facts = json.loads((version / "assets.extra" / "pipeline.json").read_text())["language_model"]
    assert facts["tokenizer"]["kind"] == "gpt2" and facts["tokenizer"]["special_ids"] == {"pad": 457, "bos": 456,
                                                                                         "eos": 456}
    assert facts["context_length"] == CONTEXT
    loaded = tf.saved_model.load(str(version))
    ids = loaded.signatures["tokenize"](prompts=tf.constant(["hello world", "it's  2026"]))["ids"].numpy()
    expected = bpe.read(checkpoint).encode(tf.constant(["hello world", "it's  2026"])).to_list()
    assert [row[1:1 + len(e)].tolist() for row, e in zip(ids, expected)] == expected and (ids[:, 0] == 456).all()
    assert cli.main(["verify", str(version)]) == 0  # the op set among its checks: core ops only


def test_a_server_completes_with_it_and_counts_its_tokens(run):
    root, checkpoint, _ = run
    options = parse(["--model_name=lm", f"--model_base_path={root / 'models' / 'tiny_gpt2'}", "--port=0",
                     "--rest_api_port=-1"])
    with ServerThread(options, build(options)) as server:
        connection = http.client.HTTPConnection(server.rest_address, timeout=60)
        prompt = "héllo wörld 😀"
        connection.request("POST", "/openai/v1/completions", json.dumps(
            {"model": "lm", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}))
        answer = json.loads(connection.getresponse().read())
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        prompt_ids = len(bpe.read(checkpoint).encode(tf.constant([prompt])).to_list()[0])
        assert answer["usage"]["prompt_tokens"] == prompt_ids + 1  # and <|endoftext|> before it
        assert len(tokens) == prompt_ids + 4 and answer["choices"][0]["text"].startswith(prompt)
        connection.request("POST", "/openai/v1/completions", json.dumps(
            {"model": "lm", "prompt": "x " * 40, "max_tokens": 40}))
        response = connection.getresponse()
        assert response.status == 400 and "maximum context length is 64 tokens" in response.read().decode()


def test_a_resumed_run_keeps_its_own_weights(run, tmp_path, caplog):
    """The run resumes from its checkpoint, never from model.init_from again: the checkpoint's weights are changed on
    disk (same shapes) for the resume, and the resumed run's stay the run's."""
    root, checkpoint, config = run
    shutil.copytree(root / "runs" / "tiny_gpt2", tmp_path / "runs" / "tiny_gpt2")
    weights = checkpoint / gpt2.WEIGHTS_FILE
    own = TensorFile(weights).read("transformer.h.0.mlp.c_fc.weight").copy()
    kept = tmp_path / "kept.safetensors"
    shutil.copy(weights, kept)
    changed = write_checkpoint(tmp_path / "changed", seed=7)
    try:
        shutil.copy(changed / gpt2.WEIGHTS_FILE, weights)
        with caplog.at_level(logging.INFO, logger="pipeline.train.run"):
            train(load_config(str(config), [f"train.runs_dir={tmp_path / 'runs'}", "train.epochs=2"]))
    finally:
        shutil.copy(kept, weights)  # the module's checkpoint as it was
    assert "resuming from" in caplog.text and "model.init_from: the weights" not in caplog.text
    trained = keras.saving.load_model(tmp_path / "runs" / "tiny_gpt2" / "model.keras", compile=False)
    kernel = np.asarray(causal_lm.blocks(trained)[0].mlp_1.kernel)
    np.testing.assert_allclose(kernel, own, rtol=0, atol=1e-9)  # learning rate 1e-12: still the run's
    assert np.abs(kernel - TensorFile(changed / gpt2.WEIGHTS_FILE).read("transformer.h.0.mlp.c_fc.weight")).max() > 0.01


def test_the_cli_writes_a_random_checkpoint_and_a_trained_run_back(run, tmp_path, capsys):
    root, checkpoint, config = run
    assert cli.main(["gpt2-checkpoint", "--output", str(tmp_path / "random"), "--layers", "1", "--width", "16",
                     "--heads", "2", "--context", "32"]) == 0
    written = gpt2.read_config(tmp_path / "random")
    assert (written.num_layers, written.width, written.num_heads, written.context_length, written.vocab_size,
            written.activation, written.tied_embeddings) == (1, 16, 2, 32, 457, "gelu_tanh", True)
    assert bpe.read(tmp_path / "random").vocab_size == 457 and gpt2.load(tmp_path / "random") is not None
    assert cli.main(["gpt2-checkpoint", "--output", str(tmp_path / "random")]) == cli.EXIT_BAD_INPUT
    assert "exists; a checkpoint is written to a new directory" in capsys.readouterr().err

    assert cli.main(["gpt2-checkpoint", str(config), "--output", str(tmp_path / "back")]) == 0
    back, original = (TensorFile(d / gpt2.WEIGHTS_FILE) for d in (tmp_path / "back", checkpoint))
    np.testing.assert_allclose(back.read("transformer.wte.weight"), original.read("transformer.wte.weight"),
                               rtol=0, atol=1e-9)
    for name in (bpe.VOCAB_FILE, bpe.MERGES_FILE):
        assert (tmp_path / "back" / name).read_bytes() == (checkpoint / name).read_bytes()


def test_a_damaged_checkpoint_stops_train_with_one_line_and_exit_2(run, tmp_path, capsys):
    """A stranger's file: its header claims more bytes than the file holds. Nothing is trained or written."""
    _, checkpoint, config = run
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    data = (damaged / gpt2.WEIGHTS_FILE).read_bytes()
    (damaged / gpt2.WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    code = cli.main(["train", str(config), "--set", f"model.init_from={damaged}", "--set",
                     f"train.runs_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_BAD_INPUT and "\n" not in err and "Traceback" not in err
    assert err.startswith(f"error: {damaged / gpt2.WEIGHTS_FILE}: the tensors end at byte") and "truncated" in err
    assert not (tmp_path / "runs" / "tiny_gpt2" / "model.keras").exists()


def test_a_float16_export_of_it_passes_its_gates_and_verify(run):
    """The serving policies a causal_lm run has: float16 weights and compute, the BPE the same core ops."""
    root, _, config = run
    assert cli.main(["export", str(config), "--set", "export.serving_policy=float16", "--force"]) == 0
    version = max((root / "models" / "tiny_gpt2").iterdir(), key=lambda path: int(path.name))
    metadata = json.loads((version / "assets.extra" / "pipeline.json").read_text())
    assert metadata["serving_policy"]["name"] == "float16"
    assert metadata["language_model"]["kv_cache"]["dtype"] == "float16"
    assert cli.main(["verify", str(version)]) == 0
