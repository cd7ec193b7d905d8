"""GPT-2's byte-level BPE as TensorFlow ops (pipeline/lm/bpe.py, docs/pretrained.md#the-tokenizer): equal to OpenAI's
encoder on 10,000 fuzz texts under a small vocabulary (GPT-2's first 200 merges, committed) and under GPT-2's own
(rebuilt from the registry's openai-whisper source, tests/helpers/gpt2_vocabulary.py), reference ids made by
gpt2_reference/make_tokenizer_reference.py; decode its inverse; core ops only; a bad vocabulary one line."""

import json
import shutil
from pathlib import Path

import gpt2_vocabulary
import numpy as np
import pytest
import tensorflow as tf

from pipeline.errors import CheckpointError
from pipeline.lm import bpe

FIXTURES = Path(__file__).parent / "gpt2_reference" / "tokenizer"
SMALL = bpe.PACKAGED  # GPT-2's first 200 merges: 457 ids


@pytest.fixture(scope="module")
def fuzz():
    return gpt2_vocabulary.fuzz_texts()


@pytest.fixture(scope="module")
def reference():
    return np.load(FIXTURES / "reference.npz")


@pytest.fixture(scope="module")
def real_vocabulary():
    """GPT-2's vocab.json and merges.txt, from the package registry once (docs/testing.md)."""
    return gpt2_vocabulary.real_vocabulary()


def expected_ids(reference, name):
    lengths = reference[f"{name}_lengths"]
    return np.split(reference[f"{name}_ids"].astype(np.int32), np.cumsum(lengths)[:-1])


def mismatches(tokenizer, texts, expected):
    got = tokenizer.encode(tf.constant([text.encode("utf-8") for text in texts])).to_list()
    return [(text, list(want), ids) for text, want, ids in zip(texts, expected, got) if list(want) != ids]


def test_the_small_vocabulary_encodes_as_openais_encoder(fuzz, reference):
    assert mismatches(bpe.read(SMALL), fuzz, expected_ids(reference, "small")) == []


def test_gpt2s_own_vocabulary_encodes_as_openais_encoder(fuzz, reference, real_vocabulary):
    tokenizer = bpe.read(real_vocabulary)
    assert (tokenizer.vocab_size, tokenizer.end_of_text) == (50257, 50256)
    assert tokenizer.encode(tf.constant([b"hello world"])).to_list() == [[31373, 995]]
    assert mismatches(tokenizer, fuzz, expected_ids(reference, "real")) == []


def test_decode_is_encodes_inverse_and_pieces_join_to_it(fuzz):
    tokenizer = bpe.read(SMALL)
    texts = [text.encode("utf-8") for text in fuzz[:2000]]
    ids = tokenizer.encode(tf.constant(texts))
    assert tokenizer.decode(ids.to_tensor(tokenizer.end_of_text)).numpy().tolist() == texts
    row = ids[7]
    assert b"".join(tokenizer.pieces(row).numpy().tolist()) == texts[7]


def test_a_literal_end_of_text_is_text_and_the_special_id_decodes_to_nothing():
    tokenizer = bpe.read(SMALL)
    ids = tokenizer.encode(tf.constant([b"a<|endoftext|>b"])).to_list()[0]
    assert tokenizer.end_of_text == 456 and tokenizer.end_of_text not in ids
    assert tokenizer.decode(tf.constant([ids + [456, 456]])).numpy().tolist() == [b"a<|endoftext|>b"]
    assert tokenizer.pieces(tf.constant([456, -1, 457])).numpy().tolist() == [b"", b"", b""]


def test_text_that_is_not_utf8_is_refused_saying_so():
    with pytest.raises(tf.errors.InvalidArgumentError, match="a text is not valid UTF-8"):
        bpe.read(SMALL).encode(tf.constant([b"fine", b"caf\xe9"]))


def test_in_a_graph_it_is_core_ops_and_the_same_ids(fuzz):
    """Stock tensorflow_model_server has every core op; TF Text's would need its library (docs/export.md)."""
    tokenizer = bpe.read(SMALL)
    texts = tf.constant([text.encode("utf-8") for text in fuzz[:500]] + [b""])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def round_trip(texts):
        ids = tokenizer.encode(texts)
        return ids.flat_values, ids.row_lengths(), tokenizer.decode(ids.to_tensor(tokenizer.end_of_text))

    flat, lengths, decoded = round_trip(texts)
    assert round_trip(tf.constant([b""]))[1].numpy().tolist() == [0]  # nothing to split, as a server's warmup sends
    eager = tokenizer.encode(texts)
    np.testing.assert_array_equal(flat, eager.flat_values)
    np.testing.assert_array_equal(lengths, eager.row_lengths())
    assert decoded.numpy().tolist() == texts.numpy().tolist()
    graph = round_trip.get_concrete_function().graph.as_graph_def()
    ops = {node.op for node in graph.node} | {node.op for f in graph.library.function for node in f.node_def}
    assert ops <= bpe.GRAPH_OPS, ops - bpe.GRAPH_OPS
    assert all(hasattr(tf.raw_ops, op) for op in ops)  # core TensorFlow's, none of a library's


def damaged(tmp_path, vocab_edit=None, merges_text=None) -> Path:
    directory = tmp_path / "vocabulary"
    shutil.copytree(SMALL, directory)
    if vocab_edit:
        vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
        vocab_edit(vocab)
        (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    if merges_text is not None:
        (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    return directory


@pytest.mark.parametrize("vocab_edit, merges_text, message", [
    (lambda v: v.pop("Ġ"), None, "no token for byte 0x20 \\(a byte-level vocabulary has all 256\\)"),
    (lambda v: v.update({"Ġt": 999}), None, "the ids are not 0..456, each once"),
    (None, "#version: 0.2\nĠ t\nĠt he zz\n", "merges.txt line 3 is 'Ġt he zz'; each line is two tokens"),
    (None, "#version: 0.2\nq z\n", "merge 1 \\(q z\\) needs token 'qz', which the vocabulary lacks"),
    (None, "#version: 0.2\nĠ t\nĠ t\n", "a pair is merged twice"),
    (lambda v: v.update({"\u4e2d": v.pop("<|endoftext|>")}), None,
     "token '中' has a character that stands for no byte"),
])
def test_a_damaged_vocabulary_is_one_line(vocab_edit, merges_text, message, tmp_path):
    with pytest.raises(CheckpointError, match=message) as error:
        bpe.read(damaged(tmp_path, vocab_edit, merges_text))
    assert "\n" not in str(error.value)


def test_missing_or_unreadable_files_are_named(tmp_path):
    directory = damaged(tmp_path)
    (directory / "vocab.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="vocab.json or merges.txt cannot be read"):
        bpe.read(directory)
    (directory / "vocab.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="vocab.json is not an object of token strings to integer ids"):
        bpe.read(directory)
    (directory / "vocab.json").unlink()
    with pytest.raises(CheckpointError, match="no vocab.json \\(data.tokenizer: gpt2 reads"):
        bpe.read(directory)
    with open(directory / "merges.txt", "wb") as f:
        f.truncate(bpe.MAX_FILE_BYTES + 1)
    shutil.copy(SMALL / "vocab.json", directory)
    with pytest.raises(CheckpointError, match="merges.txt: 67,108,865 bytes"):
        bpe.read(directory)
