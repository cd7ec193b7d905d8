"""CSV files, streamed: named columns, shards, validation files, and the one line each bad file or line costs."""

import numpy as np
import pytest

from data_files import REPO, load, write_csv
from pipeline.data import DataError


GOOD_CSV = "a,b,c,label\n1,2,3,0\n4,5,6,1\n7,8,9,2\n1,1,1,0\n2,2,2,1\n"


def test_csv_reads_named_columns_and_a_validation_file(tmp_path):
    train = write_csv(tmp_path / "train.csv", GOOD_CSV)
    val = write_csv(tmp_path / "val.csv", "label,c,a,b\n1,3,1,2\n")  # column order does not matter
    ds = load("data.source=csv", f"data.path={train}", f"data.validation_path={val}", "data.feature_columns=[c, a]")
    assert ds.train.rows()[0].shape == (5, 2) and ds.spec.num_classes == 3
    np.testing.assert_array_equal(ds.train.rows()[0][0], [3, 1])
    np.testing.assert_array_equal(ds.val.rows()[0], [[3, 1]])
    np.testing.assert_array_equal(ds.train.rows()[1], [0, 1, 2, 0, 1])
    more = write_csv(tmp_path / "more.csv", "a,b,c,label\n" + "1,2,3,0\n4,5,6,1\n7,8,9,2\n" * 10)
    named = load("data.source=csv", f"data.path={more}", "data.label_names=[cat, dog, fish]")
    assert named.spec.label_names == ("cat", "dog", "fish")


def test_csv_regression_targets(tmp_path):
    path = write_csv(tmp_path / "prices.csv", "size,price\n" + "".join(f"{i},{i * 2.5}\n" for i in range(10)))
    ds = load("data.source=csv", f"data.path={path}", "data.label=price", "data.task=regression")
    assert ds.spec.task == "regression" and ds.train.rows()[1].dtype == np.float32 and ds.train.rows()[0].shape[1:] == (1,)


@pytest.mark.parametrize("text, overrides, message", [
    (None, [], r"data\.path: .*missing\.csv not found"),
    ("1,2,3,0\n4,5,6,1\n", [], r"the first line is not a header"),
    ("a,b,c,target\n1,2,3,0\n", [], r"no label column 'label' \(data\.label\); the header has: a, b, c, target"),
    (GOOD_CSV, ["data.feature_columns=[a, d]"], r"no column 'd' \(data\.feature_columns\); the header has: a, b, c, label"),
    ("a,b,c,label\n1,2,3,0\n4,x,6,1\n", [], r"bad\.csv line 3, column 'b': non-numeric value 'x'"),
    ("a,b,c,label\n1,2,3,0\n4,,6,1\n", [], r"bad\.csv line 3, column 'b': the value is missing"),
    ("a,b,c,label\n1,2,3,cat\n", [], r"bad\.csv line 2, column 'label': non-numeric value 'cat'"),
    ("a,b,c,label\n1,2,3,0\n4,5,6\n", [], r"bad\.csv line 3: 3 fields, but the header has 4"),
    ("a,b,c,label\n1,2,3,0\n4,5,6,-1\n", [], r"bad\.csv line 3, column 'label': label -1 is negative"),
    ("a,b,c,label\n1,2,3,0\n4,5,6,10\n", ["data.num_classes=10"], r"bad\.csv line 3, column 'label': label 10 is not below data\.num_classes 10"),
    ("a,b,c,label\n1,2,3,0\n4,5,nan,1\n", [], r"bad\.csv line 3, column 'c': a value is NaN or infinite"),
    ("a,b,c,label\n", [], r"bad\.csv: no training records"),
    ("", [], r"bad\.csv is empty; expected a header row"),
    (GOOD_CSV, ["data.label_names=[x, y]"], r"data\.label_names: 2 names, but the labels have 3 classes"),
])
def test_bad_csv_gets_one_line_naming_file_and_column(tmp_path, text, overrides, message):
    path = tmp_path / ("missing.csv" if text is None else "bad.csv")
    if text is not None:
        write_csv(path, text)
    with pytest.raises(DataError, match=message) as info:
        load("data.source=csv", f"data.path={path}", *overrides)
    assert len(str(info.value).splitlines()) == 1


def test_cli_maps_a_data_error_to_exit_2_before_anything_is_written(tmp_path, capsys):
    from pipeline.cli import main

    bad = write_csv(tmp_path / "bad.csv", "a,label\n1,0\n2,7\n")
    code = main(["train", str(REPO / "configs/default.yaml"), "--set", "data.source=csv", "--set", f"data.path={bad}",
                 "--set", "data.num_classes=3", "--set", f"train.runs_dir={tmp_path / 'runs'}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: data.path: {bad} line 3, column 'label': label 7 is not below data.num_classes 3"
    assert not (tmp_path / "runs").exists()
