"""The on-disk layout in one place: run directories, versioned model directories, atomic writes.

Layout:
    <runs_dir>/<experiment>/             one training run (config.yaml, model.keras, history.json, ...)
    <base_path>/<model_name>/<version>/  one exported SavedModel, as TF Serving expects
        assets.extra/pipeline.json       the pipeline's metadata for that version

Everything is written to a temporary sibling first and renamed into place, so a reader (a person,
`python -m serving`, TF Serving) never sees a half-written file or version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from serving import saved_model

TMP_PREFIX = ".tmp-"

# A run directory, runs/<experiment>/ (docs/training.md):
CONFIG_FILE = "config.yaml"  # the resolved config, written first
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"  # TensorBoard
HISTORY_FILE = "history.json"
HISTORY_PLOT = "history.png"
MODEL_FILE = "model.keras"  # } written last: together they mark a finished run
METRICS_FILE = "metrics.json"  # }
PARITY_REJECTED_FILE = "parity-rejected.json"  # the gate's report of an export it refused
SERVER_LOG = "server.log"  # make demo's model server
COMPARE_DIR = "compare"
# A version directory, <base_path>/<model_name>/<version>/: what the pipeline adds to the SavedModel.
# (assets.extra/pipeline.json and the warmup file are the server's facts: serving/saved_model.py, serving/warmup.py.)
PARITY_JSON = Path("assets.extra") / "parity.json"


def next_version(model_dir: str | os.PathLike) -> int:
    """One more than the highest existing version, starting at 1."""
    versions = saved_model.list_versions(model_dir)
    return versions[-1] + 1 if versions else 1


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yields a temporary sibling directory that is renamed to final_path only if the block succeeds.

    On any error the temporary directory is removed and final_path is untouched. The temporary name
    starts with '.tmp-' and is not numeric, so model servers polling the parent never load it.
    With replace=False an existing final_path is an error (versions are immutable); with replace=True
    it is swapped out only once the new directory is complete, then deleted.
    """
    final_path = Path(final_path)
    if final_path.exists() and not replace:
        raise FileExistsError(f"{final_path} already exists; refusing to overwrite it")
    final_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final_path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{final_path.name}-", dir=final_path.parent))
    old = None
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; a serving container may run as another user
        yield tmp
        if replace and final_path.exists():
            old = final_path.with_name(f"{TMP_PREFIX}{os.getpid()}-old-{final_path.name}")
            os.rename(final_path, old)
        os.rename(tmp, final_path)  # atomic on one filesystem; fails if final_path appeared meanwhile
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary sibling path (same suffix, for writers that insist on one, like Keras' .keras) that
    replaces path only if the block succeeds, its data flushed to disk first: path is old or new, never partial."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{path.stem}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temporaries(parent: Path) -> None:
    """Removes temporaries left by processes that died (SIGKILL skips `finally`)."""
    for child in parent.glob(f"{TMP_PREFIX}*"):
        pid = child.name[len(TMP_PREFIX):].split("-")[0]
        if child.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)


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


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes a text file atomically (atomic_file)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())
