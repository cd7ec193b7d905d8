"""pipeline score: csv/npz/tfrecord shards through the exported version on the local engine, into Parquet."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow.dataset as pa_dataset
import pytest
import tensorflow as tf

from pipeline import cli
from pipeline.score import engine
from pipeline.errors import DataError
from pipeline.score import score
from serving.servable.runner import Runner

pytestmark = pytest.mark.timeout(180)


def write_npz(path: Path, rows: np.ndarray, key: str = "features") -> Path:
    np.savez(path, **{key: rows})
    return path


def write_csv(path: Path, rows: np.ndarray, extra_lines: list[list[str]] = ()) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", *(f"pixel_{i}" for i in range(rows.shape[1]))])
        for i, row in enumerate(rows):
            writer.writerow([f"id-{i}", *(repr(float(v)) for v in row)])  # repr: the float32 value exactly
        writer.writerows(extra_lines)
    return path


def example(values, name: str = "features") -> bytes:
    feature = tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))
    return tf.train.Example(features=tf.train.Features(feature={name: feature})).SerializeToString()


def write_tfrecord(path: Path, rows: np.ndarray, extra_records: list[bytes] = ()) -> Path:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for row in rows:
            writer.write(example(row))
        for record in extra_records:
            writer.write(record)
    return path


def expected(runner: Runner, rows: np.ndarray, batch: int) -> dict[str, np.ndarray]:
    """What the runner answers for rows in batches of `batch`: score must give exactly this."""
    parts = [runner.predict({"features": rows[i:i + batch]}) for i in range(0, len(rows), batch)]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def read_predictions(output: Path):
    return pa_dataset.dataset(output / "predictions", format="parquet").to_table()


@pytest.fixture(scope="module")
def shards(exported_model, tmp_path_factory):
    """Three shards of the validation rows, one per format, with bad rows planted in csv and tfrecord."""
    x = exported_model.val_x
    directory = tmp_path_factory.mktemp("shards")
    bad_lines = [["bad-1", *(["seven"] * 64)], ["bad-2", "1.0"], ["bad-3", *(["nan"] * 64)]]
    short = example(x[0][:3])
    return {"dir": directory, "x": x,
            "npz": write_npz(directory / "a.npz", x[:150]),
            "csv": write_csv(directory / "b.csv", x[150:250], bad_lines),
            "tfrecord": write_tfrecord(directory / "c.tfrecord", x[250:350], [b"not an example", short])}


def test_every_format_is_scored_exactly_as_the_runner_answers_with_bad_rows_set_aside(exported_model, shards, tmp_path):
    output = tmp_path / "scored"
    summary = score(exported_model.version_dir, [str(shards["dir"] / "*")], output, batch_size=64, keep=("id",))
    assert summary["rows"] == 355 and summary["scored"] == 350 and summary["bad_rows"] == 5
    assert summary["bad_rows_by_kind"] == {"field_count": 1, "not_a_number": 1, "not_finite": 1, "not_an_example": 1,
                                           "wrong_shape": 1}
    assert summary["model"]["policy"] == "mixed_float16" and summary["rows_per_second"] > 0
    assert [Path(s["input"]).name for s in summary["shards"]] == ["a.npz", "b.csv", "c.tfrecord"]
    table = read_predictions(output)
    assert table.column_names == ["source", "row", "id", "label", "logits", "probabilities"]
    runner = Runner.load(exported_model.version_dir)
    for name, start, stop in (("a.npz", 0, 150), ("b.csv", 150, 250), ("c.tfrecord", 250, 350)):
        part = table.filter(pa_dataset.field("source") == str(shards["dir"] / name))
        assert part.column("row").to_pylist() == list(range(stop - start))
        want = expected(runner, shards["x"][start:stop], 64)
        for output_name in ("logits", "probabilities"):
            got = np.array(part.column(output_name).to_pylist(), np.float32)
            np.testing.assert_array_equal(got, want[output_name])
        assert part.column("label").to_pylist() == [str(i) for i in want["probabilities"].argmax(-1)]
    ids = table.filter(pa_dataset.field("source") == str(shards["dir"] / "b.csv")).column("id").to_pylist()
    assert ids == [f"id-{i}" for i in range(100)]
    assert set(table.filter(pa_dataset.field("source") == str(shards["dir"] / "a.npz")).column("id").to_pylist()) == {None}
    bad = [json.loads(line) for part in sorted((output / "bad_rows").glob("*.jsonl")) for line in part.read_text().splitlines()]
    assert [(Path(b["source"]).name, b["row"], b["kind"]) for b in bad] == [
        ("b.csv", 100, "not_a_number"), ("b.csv", 101, "field_count"), ("b.csv", 102, "not_finite"),
        ("c.tfrecord", 100, "not_an_example"), ("c.tfrecord", 101, "wrong_shape")]
    assert "'seven' is not a number" in bad[0]["message"] and bad[1]["raw"] == "bad-2,1.0"
    assert json.loads((output / "summary.json").read_text())["scored"] == 350
    runner.close()


def test_rows_given_as_images_or_flat_both_fit_and_a_csv_column_layout_is_the_header_order(exported_model, tmp_path):
    x = exported_model.val_x[:20]
    write_npz(tmp_path / "flat.npz", x, key="x")
    summary = score(exported_model.version_dir, [str(tmp_path / "flat.npz")], tmp_path / "out")
    assert summary["scored"] == 20


@pytest.mark.parametrize("make, message", [
    (lambda d, x: write_npz(d / "wide.npz", np.zeros((5, 10), np.float32)),
     "array 'features' has shape [5, 10]; the model's input 'features' takes rows of shape [64]"),
    (lambda d, x: write_npz(d / "two.npz", np.zeros((5, 64), np.float32), key="other") and
     np.savez(d / "two.npz", a=np.zeros(1), b=np.zeros(1)), "no array named 'features' or 'x' (has a, b)"),
    (lambda d, x: write_csv(d / "narrow.csv", x[:, :10]),
     "11 feature columns (id, pixel_0, pixel_1, pixel_2, pixel_3, pixel_4, pixel_5, pixel_6, pixel_7, pixel_8, "
     "pixel_9) but the model's input 'features' takes 64 values per row"),
    (lambda d, x: write_tfrecord(d / "other.tfrecord", [], [example(x[0], name="pixels")]),
     "record 0: no feature 'features' (has pixels)"),
    (lambda d, x: (d / "rows.parquet").write_text(""), "unknown format .parquet; expected .csv, .npz, .tfrecord"),
])
def test_a_shard_that_does_not_fit_the_model_is_one_line_exit_2_and_nothing_written(exported_model, tmp_path, capsys,
                                                                                  make, message):
    make(tmp_path, exported_model.val_x[:5])
    output = tmp_path / "out"
    code = cli.main(["score", str(exported_model.version_dir), "--input", str(tmp_path / "*"), "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not output.exists() and not list(tmp_path.glob(".tmp-*"))


def test_missing_inputs_model_and_an_existing_output_are_one_line_errors(exported_model, shards, tmp_path, capsys):
    version = str(exported_model.version_dir)
    assert cli.main(["score", version, "--input", str(tmp_path / "none-*.csv"), "--output", str(tmp_path / "o")]) == 2
    assert "none-*.csv: no file matches" in capsys.readouterr().err
    assert cli.main(["score", str(tmp_path), "--input", str(shards["npz"]), "--output", str(tmp_path / "o")]) == 2
    assert "no numeric version directories" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert cli.main(["score", version, "--input", str(shards["npz"]), "--output", str(tmp_path / "taken")]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err


def test_a_job_that_fails_midway_leaves_the_previous_output_whole(exported_model, shards, tmp_path):
    output = tmp_path / "scored"
    score(exported_model.version_dir, [str(shards["npz"])], output)
    before = sorted(p.name for p in output.rglob("*"))
    good = tmp_path / "in" / "a.tfrecord"
    good.parent.mkdir()
    write_tfrecord(good, shards["x"][:50])
    broken = tmp_path / "in" / "b.tfrecord"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF  # its first record reads; a later one fails its checksum
    broken.write_bytes(bytes(data))
    with pytest.raises(DataError, match="b.tfrecord: not a TFRecord file"):
        score(exported_model.version_dir, [str(tmp_path / "in" / "*")], output, overwrite=True)
    assert sorted(p.name for p in output.rglob("*")) == before
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".replaced-*"))


def test_a_dask_cluster_over_tcp_runs_the_same_job(exported_model, shards, tmp_path):
    """--cluster: the tasks, their results and the model travel as they would to a remote cluster (pickled over
    TCP on 127.0.0.1); the workers here are threads of a cluster this test starts."""
    import distributed

    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, protocol="tcp://",
                                  host="127.0.0.1", dashboard_address=None) as cluster:
        summary = score(exported_model.version_dir, [str(shards["npz"])], tmp_path / "out", batch_size=64,
                        options=engine.EngineOptions(cluster=cluster.scheduler_address))
    assert summary["scored"] == 150 and summary["engine"].startswith("Dask cluster tcp://127.0.0.1:")
    engine.release()
