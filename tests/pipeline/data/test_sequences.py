"""Token-id sequences: the generated pointer task, and npz, csv and tfrecord token files padded to one length,
with one line naming the row for an id outside the vocabulary or a sequence that does not fit."""

import numpy as np
import pytest
import tensorflow as tf

from pipeline.data import sequences
from pipeline.config import load_config
from pipeline.data import load_datasets
from pipeline.errors import DataError


def test_the_pointer_task_is_deterministic_and_its_label_is_the_digit_pointed_at():
    x, y = sequences.pointer_task(500, 12, seed=7)
    again, labels_again = sequences.pointer_task(500, 12, seed=7)
    np.testing.assert_array_equal(x, again)
    np.testing.assert_array_equal(y, labels_again)
    assert not np.array_equal(x, sequences.pointer_task(500, 12, seed=8)[0])
    positions = x[:, 0] - sequences.FIRST_POINTER + 1
    assert positions.min() == 1 and positions.max() == 11
    pointed = x[np.arange(len(x)), positions]
    np.testing.assert_array_equal(pointed - sequences.FIRST_DIGIT, y)  # never a padding token
    lengths = (x != 0).sum(axis=1)
    assert lengths.min() == sequences.MIN_POINTER_LENGTH and lengths.max() == 12  # padding exercised
    assert all((row[:n] != 0).all() and (row[n:] == 0).all() for row, n in zip(x, lengths))  # trailing padding
    assert x.max() < sequences.pointer_vocab_size(12) and set(np.unique(y)) == set(range(10))


def test_pointer_source_gives_padded_float32_ids_and_the_vocabulary():
    cfg = load_config(None, ["data.source=pointer", "model.kind=transformer", "data.num_examples=100",
                             "data.sequence_length=8"])
    rows = load_datasets(cfg.data, seed=cfg.seed)
    assert rows.spec.input_shape == (8,) and rows.spec.vocab_size == 18 and rows.spec.tokens
    assert rows.spec.num_classes == 10 and rows.spec.image_shape is None
    assert rows.train.x.dtype == np.float32 and len(rows.train.x) + len(rows.val.x) == 100


def _token_config(source: str, path, *overrides):
    return load_config(None, [f"data.source={source}", f"data.path={path}", "model.kind=transformer",
                              "data.validation_split=0.34", *overrides])


def test_csv_npz_and_tfrecord_token_files_are_padded_to_the_longest_sequence(tmp_path):
    sequences_and_labels = [([3, 4, 5], 1), ([], 0), ([7, 1], 1), ([2, 2, 2, 2], 0), ([1], 1), ([6, 6], 0)]
    csv_path = tmp_path / "tokens.csv"
    csv_path.write_text("tokens,label\n" + "".join(f"{' '.join(map(str, ids))},{label}\n"
                                                   for ids, label in sequences_and_labels))
    npz_path = tmp_path / "tokens.npz"
    padded = np.zeros((6, 5), np.int64)
    for i, (ids, _) in enumerate(sequences_and_labels):
        padded[i, :len(ids)] = ids
    np.savez(npz_path, x_train=padded, y_train=np.array([label for _, label in sequences_and_labels]))
    tfrecord_path = tmp_path / "tokens.tfrecord"
    with tf.io.TFRecordWriter(str(tfrecord_path)) as writer:
        for ids, label in sequences_and_labels:
            feature = {"tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=ids)),
                       "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    loaded = [load_datasets(_token_config("csv", csv_path, "data.vocab_size=8").data, seed=3),
              load_datasets(_token_config("npz", npz_path, "data.vocab_size=8").data, seed=3),
              load_datasets(_token_config("tfrecord", tfrecord_path, "data.vocab_size=8",
                                          "data.feature_spec={tokens: {dtype: int64}}").data, seed=3)]
    expected = sorted((*ids, *[0] * (4 - len(ids)), label) for ids, label in sequences_and_labels)
    for rows in loaded:  # npz's fifth column is all padding: trimmed like any trailing zeros
        assert rows.spec.input_shape == (4,) and rows.spec.vocab_size == 8
        (x, y), (val_x, val_y) = rows.train.rows(), rows.val.rows()
        assert x.dtype == np.float32 and rows.train_examples == len(x) and rows.val_examples == len(val_x)
        everything = np.concatenate([np.column_stack([x, y]), np.column_stack([val_x, val_y])])
        assert sorted(map(tuple, everything.astype(int).tolist())) == expected
    wider = load_datasets(_token_config("csv", csv_path, "data.vocab_size=8", "data.sequence_length=10").data, seed=3)
    assert wider.spec.input_shape == (10,) and (wider.train.rows()[0][:, 4:] == 0).all()


@pytest.mark.parametrize("text, overrides, message", [
    ("tokens,label\n3 4,1\n9 1,0\n", [], r"tokens\.csv line 3: token 9 at position 0 is not an id in 0\.\.7 "
                                          r"\(data\.vocab_size\)$"),
    ("tokens,label\n3 4,1\n1 2.5,0\n", [], r"line 3: token 2\.5 at position 1 is not an id in 0\.\.7"),
    ("tokens,label\n3 4,1\n1 -1,0\n", [], r"line 3: token -1 at position 1 is not an id"),
    ("tokens,label\n3 4 5 6,1\n1,0\n", ["data.sequence_length=3"],
     r"tokens\.csv line 2: 4 tokens, more than data\.sequence_length 3; raise it$"),
    ("tokens,label\n3 four,1\n1,0\n", [], r"line 2, column 'tokens': expected token ids separated by spaces, "
                                          r"got '3 four'$"),
])
def test_a_bad_token_costs_one_line_naming_the_row(tmp_path, text, overrides, message):
    path = tmp_path / "tokens.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message) as error:
        load_datasets(_token_config("csv", path, "data.vocab_size=8", *overrides).data, seed=0)
    assert len(str(error.value).splitlines()) == 1


def test_a_tfrecord_token_list_of_the_wrong_type_is_named(tmp_path):
    path = tmp_path / "floats.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        feature = {"tokens": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0, 2.0])),
                   "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[0]))}
        writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    cfg = _token_config("tfrecord", path, "data.vocab_size=8", "data.feature_spec={tokens: {dtype: int64}}")
    with pytest.raises(DataError, match=r"floats\.tfrecord record 0, feature 'tokens': holds float_list of 2 values; "
                                        r"expected int64_list of token ids \(any length\)"):
        load_datasets(cfg.data, seed=0)
