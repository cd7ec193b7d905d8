"""Text for the language model: the embedded corpus, the user's files and their one-line errors, the split (by
document and within one), the windows, and the unigram and bigram baselines."""

import json
import math

import numpy as np
import pytest

from pipeline.lm.tokenizers import BOS
from pipeline.data import text
from pipeline.errors import DataError

LN_256 = math.log(256)
PROSE = ("The quick brown fox jumps over the lazy dog; naïve café, déjà vu. " * 40).encode()
LETTERS = np.random.default_rng(0).choice(list(b"abcdefgh "), 6000).astype(np.uint8).tobytes()  # no period


def windows_of(dataset) -> list[tuple[bytes, bytes]]:
    return [(x.numpy().tobytes(), y.numpy().tobytes()) for x, y in dataset]


def write(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def one_line_error(patterns, context_length=16) -> str:
    with pytest.raises(DataError) as caught:
        text.text_files(patterns, context_length)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_embedded_corpus_is_the_language_reference_sorted_and_utf8():
    documents = text.embedded_corpus()
    assert len(documents) > 50 and sum(d.size for d in documents) > 300_000
    assert [d.name for d in documents] == sorted(d.name for d in documents)
    assert all(d.text.decode("utf-8") and d.size == len(d.text) for d in documents)
    assert documents == text.embedded_corpus()


def test_files_are_read_sorted_from_one_glob_or_several(tmp_path):
    b = write(tmp_path, "b.txt", PROSE)
    a = write(tmp_path, "a.txt", PROSE[:100])
    c = write(tmp_path, "c.md", PROSE)
    assert [d.path for d in text.text_files(str(tmp_path / "*.txt"), 16)] == [a, b]
    assert [d.name for d in text.text_files([str(tmp_path / "*.txt"), c, a], 16)] == [a, b, c]


def test_each_bad_input_is_one_line_naming_the_glob_or_the_file(tmp_path):
    write(tmp_path, "good.txt", PROSE)
    missing = str(tmp_path / "nothing-*.txt")
    assert missing in one_line_error(missing)
    assert missing in one_line_error([str(tmp_path / "good.txt"), missing])

    empty = write(tmp_path, "empty.txt", b"")
    assert empty in one_line_error(empty) and "empty" in one_line_error(empty)

    short = write(tmp_path, "short.txt", b"twelve bytes")
    message = one_line_error(short, context_length=16)
    assert short in message and "12 bytes" in message and "17 bytes" in message

    latin1 = write(tmp_path, "latin1.txt", "plain text then café".encode("latin-1"))
    message = one_line_error(latin1)
    assert latin1 in message and "offset 19" in message and "0xe9" in message

    cut = write(tmp_path, "cut.txt", "a character cut at the end: €".encode()[:-1])
    assert cut in one_line_error(cut) and "offset 28" in one_line_error(cut)


def test_the_utf8_check_streams_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "READ_CHUNK", 3)  # every multi-byte character of PROSE may straddle two chunks
    assert text.text_files(write(tmp_path, "ok.txt", PROSE), 16)
    bad = write(tmp_path, "bad.txt", "ab€d€".encode() + b"\xff tail of the file")
    message = one_line_error(bad)
    assert bad in message and "offset 9" in message
    held = write(tmp_path, "held.txt", b"abcd\xe2\x82\xff tail of the file")  # chunks abc, d + half a €, 0xff
    assert "byte 0xe2 at offset 4" in one_line_error(held)  # the bad sequence starts in the chunk before


def test_one_file_too_short_to_split_is_one_line_naming_it(tmp_path):
    path = write(tmp_path, "one.txt", PROSE[:40])
    with pytest.raises(DataError) as caught:
        text.load_text(path, 32, 0.1, seed=0)
    assert path in str(caught.value) and "\n" not in str(caught.value) and "65 bytes" in str(caught.value)


def test_the_split_by_file_is_deterministic_disjoint_complete_and_never_empty(tmp_path):
    for i in range(12):
        write(tmp_path, f"part-{i:02d}.txt", PROSE[i:])
    pattern = str(tmp_path / "part-*.txt")
    first, again = text.load_text(pattern, 16, 0.25, seed=3), text.load_text(pattern, 16, 0.25, seed=3)
    assert first.rule == text.BY_DOCUMENT
    train, validation = set(first.train.names), set(first.validation.names)
    assert (train, validation) == (set(again.train.names), set(again.validation.names))
    assert not train & validation and len(train | validation) == 12 and len(validation) == 3
    assert validation != set(text.load_text(pattern, 16, 0.25, seed=4).validation.names)  # the seed picks
    for share in (0.01, 0.99):  # never none, never all
        two = text.split_documents(text.text_files(str(tmp_path / "part-0[01].txt"), 16), 16, share, seed=0)
        assert len(two.train.parts) == len(two.validation.parts) == 1


