"""The streamed reader: the split rule, each worker's part of an epoch, the order from a seed, a resumed epoch, and
bad records under data.max_bad_records."""

import json

import numpy as np
import pytest
import tensorflow as tf

from data_files import ID_SPEC, example, good_records, id_shards, load, write_csv, write_tfrecord, SPEC
from pipeline.config import load_config
from pipeline.data import DataError, explain_input_failure, load_datasets, record
from pipeline.data.shards import Split


def ids(batches) -> list[int]:
    return [int(i) for x, _ in batches for i in x.numpy()[:, 0]]


def test_the_split_rule_is_exact_per_block_spread_and_the_same_everywhere():
    rule = Split(0.2, seed=3, validation=True)
    chosen = rule.is_validation(["train-00001.tfrecord"] * 5000, np.arange(5000)).numpy()
    assert chosen[:1000].sum() == 200 and chosen.sum() == 1000  # exact in every block of 1,000
    assert 1 <= chosen[:10].sum() <= 3  # spread: a small file gets its share too
    again = rule.is_validation(tf.constant(["train-00001.tfrecord"] * 5000), tf.range(5000, dtype=tf.int64)).numpy()
    np.testing.assert_array_equal(chosen, again)  # graph and eager: the same rule
    other_seed = Split(0.2, seed=4, validation=True).is_validation(["train-00001.tfrecord"] * 5000, np.arange(5000))
    assert not np.array_equal(chosen, other_seed.numpy())


def test_training_and_validation_rows_are_disjoint_and_the_same_for_every_command(tmp_path):
    pattern = id_shards(tmp_path, shards=3, rows_per_shard=200)
    a = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    b = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    train, val = set(a.train.rows()[0][:, 0]), set(a.val.rows()[0][:, 0])
    assert not train & val and train | val == set(range(600)) and len(val) == a.val_examples
    np.testing.assert_array_equal(a.validation_rows(50)[0], b.validation_rows(50)[0])
    assert len(train) == a.train_examples


@pytest.mark.parametrize("shards, rows_per_shard", [(4, 50), (1, 200)])
def test_each_worker_reads_its_own_records_and_together_every_one_once(tmp_path, shards, rows_per_shard):
    # 4 shards: whole files per worker (never opening the others'); 1 shard: every n-th record of it.
    pattern = id_shards(tmp_path, shards=shards, rows_per_shard=rows_per_shard)
    ds = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC, "data.validation_split=0.1")
    seen = [ids(ds.train_dataset(8, 100, seed=5, input_context=tf.distribute.InputContext(2, worker, 2)))
            for worker in (0, 1)]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(ds.train.rows()[0][:, 0].astype(int).tolist())


def test_a_seed_fixes_the_order_and_each_epoch_has_its_own(tmp_path):
    pattern = id_shards(tmp_path, shards=4, rows_per_shard=100)
    ds = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    first, again = ids(ds.train_dataset(16, 64, seed=1)), ids(ds.train_dataset(16, 64, seed=1))
    assert first == again and sorted(first) == sorted(ds.train.rows()[0][:, 0].astype(int).tolist())
    assert ids(ds.train_dataset(16, 64, seed=2)) != first
    assert first != sorted(first)


def test_a_resumed_epoch_continues_with_the_batches_it_had_not_trained_on(tmp_path):
    pattern = id_shards(tmp_path, shards=3, rows_per_shard=100)
    ds = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    whole = [list(x.numpy()[:, 0]) for x, _ in ds.train_dataset(10, 50, seed=7)]
    rest = [list(x.numpy()[:, 0]) for x, _ in ds.train_dataset(10, 50, seed=7, skip=10 * 4)]
    assert rest == whole[4:]


def test_bad_records_are_named_left_out_and_counted_up_to_the_limit(tmp_path):
    records = good_records(40)
    records[7] = b"not an example"
    records[23] = example(pixels=np.ones(3, np.float32), age=np.array([1.0]), label=np.array([0]))
    path = write_tfrecord(tmp_path / "t.tfrecord", records)
    with pytest.raises(DataError, match=r"^data\.path: .*t\.tfrecord record 7: not a serialized tf\.train\.Example$"):
        load("data.source=tfrecord", f"data.path={path}", SPEC)
    ds = load("data.source=tfrecord", f"data.path={path}", SPEC, "data.max_bad_records=2")
    assert ds.train_examples + ds.val_examples == 38
    ages = np.concatenate([ds.train.rows()[0][:, 4], ds.val.rows()[0][:, 4]])
    assert sorted(ages.astype(int).tolist()) == [i for i in range(40) if i not in (7, 23)]
    assert [(b["record"], b["reason"]) for b in ds.statistics.bad_records] == [
        (7, "not a serialized tf.train.Example"),
        (23, "holds float_list of 3 values; expected float_list of 4 values (shape [4])")]
    record(ds, tmp_path / "data")
    kept = [json.loads(line) for line in (tmp_path / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert [entry["record"] for entry in kept] == [7, 23] and kept[1]["column"] == "pixels"
    with pytest.raises(DataError, match=r"^more than data\.max_bad_records 1 bad records \(2 found\); the first: "
                                        r"data\.path: .*t\.tfrecord record 7: not a serialized"):
        load("data.source=tfrecord", f"data.path={path}", SPEC, "data.max_bad_records=1")


def test_a_csv_line_with_a_missing_column_is_named_or_counted(tmp_path):
    lines = "".join(f"{i},{i * 2},{i % 2}\n" for i in range(30))
    path = write_csv(tmp_path / "rows.csv", "a,b,label\n" + lines.replace("4,8,0\n", "4,0\n"))
    with pytest.raises(DataError, match=r"^data\.path: .*rows\.csv line 6: 2 fields, but the header has 3$"):
        load("data.source=csv", f"data.path={path}")
    ds = load("data.source=csv", f"data.path={path}", "data.max_bad_records=1")
    assert ds.train_examples + ds.val_examples == 29
    assert 4.0 not in np.concatenate([ds.train.rows()[0][:, 0], ds.val.rows()[0][:, 0]])


def test_a_file_cut_after_the_statistics_pass_stops_training_with_one_line(tmp_path):
    pattern = id_shards(tmp_path, shards=2, rows_per_shard=200)
    cfg = load_config(None, ["data.source=tfrecord", f"data.path={pattern}", ID_SPEC, f"train.runs_dir={tmp_path}",
                             "train.epochs=1", "model.hidden_units=[8]"])
    datasets = load_datasets(cfg.data, seed=cfg.seed)
    shard = tmp_path / "train-00001.tfrecord"
    shard.write_bytes(shard.read_bytes()[:-100])  # half-copied after the pass
    with pytest.raises(tf.errors.OpError) as raised:
        for _ in datasets.train_dataset(32, 100, seed=1):
            pass
    error = explain_input_failure(datasets, raised.value)
    assert isinstance(error, DataError) and "\n" not in str(error)
    assert str(error).startswith("reading the training files failed mid-epoch: ") and "--fresh" in str(error)
    assert np.isfinite(datasets.statistics.mean).all()
