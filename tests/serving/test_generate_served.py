"""Issue 29's generate signature served by `python -m serving`, called as any TF Serving client would: gRPC
Predict with a stock tensorflow-serving-api request and REST predict, strings in and out. Greedy answers equal
the in-process generation, and two sampled calls with the same seed equal each other. With batching on, the
signature (scalar inputs beside the prompts) runs unbatched rather than failing, as TF Serving runs a request
that matches none of its batch queues."""

from __future__ import annotations

import base64
import json
import urllib.request

import keras
import numpy as np
import pytest
import tensorflow as tf

from lm_helpers import grpc_generate
from pipeline.lm import causal_lm, generate

pytestmark = [pytest.mark.timeout(300), pytest.mark.subprocess]
PROMPTS = ["Once upon a time", "é"]


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(4)
    model = causal_lm.build_causal_lm(context_length=64, num_layers=1, num_heads=2, width=16, mlp_width=32)
    base = tmp_path_factory.mktemp("lm") / "lm"
    generated = generate.Generator(model)
    generate.save(generated, base / "1")
    return generated, base


@pytest.fixture(scope="module")
def served(generator, start_server, tmp_path_factory):
    """The server under oneDNN's frozen weights (serving/frozen_weights.py), so the answers below hold for it too."""
    _, base = generator
    with pytest.MonkeyPatch.context() as patch:  # the child inherits it; this process was started without
        patch.setenv("TF_ONEDNN_ASSUME_FROZEN_WEIGHTS", "1")
        server = start_server("--model_name=lm", f"--model_base_path={base}", "--rest_api_port=-1",
                              "--enable_batching", log_dir=tmp_path_factory.mktemp("lm_server"))
    yield server
    assert server.stop() == 0, server.stderr_tail()


def in_process(generated, temperature=0.0, seed=0) -> dict[str, np.ndarray]:
    outputs = generated.generate(tf.constant(PROMPTS), tf.constant(12), tf.constant(temperature), tf.constant(0),
                                 tf.constant(seed, tf.int64))
    return {name: value.numpy() for name, value in outputs.items()}


