"""Publishing files and directories: fsync before and after the rename, and a kill at any moment leaves the
old or the new content under the name, never neither."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import artifacts
from pipeline.errors import DiskFullError

REPO = Path(__file__).resolve().parents[2]


def _record_fsyncs_and_renames(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync (by the path of its descriptor) and rename, in order."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        real_rename(src, dst)

    def replace(src, dst):
        events.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_a_file_is_flushed_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = _record_fsyncs_and_renames(monkeypatch)
    artifacts.write_json_atomic(tmp_path / "metrics.json", {"a": 1})
    assert [kind for kind, _ in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith(str(tmp_path / ".tmp-")) and events[1][1].endswith("-> metrics.json")
    assert events[2] == ("fsync", str(tmp_path))
    assert artifacts.read_json(tmp_path / "metrics.json") == {"a": 1}


def test_a_directory_is_flushed_file_by_file_before_its_rename_and_its_parent_after(tmp_path, monkeypatch):
    with artifacts.atomic_dir(tmp_path / "1") as staging:
        (staging / "variables").mkdir()
        (staging / "variables" / "variables.index").write_bytes(b"x")
        (staging / "saved_model.pb").write_bytes(b"y")
        events = _record_fsyncs_and_renames(monkeypatch)
    synced_before = {Path(path).relative_to(staging).as_posix() for kind, path in events[:-2]}
    assert synced_before == {".", "variables", "variables/variables.index", "saved_model.pb"}
    assert events[-2:] == [("rename", f"{staging.name} -> 1"), ("fsync", str(tmp_path))]


def test_a_failed_rename_while_replacing_keeps_the_old_directory(tmp_path, monkeypatch):
    final = tmp_path / "compare"
    final.mkdir()
    (final / "report.md").write_text("old")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(artifacts.TMP_PREFIX):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    with pytest.raises(DiskFullError, match=f"^no space left on device writing {final}: nothing was published"):
        with artifacts.atomic_dir(final, replace=True) as staging:
            (staging / "report.md").write_text("new")
            monkeypatch.setattr(os, "rename", rename)
    monkeypatch.undo()
    assert (final / "report.md").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare"]


# A process that moves the old directory aside, then dies by SIGKILL at the moment the new one would take its
# name: the window in which neither is under the name.
_KILLED_IN_THE_WINDOW = """
import os, signal, sys
from pathlib import Path
from pipeline import artifacts

final, tmp = Path(sys.argv[1]), Path(sys.argv[2])
real_rename = os.rename

def rename(src, dst):
    if Path(src) == tmp:
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(src, dst)

os.rename = rename
artifacts.publish_dir(tmp, final, replace=True)
"""


@pytest.mark.subprocess  # SIGKILLs a child process inside the publish window
def test_a_kill_between_the_two_renames_of_a_replacement_leaves_the_old_directory_to_put_back(tmp_path):
    final = tmp_path / "ckpt-000000012"
    tmp = tmp_path / f".tmp-{_dead_pid()}-ckpt-000000012-new"  # written by the process that is killed
    for directory, content in ((final, "old"), (tmp, "new")):
        directory.mkdir()
        (directory / "state.json").write_text(content)
    child = subprocess.run([sys.executable, "-c", _KILLED_IN_THE_WINDOW, str(final), str(tmp)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not final.exists(), "killed after the old one moved aside"
    moved = [p.name for p in tmp_path.iterdir() if p.name.startswith(artifacts.REPLACED_PREFIX)]
    assert moved == [f"{artifacts.REPLACED_PREFIX}{_pid_of(moved[0])}-ckpt-000000012"]

    artifacts.remove_stale_temporaries(tmp_path)  # what the next writer of that directory does first
    assert (final / "state.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def _pid_of(name: str) -> str:
    return name[len(artifacts.REPLACED_PREFIX):].split("-")[0]


def test_a_moved_aside_directory_is_deleted_when_its_replacement_made_it(tmp_path):
    dead = _dead_pid()
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "report.md").write_text("new")
    (tmp_path / f"{artifacts.REPLACED_PREFIX}{dead}-compare").mkdir()
    live = tmp_path / f"{artifacts.REPLACED_PREFIX}{os.getpid()}-other"
    live.mkdir()  # a live process's: its own business
    artifacts.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["compare", live.name])
    assert (tmp_path / "compare" / "report.md").read_text() == "new"


def _dead_pid() -> int:
    """A process id no process can have: Linux allocates ids below pid_max."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())