def test_one_file_is_split_within_it_head_for_training_tail_for_validation(tmp_path):
    path = write(tmp_path, "one.txt", LETTERS)
    data = text.load_text(path, 32, 0.2, seed=0)
    (head,), (tail,) = data.train.parts, data.validation.parts
    assert data.rule == text.WITHIN_DOCUMENT
    assert (head.start, head.end, tail.end) == (0, tail.start, len(LETTERS))
    assert tail.end - tail.start == int(0.2 * len(LETTERS) + 0.5)
    for x, y in data.train.windows(seed=1):
        assert bytes(y.numpy().astype(np.uint8)) in LETTERS[:head.end]
    for x, y in data.validation.windows():
        assert bytes(x.numpy().astype(np.uint8)) in LETTERS[tail.start:]
    in_memory = text.split_documents([text.Document.from_bytes("one", LETTERS)], 32, 0.2, seed=0)
    assert text.text_baselines(data) == text.text_baselines(in_memory)  # the file read in chunks, from the cut


def test_windows_are_next_byte_pairs_of_the_context_length():
    data = text.split_documents([text.Document.from_bytes("a", PROSE), text.Document.from_bytes("b", PROSE[7:])],
                                24, 0.5, seed=0)
    x, y = next(iter(data.train.dataset(4)))
    assert x.shape == y.shape == (4, 24) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    first = data.train.parts[0].document.text
    assert x[0, 0] == BOS and bytes(y[0].numpy().astype(np.uint8)) == first[:24]  # BOS, then the document
    for windows in (data.train, data.validation):
        for seed in (None, 1, 2):
            assert sum(int(b[0].shape[0]) for b in windows.dataset(16, seed=seed)) == len(windows)


def test_validation_windows_are_fixed_and_training_windows_move_with_the_seed():
    documents = [text.Document.from_bytes(f"doc-{i}", LETTERS[i * 900:(i + 1) * 900]) for i in range(6)]
    data = text.split_documents(documents, 32, 0.34, seed=0)
    validation = windows_of(data.validation.windows())
    assert validation == windows_of(data.validation.windows(seed=9)) and len(validation) == len(data.validation)
    one = text.TextWindows([text.Part(documents[0], 0, documents[0].size)], 32, training=False)
    targets = b"".join(np.frombuffer(y, np.int32).astype(np.uint8).tobytes() for _, y in windows_of(one.windows()))
    assert targets == documents[0].text[:len(one) * 32]  # non-overlapping: each window's targets follow the last's
    epoch_1, epoch_2 = windows_of(data.train.windows(seed=1)), windows_of(data.train.windows(seed=2))
    assert epoch_1 == windows_of(data.train.windows(seed=1))
    assert epoch_1 != epoch_2 and set(epoch_1) != set(epoch_2)  # another order and other cuts
    assert len(epoch_1) == len(epoch_2) == len(data.train)


def test_the_bigram_baseline_sees_a_determined_next_byte_and_the_unigram_does_not():
    data = text.split_documents([text.Document.from_bytes("abc", b"abc" * 20_000)], 64, 0.1, seed=0)
    baselines = text.text_baselines(data)
    assert abs(baselines.unigram - math.log(3)) < 0.05  # three equally frequent bytes
    assert baselines.bigram < 0.05
    assert baselines.train_bytes == data.train.bytes
    assert baselines.validation_bytes == len(data.validation) * 64


def test_on_random_bytes_both_baselines_are_near_ln_256():
    rng = np.random.default_rng(0)
    documents = [text.Document.from_bytes(f"random-{i}", rng.integers(0, 256, 65_536, np.uint8).tobytes())
                 for i in range(20)]
    baselines = text.text_baselines(text.split_documents(documents, 128, 0.1, seed=0))
    assert abs(baselines.unigram - LN_256) < 0.01 and abs(baselines.bigram - LN_256) < 0.1


def test_add_one_smoothing_keeps_bytes_unseen_in_training_finite():
    data = text.split_documents([text.Document.from_bytes("doc", b"abc" * 3000 + b"xyz" * 100)], 32, 300 / 9300,
                                seed=0)
    assert data.validation.parts[0].start == 9000  # training never saw x, y or z
    baselines = text.text_baselines(data)
    assert math.isfinite(baselines.unigram) and math.isfinite(baselines.bigram)
    assert baselines.unigram > LN_256  # bytes never seen: worse than guessing uniformly
    assert baselines.bigram == pytest.approx(LN_256)  # after a byte never seen: uniform


