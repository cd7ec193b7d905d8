"""The language model's tokenizers (pipeline/lm/tokenizers.py): bytes and sentencepiece round-trip UTF-8 eagerly and in a
graph, sentencepiece trains deterministically with byte fallback (no unknown ids), refuses a size the text cannot
reach in one line, is reused from the run's data directory only for the same text and size, and a model with it
saves a SavedModel whose generate runs in a fresh process (strings in and out, the proto inside)."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline.lm import causal_lm, generate, tokenizers
from pipeline.data.text import embedded_corpus
from pipeline.errors import DataError
from pipeline.lm.tokenizers import BOS, EOS, PAD

pytestmark = pytest.mark.timeout(120)

TEXTS = ["plain ASCII, with punctuation!", "héllo wörld — 世界 🙂", "", "nul\x00inside",
         "tabs\tand\nnew lines, runs of   spaces  ", "never seen: ᚠᛇᚻ ∮ ǅ 🧬👩‍👩‍👧 \U0010FFFF", "\r\n\x7f"]


@pytest.fixture(scope="module")
def training_texts():
    """A tenth of the embedded corpus (the topics sorted by name): enough text for 512 ids."""
    return [document.text for document in embedded_corpus()[::10]]


@pytest.fixture(scope="module")
def sentencepiece(training_texts):
    return tokenizers.SentencePieceTokenizer(tokenizers.train_sentencepiece(training_texts, 512))


# ---- bytes ----

def test_bytes_round_trip_utf8_in_python_and_in_a_graph():
    padded, lengths = tokenizers.BYTES.encode_padded(TEXTS)
    assert lengths.numpy().tolist() == [len(text.encode()) for text in TEXTS]
    assert [row[:n].tolist() for row, n in zip(padded.numpy(), lengths.numpy())] == [list(t.encode()) for t in TEXTS]
    assert padded.numpy()[2].tolist() == [PAD] * padded.shape[1]  # the empty string: padding only
    assert [text.decode() for text in tokenizers.BYTES.decode(padded).numpy()] == TEXTS

    round_trip = tf.function(lambda texts: tokenizers.BYTES.decode(tokenizers.BYTES.encode_padded(texts)[0]),
                             input_signature=[tf.TensorSpec([None], tf.string)])
    assert [text.decode() for text in round_trip(tf.constant(TEXTS)).numpy()] == TEXTS
    assert round_trip(tf.constant([], tf.string)).numpy().tolist() == []


def test_the_bytes_tokenizers_declared_prompt_tokens_are_what_its_tokenize_signature_counts():
    """pipeline.json declares prompt_tokens (per_byte * n + added) so a server can check the context without a
    tokenize call; sentencepiece declares none (its normalizer may take more tokens than bytes)."""
    keras.utils.set_random_seed(0)
    model = causal_lm.build_causal_lm(context_length=16, num_layers=1, num_heads=2, width=8, mlp_width=8)
    prompts = [b"", b"a", "h\u00e9llo \u4e16\u754c".encode(), b"\xff\xfe not utf-8", b"x" * 300]
    counted = generate.Generator(model).tokenize(tf.constant(prompts))["prompt_tokens"].numpy()
    rule = tokenizers.BYTES.facts()["prompt_tokens"]
    assert counted.tolist() == [rule["per_byte"] * len(prompt) + rule["added"] for prompt in prompts]


def test_bytes_decode_drops_special_ids_and_keeps_bytes_that_are_not_utf8():
    cut = "é".encode()[:1]  # a generation may stop inside a character
    decoded = tokenizers.BYTES.decode([[104, BOS, 105, EOS, PAD, PAD], [cut[0], 255, PAD, 999, -1, PAD]])
    assert decoded.numpy().tolist() == [b"hi", cut + b"\xff"]
    invalid = [b"\xff\xfe\x80", cut]
    assert tokenizers.BYTES.decode(tokenizers.BYTES.encode_padded(invalid)[0]).numpy().tolist() == invalid


# ---- sentencepiece ----

def test_sentencepiece_trains_the_same_model_from_the_same_text(training_texts, sentencepiece):
    again = tokenizers.train_sentencepiece(training_texts, 512)
    assert again == sentencepiece.proto
    assert tokenizers.train_sentencepiece(training_texts[1:], 512) != again
    assert sentencepiece.vocab_size == 512
    facts = sentencepiece.facts()
    assert facts["special_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3} and facts["byte_ids"] == "4..259"
    assert sentencepiece.op_libraries == ("tensorflow_text",)


def test_sentencepiece_round_trips_any_utf8_without_unknown_ids_in_python_and_in_a_graph(sentencepiece):
    padded, lengths = sentencepiece.encode_padded(TEXTS)
    ids = [row[:n].tolist() for row, n in zip(padded.numpy(), lengths.numpy())]
    assert all(tokenizers.SP_UNK not in row and min(row, default=4) >= 4 for row in ids)  # bytes stand in, no unk
    assert ids[2] == [] and padded.numpy()[2].tolist() == [tokenizers.SP_PAD] * padded.shape[1]
    assert any(4 <= i < 260 for i in ids[5])  # characters it never saw: byte fallback
    assert [len(text.encode()) for text in TEXTS] == [int(sentencepiece.token_bytes[row].sum()) for row in ids]
    assert max(len(row) for row in ids[:2]) < max(len(t.encode()) for t in TEXTS[:2])  # pieces: fewer ids than bytes
    assert [text.decode() for text in sentencepiece.decode(padded).numpy()] == TEXTS

    round_trip = tf.function(lambda texts: sentencepiece.decode(sentencepiece.encode_padded(texts)[0]),
                             input_signature=[tf.TensorSpec([None], tf.string)])
    assert [text.decode() for text in round_trip(tf.constant(TEXTS)).numpy()] == TEXTS
    keras.utils.set_random_seed(0)  # clears the eager kernel cache, where TF Text keeps an eagerly made model
    assert [text.decode() for text in round_trip(tf.constant(TEXTS)).numpy()] == TEXTS
    # document ids and their byte offsets, for the windows and the baselines
    text = TEXTS[1].encode()
    assert sentencepiece.encode_document(tf.constant(text)).numpy().tolist() == ids[1]
    assert sentencepiece.token_ends(text).tolist() == np.cumsum(sentencepiece.token_bytes[ids[1]]).tolist()


def test_sentencepiece_decode_drops_special_ids_and_its_documented_exceptions(sentencepiece):
    ids = sentencepiece.encode_padded(["hi"])[0].numpy()[0].tolist()
    assert sentencepiece.decode([[1, *ids, 2, 0, 0, 9999, -5]]).numpy().tolist() == [b"hi"]
    # SentencePiece's own two (tokenizers.py): its escaped space, and bytes that are not UTF-8
    assert sentencepiece.decode(sentencepiece.encode_padded(["a\u2581b", b"x\xffy"])[0]).numpy().tolist() == [
        b"a b", "x\ufffdy".encode()]


def test_a_size_the_text_cannot_reach_is_one_line_naming_data_vocab_size():
    with pytest.raises(DataError, match=r"^data\.vocab_size: 5000 is more than sentencepiece can learn from the "
                                        r"training text \(at most \d+ here\); lower it") as info:
        tokenizers.train_sentencepiece([b"a tiny text, a tiny text"], 5000)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match=r"^data\.vocab_size: 262 is too small for the training text's characters "
                                        r"\(sentencepiece needs at least \d+\); raise it$"):
        tokenizers.train_sentencepiece(["".join(map(chr, range(0x4E00, 0x4E40))).encode() * 3], 262)


def test_the_run_keeps_its_tokenizer_until_the_text_or_the_size_changes(tmp_path, training_texts):
    first = tokenizers.prepare_sentencepiece(lambda: training_texts, 400, tmp_path)
    tokenizers.record(first, tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["vocab_size"] == 400
    (tmp_path / "tokenizer.model").write_bytes(first.proto)  # the stored one is read back as it is
    reused = tokenizers.prepare_sentencepiece(lambda: training_texts, 400, tmp_path)
    assert reused.proto == first.proto and reused.record == first.record
    assert tokenizers.prepare_sentencepiece(lambda: training_texts, 450, tmp_path).vocab_size == 450
    more = training_texts[:-1] + [training_texts[-1] + b" more"]
    changed = tokenizers.prepare_sentencepiece(lambda: more, 400, tmp_path)
    assert changed.record["fingerprint"] != first.record["fingerprint"]
    assert tokenizers.read_sentencepiece(tmp_path / "none") is None


def test_a_sentencepiece_language_model_generates_in_a_fresh_process_from_its_savedmodel(tmp_path, sentencepiece):
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(3)
    model = causal_lm.build_causal_lm(sentencepiece.vocab_size, context_length=48, num_layers=1, num_heads=2,
                                      width=16, mlp_width=32)
    generator = generate.Generator(model, tokenizer=sentencepiece)
    with pytest.raises(Exception, match="the model has 259 logits, the sentencepiece tokenizer 512 ids"):
        generate.Generator(causal_lm.build_causal_lm(context_length=8, num_layers=1, num_heads=1, width=4,
                                                     mlp_width=4), tokenizer=sentencepiece)
    prompts = ["The ", "héllo 🙂"]
    want = generator.generate(tf.constant(prompts), tf.constant(10), tf.constant(0.0), tf.constant(0),
                              tf.constant(0, tf.int64))
    ids, lengths = want["ids"].numpy(), want["lengths"].numpy()
    assert ids.shape == (2, 10) and not np.isin(ids, [0, 1, 3]).any()  # pad only after EOS; never bos or unk
    assert want["completions"].numpy().tolist() == sentencepiece.decode(ids).numpy().tolist()
    assert lengths.tolist() == [int(((row >= 4) & (row != 2)).sum()) for row in ids]

    path = tmp_path / "lm"
    generate.save(generator, path)
    ops = generate.saved_model_op_types(path)
    assert {"SentencepieceOp", "SentencepieceTokenizeOp"} <= ops and "SentencepieceDetokenizeOp" not in ops
    assert ops <= generate.SERVING_OPS | tokenizers.SENTENCEPIECE_OPS, sorted(ops - generate.SERVING_OPS)
    assert [p.name for p in path.rglob("*") if p.is_file() and "assets" in p.parts] == []  # the proto is in the graph
    script = ("import sys, json, tensorflow as tf, tensorflow_text\n"
              "f = tf.saved_model.load(sys.argv[1]).signatures['generate']\n"
              "out = f(prompts=tf.constant(json.loads(sys.argv[2])), max_new_tokens=tf.constant(10),"
              " temperature=tf.constant(0.0), top_k=tf.constant(0), seed=tf.constant(0, tf.int64))\n"
              "print(json.dumps({'ids': out['ids'].numpy().tolist(),"
              " 'completions': [c.hex() for c in out['completions'].numpy().tolist()]}))\n")
    done = subprocess.run([sys.executable, "-c", script, str(path), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["ids"] == ids.tolist()
    assert [bytes.fromhex(c) for c in answer["completions"]] == want["completions"].numpy().tolist()