def test_greedy_generation_over_grpc_equals_in_process(generator, served):
    generated, _ = generator
    want, got = in_process(generated), grpc_generate(served.address, PROMPTS, 12)
    assert set(got) == {"completions", "ids", "lengths", "log_probs"}
    for name in ("completions", "ids", "lengths"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got["log_probs"].dtype == np.float32
    np.testing.assert_allclose(got["log_probs"], want["log_probs"], atol=1e-6, rtol=0)


def test_the_server_says_it_decodes_with_onednn_frozen_weights(served):
    """The answers in this module come from a server whose oneDNN keeps weights pre-packed: its start-up line."""
    assert "oneDNN keeps weights pre-packed (TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1" in served.stderr_path.read_text()


def test_sampling_over_grpc_repeats_with_the_seed(generator, served):
    first, again = (grpc_generate(served.address, PROMPTS, 12, 0.9, seed=5),
                    grpc_generate(served.address, PROMPTS, 12, 0.9, seed=5))
    np.testing.assert_array_equal(first["ids"], again["ids"])
    np.testing.assert_array_equal(first["ids"], in_process(generator[0], 0.9, seed=5)["ids"])


def test_generation_over_rest_equals_in_process(generator, served):
    body = {"signature_name": "generate", "inputs": {"prompts": PROMPTS, "max_new_tokens": 12, "temperature": 0.0,
                                                    "top_k": 0, "seed": 0}}
    request = urllib.request.Request(f"http://{served.rest_address}/v1/models/lm:predict",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        outputs = json.loads(response.read())["outputs"]
    want = in_process(generator[0])
    assert outputs["ids"] == want["ids"].tolist() and outputs["lengths"] == want["lengths"].tolist()
    # text where it is UTF-8, {"b64": ...} where it is not (an untrained model's bytes seldom are)
    as_bytes = [base64.b64decode(item["b64"]) if isinstance(item, dict) else item.encode()
                for item in outputs["completions"]]
    assert as_bytes == want["completions"].tolist()


# ---- a sentencepiece language model: pipeline.json says its graph needs TF Text's ops ----

@pytest.fixture(scope="module")
def sentencepiece_generator(tmp_path_factory):
    from pipeline.lm import tokenizers
    from pipeline.data.text import embedded_corpus

    texts = [document.text for document in embedded_corpus()[::10]]
    tokenizer = tokenizers.SentencePieceTokenizer(tokenizers.train_sentencepiece(texts, 400))
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(4)
    model = causal_lm.build_causal_lm(tokenizer.vocab_size, context_length=64, num_layers=1, num_heads=2, width=16,
                                      mlp_width=32)
    base = tmp_path_factory.mktemp("sp") / "lm"
    generated = generate.Generator(model, tokenizer=tokenizer)
    generate.save(generated, base / "1")
    from pipeline.export.lm import language_model_facts

    (base / "1" / "assets.extra").mkdir()  # what the export writes about the tokenizer: the decode loop pads with it
    (base / "1" / "assets.extra" / "pipeline.json").write_text(json.dumps(
        {"op_libraries": ["tensorflow_text"], "language_model": language_model_facts(model, tokenizer)}))
    return generated, base


def test_a_sentencepiece_generate_is_served_over_grpc_as_in_process(sentencepiece_generator, start_server,
                                                                    tmp_path_factory):
    generated, base = sentencepiece_generator
    server = start_server("--model_name=lm", f"--model_base_path={base}", "--rest_api_port=-1",
                          log_dir=tmp_path_factory.mktemp("sp_server"))
    try:
        want, got = in_process(generated), grpc_generate(server.address, PROMPTS, 12)
        for name in ("completions", "ids", "lengths"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert not np.isin(got["ids"], [1, 3]).any()  # never bos or unk
    finally:
        assert server.stop() == 0, server.stderr_tail()


def test_the_server_imports_tf_text_only_for_a_version_whose_pipeline_json_asks(sentencepiece_generator, tmp_path):
    import shutil
    import subprocess
    import sys

    _, base = sentencepiece_generator
    bare = tmp_path / "bare" / "1"
    shutil.copytree(base / "1", bare)
    (bare / "assets.extra" / "pipeline.json").unlink()
    script = ("import sys\nfrom serving.servable.runner import Runner, LoadError\n"
              "assert 'tensorflow_text' not in sys.modules\n"
              "try:\n    Runner.load(sys.argv[1])\nexcept LoadError as error:\n    print('refused:', error)\n"
              "assert 'tensorflow_text' not in sys.modules\n"
              "runner = Runner.load(sys.argv[2])\nprint('loaded:', runner.signature_names, "
              "'tensorflow_text' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script, str(bare), str(base / "1")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "SentencepieceOp" in done.stdout
    loaded = done.stdout.split("loaded: ", 1)[1]
    assert "'generate'" in loaded and loaded.strip().endswith("True")


def test_without_tensorflow_text_a_version_that_needs_it_is_one_line_naming_the_package(monkeypatch, tmp_path):
    import sys

    from serving.errors import LoadError
    from serving.servable import saved_model

    monkeypatch.setitem(sys.modules, "tensorflow_text", None)  # what an import of a missing package does
    with pytest.raises(LoadError, match=r"needs the ops of tensorflow-text \(tensorflow_text\), which is not "
                                        r"installed here .*; pip install tensorflow-text") as info:
        saved_model.load_op_libraries({"op_libraries": ["tensorflow_text"]}, tmp_path)
    assert "\n" not in str(info.value)
    with pytest.raises(LoadError, match=r"op_libraries names 'os', which this server does not load"):
        saved_model.load_op_libraries({"op_libraries": ["os"]}, tmp_path)
    saved_model.load_op_libraries({"task": "classification"}, tmp_path)  # nothing asked, nothing imported