def test_the_summary_is_json_and_counts_each_side():
    documents = [text.Document.from_bytes("tiny", b"x" * 10)] + [text.Document.from_bytes(f"d{i}", PROSE)
                                                                    for i in range(4)]
    data = text.split_documents(documents, 32, 0.25, seed=0)
    summary = json.loads(json.dumps(data.summary()))
    assert summary["left_out"] == ["tiny"] and summary["split"] == text.BY_DOCUMENT
    assert summary["train"]["documents"] + summary["validation"]["documents"] == 4
    assert summary["train"]["bytes"] + summary["validation"]["bytes"] == 4 * len(PROSE)
    assert summary["validation"]["windows"] == len(data.validation) == len(PROSE) // 32  # BOS + bytes


def test_the_baselines_do_not_depend_on_the_read_chunk(monkeypatch):
    data = text.split_documents([text.Document.from_bytes(f"d{i}", LETTERS[i::3]) for i in range(3)], 16, 0.3, seed=0)
    whole = text.text_baselines(data)
    monkeypatch.setattr(text, "READ_CHUNK", 7)  # pairs across chunk boundaries carry the previous byte
    assert text.text_baselines(data) == whole


# ---- load_datasets: text as the pipeline's Datasets ----

def text_config(*more):
    from pipeline.config import load_config

    return load_config(None, ["data.source=text", "model.kind=causal_lm", "data.sequence_length=32", *more]).data


def test_load_datasets_gives_the_embedded_corpus_as_windows_with_baselines(tmp_path):
    from pipeline.data import load_datasets, record

    datasets = load_datasets(text_config(), seed=3)
    spec, stats = datasets.spec, datasets.statistics
    assert (spec.task, spec.input_name, spec.input_shape, spec.num_outputs) == ("language_model", "ids", (32,), 259)
    assert stats.rows == len(datasets.corpus.train) and stats.validation_rows == len(datasets.corpus.validation)
    assert datasets.corpus.source == text.EMBEDDED and datasets.corpus.rule == text.BY_DOCUMENT
    assert datasets.sample_x.dtype == np.int32 and datasets.sample_x.shape == (64, 32)
    np.testing.assert_array_equal(datasets.sample_x[:, 1:], datasets.sample_y[:, :-1])  # targets: the next byte
    assert datasets.baselines == text.text_baselines(datasets.corpus)
    x, y = next(iter(datasets.train_dataset(8, 100, seed=1)))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == np.int32
    assert sum(len(x) for x, _ in datasets.val_dataset(512)) == stats.validation_rows
    record(datasets, tmp_path)
    recorded = json.loads((tmp_path / "text.json").read_text())
    assert recorded["corpus"] == json.loads(json.dumps(datasets.corpus.summary()))
    assert recorded["baselines"]["bigram"] == datasets.baselines.bigram


def test_load_datasets_reads_files_and_its_fingerprint_follows_documents_seed_and_split(tmp_path):
    from pipeline.data import load_datasets

    for i in range(3):
        write(tmp_path, f"doc{i}.txt", PROSE[i * 100:])
    datasets = load_datasets(text_config(f"data.path={tmp_path}/*.txt"), seed=3)
    assert datasets.corpus.source == f"{tmp_path}/*.txt"
    assert set(datasets.statistics.rows_per_file) == {str(tmp_path / f"doc{i}.txt") for i in range(3)}
    assert sum(datasets.statistics.rows_per_file.values()) == datasets.train_examples + datasets.val_examples
    fingerprint = datasets.statistics.fingerprint
    assert load_datasets(text_config(f"data.path={tmp_path}/*.txt"), seed=3).statistics.fingerprint == fingerprint
    assert load_datasets(text_config(f"data.path={tmp_path}/*.txt"), seed=4).statistics.fingerprint != fingerprint
    other_split = text_config(f"data.path={tmp_path}/*.txt", "data.validation_split=0.5")
    assert load_datasets(other_split, seed=3).statistics.fingerprint != fingerprint
    write(tmp_path, "doc1.txt", PROSE)  # 100 bytes longer
    assert load_datasets(text_config(f"data.path={tmp_path}/*.txt"), seed=3).statistics.fingerprint != fingerprint


def test_a_bad_text_file_stops_load_datasets_in_one_line_naming_it(tmp_path):
    from pipeline.data import load_datasets

    write(tmp_path, "good.txt", PROSE)
    bad = write(tmp_path, "latin1.txt", "café ".encode("latin-1") * 20)
    with pytest.raises(DataError, match=rf"^data\.path: {bad}: not UTF-8 text: byte 0xe9 at offset 3 ") as caught:
        load_datasets(text_config(f"data.path={tmp_path}/*.txt"), seed=0)
    assert "\n" not in str(caught.value)


