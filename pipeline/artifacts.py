"""The on-disk layout in one place: run directories, versioned model directories, atomic writes.

Layout:
    <runs_dir>/<experiment>/             one training run (config.yaml, model.keras, history.json, ...)
    <base_path>/<model_name>/<version>/  one exported SavedModel, as TF Serving expects
        assets.extra/pipeline.json       the pipeline's metadata for that version

Everything is written to a temporary sibling first and renamed into place, so a reader (a person,
`python -m serving`, TF Serving) never sees a half-written file or version. The data is flushed to
disk (fsync) before the rename and the parent directory after it, so a power loss or host crash
leaves either the old or the new content under the name, never an empty or truncated file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline.errors import DiskFullError
from serving.servable import saved_model

TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"  # .replaced-<pid>-<name>: the old directory while a new one takes its name

# A run directory, runs/<experiment>/ (docs/training.md):
CONFIG_FILE = "config.yaml"  # the resolved config, written first
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"  # TensorBoard
DATA_DIR = "data"  # the data's statistics and sample rows (pipeline/data/statistics.py), bad records set aside
HISTORY_FILE = "history.json"
HISTORY_PLOT = "history.png"
MODEL_FILE = "model.keras"  # } written last: together they mark a finished run
METRICS_FILE = "metrics.json"  # }
SAMPLES_FILE = "samples.txt"  # a language model's greedy completion of a fixed prompt after each epoch
PARITY_REJECTED_FILE = "parity-rejected.json"  # the gate's report of an export it refused
SERVER_LOG = "server.log"  # make demo's model server
COMPARE_DIR = "compare"
# A version directory, <base_path>/<model_name>/<version>/: what the pipeline adds to the SavedModel.
# (assets.extra/pipeline.json and the warmup file are the server's facts: serving/servable/saved_model.py, serving/servable/warmup.py.)
PARITY_JSON = Path("assets.extra") / "parity.json"


def next_version(model_dir: str | os.PathLike) -> int:
    """One more than the highest existing version, starting at 1."""
    versions = saved_model.list_versions(model_dir)
    return versions[-1] + 1 if versions else 1


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yields a temporary sibling directory that is renamed to final_path only if the block succeeds.

    On any error the temporary directory (staging_dir) is removed and final_path is untouched.
    With replace=False an existing final_path is an error (versions are immutable); with replace=True
    it is swapped out only once the new directory is complete (publish_dir), then deleted.
    """
    final_path = Path(final_path)
    if final_path.exists() and not replace:
        raise FileExistsError(f"{final_path} already exists; refusing to overwrite it")
    tmp = staging_dir(final_path)
    try:
        with disk_full_is_one_line(final_path, lambda: f"nothing was published at {final_path} (its temporary "
                                   "directory is removed; what was there before is untouched)"):
            yield tmp
            publish_dir(tmp, final_path, replace=replace)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def staging_dir(final_path: Path) -> Path:
    """A new temporary sibling of final_path to write into, for publish_dir to rename into place later.

    Temporaries left by dead processes are removed first. Its name starts with '.tmp-' and is not
    numeric, so model servers polling the parent never load it. Its mode is what the umask allows
    (mkdtemp makes 0700; a serving container may run as another user).
    """
    final_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final_path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{final_path.name}-", dir=final_path.parent))
    os.chmod(tmp, 0o777 & ~umask())
    return tmp


def publish_dir(tmp: Path, final: Path, *, replace: bool = False) -> None:
    """Renames a complete temporary directory to final, durably, keeping an existing final until then.

    The tree is fsynced before the rename and the parent directory after it. Directories cannot be
    renamed over one another, so with replace=True the old final first moves aside to
    `.replaced-<pid>-<name>` and is deleted only after the new one took its name; a process killed
    between the two renames leaves it there, and remove_stale_temporaries puts it back. Without replace,
    the rename fails if final exists (e.g. a version that appeared meanwhile).
    """
    fsync_tree(tmp)
    old = final.with_name(f"{REPLACED_PREFIX}{os.getpid()}-{final.name}") if replace and final.exists() else None
    if old is not None:
        os.rename(final, old)
    try:
        os.rename(tmp, final)  # atomic on one filesystem
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary sibling path (same suffix, for writers that insist on one, like Keras' .keras) that
    replaces path only if the block succeeds, its data flushed to disk before the rename and the directory
    entry after it: path is old or new, never partial."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{path.stem}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fsync(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600
        os.replace(tmp, path)
        fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def fsync(path: Path) -> None:
    """Flushes a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync for every file and directory under directory, itself last."""
    for path in directory.rglob("*"):
        if not path.is_symlink():
            fsync(path)
    fsync(directory)


def remove_stale_temporaries(parent: Path) -> None:
    """Cleans up after processes that died (SIGKILL skips `finally`): removes their temporaries, and puts
    back a directory they had moved aside to replace it (publish_dir) if nothing took its name."""
    for child in parent.glob(f"{TMP_PREFIX}*"):
        pid = child.name[len(TMP_PREFIX):].split("-")[0]
        if child.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)
    for child in parent.glob(f"{REPLACED_PREFIX}*"):
        pid, _, name = child.name[len(REPLACED_PREFIX):].partition("-")
        if not pid.isdigit() or _process_alive(int(pid)):
            continue
        if (parent / name).exists():
            shutil.rmtree(child, ignore_errors=True)
        else:
            os.rename(child, parent / name)


def umask() -> int:
    """The process's umask (os.umask can only be read by setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# What the C library says for ENOSPC; TensorFlow's file writers put it in their own errors' messages.
DISK_FULL_TEXT = "No space left on device"


def is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC, as Python raises it (OSError) or as TensorFlow's writers report it (an OpError such as
    ResourceExhaustedError, whose hint then says OOM), in the error or in what caused it."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or DISK_FULL_TEXT in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def disk_full_is_one_line(path: str | os.PathLike, kept: Callable[[], str]) -> Iterator[None]:
    """Turns the disk filling up inside the block into DiskFullError: one line naming the file (or else path) and
    what was kept, instead of a 50-line TensorFlow traceback with an OOM hint (issue 23)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        if not is_disk_full(error):
            raise
        written = next((e.filename for e in (error, error.__cause__, error.__context__)
                        if isinstance(e, OSError) and e.filename), None) or path
        raise DiskFullError(f"no space left on device writing {written}: {kept()}; free space on that filesystem "
                            "and run the same command again") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes a text file atomically (atomic_file)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())
