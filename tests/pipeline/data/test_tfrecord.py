"""TFRecord shards of tf.Examples, streamed: the feature spec, every shard's records, and the one line each damaged
file or bad record costs."""

import numpy as np
import pytest

from data_files import REPO, SPEC, TRANSACTIONS_SPEC, example, good_records, load, transaction_records, write_tfrecord
from pipeline.data import DataError


def test_tfrecord_parses_the_feature_spec_across_shards(tmp_path):
    write_tfrecord(tmp_path / "train-0.tfrecord", good_records(12))
    write_tfrecord(tmp_path / "train-1.tfrecord", good_records(8, start=12))
    val = write_tfrecord(tmp_path / "val.tfrecord", good_records(5, start=100))
    ds = load("data.source=tfrecord", f"data.path={tmp_path}/train-*.tfrecord", f"data.validation_path={val}", SPEC)
    (x, y), (val_x, _) = ds.train.rows(), ds.val.rows()
    assert x.shape == (20, 5) and val_x.shape == (5, 5)  # pixels (4) then age (1)
    order = np.argsort(x[:, 4])  # the shards are read two at a time: their records interleave
    np.testing.assert_array_equal(x[order, 4], np.arange(20))
    np.testing.assert_array_equal(y[order], np.arange(20) % 3)
    assert dict(zip(*np.unique(x[:12, 4] < 12, return_counts=True))) == {True: 6, False: 6}
    assert ds.spec.num_classes == 3


@pytest.mark.parametrize("records, overrides, message", [
    (None, [], r"data\.path: .*nothing-\*\.tfrecord not found \(no file matches\)"),
    ([example(pixels=np.ones(4, np.float32), label=np.array([0]))], [],
     r"bad\.tfrecord record 0: no feature 'age' \(has label, pixels\)"),
    (good_records(2) + [example(pixels=np.ones(3, np.float32), age=np.array([1.0]), label=np.array([0]))], [],
     r"bad\.tfrecord record 2, feature 'pixels': holds float_list of 3 values; expected float_list of 4 values \(shape \[4\]\)"),
    ([example(pixels=np.ones(4, np.int64), age=np.array([1.0]), label=np.array([0]))], [],
     r"record 0, feature 'pixels': holds int64_list of 4 values; expected float_list"),
    ([example(pixels=np.ones(4, np.float32), age=np.array([1.0]), label=np.array([0.5]))], [],
     r"record 0, feature 'label': holds float_list of 1 value; expected int64_list .*data\.task: regression"),
    ([example(pixels=np.ones(4, np.float32), age=np.array([1.0]), label=np.array(["cat"]))], [],
     r"record 0, feature 'label': holds bytes_list of 1 value; expected int64_list"),
    (good_records(3) + [example(pixels=np.ones(4, np.float32), age=np.array([1.0]), label=np.array([-2]))], [],
     r"bad\.tfrecord record 3, feature 'label': label -2 is negative"),
    (good_records(6), ["data.num_classes=2"], r"bad\.tfrecord record 2, feature 'label': label 2 is not below data\.num_classes 2"),
    (good_records(2) + [example(pixels=np.array([1, np.nan, 1, 1], np.float32), age=np.array([1.0]), label=np.array([0]))],
     [], r"bad\.tfrecord record 2, feature 'pixels': a value is NaN or infinite"),
    ([b"not an example"], [], r"bad\.tfrecord record 0: not a serialized tf\.train\.Example"),
])
def test_bad_tfrecord_gets_one_line_naming_file_and_feature(tmp_path, records, overrides, message):
    path = f"{tmp_path}/nothing-*.tfrecord" if records is None else write_tfrecord(tmp_path / "bad.tfrecord", records)
    with pytest.raises(DataError, match=message) as info:
        load("data.source=tfrecord", f"data.path={path}", SPEC, *overrides)
    assert len(str(info.value).splitlines()) == 1


def test_a_file_that_is_not_a_tfrecord(tmp_path):
    path = tmp_path / "junk.tfrecord"
    path.write_bytes(b"this is a text file, not TFRecord framing")
    with pytest.raises(DataError, match=r"junk\.tfrecord is not an uncompressed TFRecord file \(or is damaged\): "
                                        r"the header of record 0 \(byte 0\) fails its checksum$"):
        load("data.source=tfrecord", f"data.path={path}", SPEC)


@pytest.mark.parametrize("cut, message", [
    (lambda data: data[:len(data) // 2 + 40], r"half\.tfrecord is truncated: 30 complete records, then 40 bytes "
                                              r"where record 30 needs \d+; copy the file again$"),
    (lambda data: data[:5], r"half\.tfrecord is truncated: 0 complete records, then 5 bytes where a record header "
                            r"needs 12; copy the file again$"),
    (lambda data: b"", r"half\.tfrecord is empty \(0 bytes\): no records$"),
])
def test_a_truncated_or_empty_tfrecord_is_one_line_with_the_records_it_holds(tmp_path, cut, message):
    # TensorFlow reads a file cut inside a record as the records before the cut, without a word (issue 23:
    # a half-copied file trained on 30 of 60 records).
    full = write_tfrecord(tmp_path / "full.tfrecord", transaction_records(60))
    assert len(full.read_bytes()) % 60 == 0  # equal records: half the bytes is exactly 30 of them
    (tmp_path / "half.tfrecord").write_bytes(cut(full.read_bytes()))
    with pytest.raises(DataError, match=message) as info:
        load("data.source=tfrecord", f"data.path={tmp_path / 'half.tfrecord'}", TRANSACTIONS_SPEC)
    assert len(str(info.value).splitlines()) == 1
    loaded = load("data.source=tfrecord", f"data.path={full}", TRANSACTIONS_SPEC)
    assert loaded.train.rows()[0].shape[1:] == (32,) and loaded.train_examples + loaded.val_examples == 60


def test_the_records_read_from_each_file_are_logged(tmp_path, caplog):
    write_tfrecord(tmp_path / "a.tfrecord", transaction_records(60))
    write_tfrecord(tmp_path / "b.tfrecord", transaction_records(30, seed=1))
    with caplog.at_level("INFO", logger="pipeline.data"):
        load("data.source=tfrecord", f"data.path={tmp_path}/*.tfrecord", TRANSACTIONS_SPEC)
    assert "data: tfrecord: 74 training / 16 validation rows in 2 files (a.tfrecord: 60, b.tfrecord: 30)" in caplog.messages


@pytest.mark.parametrize("name, content", [("empty.tfrecord", b""), ("cut.tfrecord", None), ("empty.csv", b"")])
def test_cli_a_damaged_data_file_is_exit_2_and_nothing_written(tmp_path, capsys, name, content):
    from pipeline.cli import main

    path = tmp_path / name
    if content is None:
        full = write_tfrecord(tmp_path / "full.tfrecord", transaction_records(20)).read_bytes()
        content = full[:len(full) - 7]
    path.write_bytes(content)
    source = ["--set", "data.source=csv"] if name.endswith(".csv") else ["--set", "data.source=tfrecord", "--set",
                                                                          TRANSACTIONS_SPEC]
    code = main(["train", str(REPO / "configs/default.yaml"), *source, "--set", f"data.path={path}",
                 "--set", f"train.runs_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: data.path: {path}")
    assert not (tmp_path / "runs").exists()