# ---- the sentencepiece tokenizer's windows and baselines (the tokenizer itself: tests/pipeline/test_tokenizers.py) ----

def test_sentencepiece_windows_come_from_a_tokenizer_trained_on_the_training_split_only(tmp_path):
    from pipeline import models
    from pipeline.lm import tokenizers
    from pipeline.data import load_datasets, record

    config = text_config("data.tokenizer=sentencepiece", "data.vocab_size=400")
    datasets = load_datasets(config, seed=3)
    tokenizer, corpus = datasets.tokenizer, datasets.corpus
    assert (tokenizer.kind, tokenizer.vocab_size, datasets.spec.num_outputs) == ("sentencepiece", 400, 400)
    assert tokenizer.record["trained_on"]["bytes"] == corpus.train.bytes  # never a validation byte
    again = tokenizers.train_sentencepiece([part.read() for part in corpus.train.parts], 400)
    assert again == tokenizer.proto
    x, y = (np.concatenate(side) for side in zip(*[(a.numpy(), b.numpy()) for a, b in datasets.val_dataset(256)]))
    assert len(x) == datasets.val_examples and x.max() < 400 and not np.isin(y, [0, 2, 3]).any()
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert x[0, 0] == tokenizers.SP_BOS or not corpus.validation.parts[0].bos
    # a window's text is the document's: decode(ids) is its bytes, one window after another
    first = corpus.validation.parts[0]
    decoded = b"".join(tokenizer.decode(np.concatenate([x[:1, :], y[:1, -1:]], axis=1)).numpy().tolist())
    assert first.read().startswith(decoded)
    # the baselines score exactly the bytes the model's nats per byte divides by
    assert datasets.baselines.validation_bytes == int(tokenizer.token_bytes[y].sum())
    assert datasets.baselines.validation_bytes > 1.3 * y.size  # more than a byte a token
    metric = models.NatsPerByte(datasets.spec.token_bytes)
    uniform = np.zeros((*y.shape, 400), np.float32)
    metric.update_state(y, uniform)
    assert float(metric.result()) == pytest.approx(y.size * np.log(400) / datasets.baselines.validation_bytes, 1e-5)
    record(datasets, tmp_path)
    assert (tmp_path / "tokenizer.model").read_bytes() == tokenizer.proto
    assert load_datasets(config, seed=3, recorded=tmp_path).tokenizer.record == tokenizer.record


def test_bytes_and_sentencepiece_baselines_score_the_same_kind_of_bytes(tmp_path):
    from pipeline.data import load_datasets

    write(tmp_path, "one.txt", PROSE * 3)  # one file: split within it, the tail's first token is context only
    by_bytes = load_datasets(text_config(f"data.path={tmp_path}/*.txt"), seed=0)
    pieces = load_datasets(text_config(f"data.path={tmp_path}/*.txt", "data.tokenizer=sentencepiece",
                                       "data.vocab_size=300"), seed=0)
    assert by_bytes.corpus.rule == pieces.corpus.rule == text.WITHIN_DOCUMENT
    assert by_bytes.corpus.validation.parts == pieces.corpus.validation.parts
    (first, end), = text.scored_spans(pieces.corpus)
    part = pieces.corpus.validation.parts[0]
    assert part.start < first < end <= part.end and pieces.baselines.validation_bytes == end - first
    # the same text and the same fitted counts: per byte, the bigram baselines are close whatever the tokenizer
    assert pieces.baselines.bigram == pytest.approx(by_bytes.baselines.bigram, rel=0.1)


def test_a_within_document_split_starts_the_validation_at_a_character():
    document = text.Document.from_bytes("é", ("é" * 300).encode())  # two bytes a character
    train, validation = text._split_within(document, 16, 0.25, "data.path")
    assert train[0].end == validation[0].start and validation[0].start % 2 == 0
    assert validation[0].read().decode() == "é" * (len(validation[0].read()) // 2)


def test_a_sentencepiece_window_longer_than_every_document_is_one_line(tmp_path):
    from pipeline.data import load_datasets

    write(tmp_path, "one.txt", PROSE)
    with pytest.raises(DataError, match=r"^data\.sequence_length: 1000 sentencepiece tokens is more than any \w+ "
                                        r"document holds \(\d+ tokens at most\)"):
        load_datasets(text_config(f"data.path={tmp_path}/*.txt", "data.sequence_length=1000",
                                  "data.tokenizer=sentencepiece", "data.vocab_size=300"), seed=0)
