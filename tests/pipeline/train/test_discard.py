"""discard: run-directory entries are hidden by a rename, then deleted; used by checkpoint pruning and --fresh."""

import os
import shutil

import pytest

from pipeline.artifacts import CHECKPOINTS_DIR, HISTORY_FILE, LOGS_DIR, TMP_PREFIX
from pipeline.errors import PipelineError
from pipeline.train.discard import discard


def test_discard_removes_files_and_directories_and_skips_missing_ones(tmp_path):
    (tmp_path / CHECKPOINTS_DIR / "ckpt-000000004").mkdir(parents=True)
    (tmp_path / CHECKPOINTS_DIR / "ckpt-000000004" / "state.json").write_text("{}")
    (tmp_path / HISTORY_FILE).write_text("[]")
    (tmp_path / "kept").write_text("x")
    discard((tmp_path / name for name in (CHECKPOINTS_DIR, HISTORY_FILE, LOGS_DIR)), inside=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_an_entry_is_out_of_sight_before_its_deletion_starts(tmp_path, monkeypatch):
    checkpoint = tmp_path / "ckpt-000000008"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text("{}")
    seen = []
    real_rmtree = shutil.rmtree

    def rmtree(path, ignore_errors=False):
        seen.append((checkpoint.exists(), os.path.basename(path)))
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    discard([checkpoint], inside=tmp_path)
    assert seen == [(False, f"{TMP_PREFIX}{os.getpid()}-discard-ckpt-000000008")]
    assert not list(tmp_path.iterdir())


def test_nothing_outside_the_named_directory_is_touched(tmp_path):
    run_dir, outside = tmp_path / "runs" / "exp", tmp_path / "logs"
    (run_dir / LOGS_DIR).mkdir(parents=True)
    outside.mkdir()
    (run_dir / "elsewhere").symlink_to(tmp_path)  # an entry may be a symlink: it is removed, never followed
    for escaping in ([run_dir / ".." / ".." / "logs"], [run_dir / LOGS_DIR, run_dir / "elsewhere" / "logs"],
                     [run_dir / ".."]):
        with pytest.raises(PipelineError, match=r"refusing to delete .*: it is not an entry of"):
            discard(escaping, inside=run_dir)
        assert outside.is_dir() and (run_dir / LOGS_DIR).is_dir(), "a refused call touches nothing"
    discard([run_dir / "elsewhere"], inside=run_dir)
    assert not (run_dir / "elsewhere").exists() and outside.is_dir() and (tmp_path / "runs").is_dir()
