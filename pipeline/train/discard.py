"""Deletes run-directory entries crash-safely: each is hidden by a rename first, then removed.

Removing a checkpoint or a logs directory takes many unlinks; a process killed midway would leave a
half-deleted directory under its real name, where the next run would take it for a good one (a ckpt-N
that has lost its data files, say). Renamed to a `.tmp-<pid>-discard-<name>` sibling first, it is
out of sight in one atomic step, and a kill leaves only a temporary behind (Checkpointer removes
those of dead processes from the checkpoints directory).

Every caller names the directory it means to clean (`inside`): a path that is not an entry of it, once
symlinks are resolved, is refused before anything is renamed, so a name or a symlink can never point a
deletion elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterable

from pipeline.artifacts import TMP_PREFIX
from pipeline.errors import PipelineError


def discard(paths: Iterable[Path], inside: Path) -> None:
    """Hides, then deletes, each path that exists (a file or a directory), in order.

    Raises PipelineError, having touched nothing, if a path is not an entry of the directory `inside`
    (compared with symlinks resolved; an entry that is a symlink is removed, never followed). The rename
    must succeed (it raises otherwise); the deletion after it is best effort, since a failure there (e.g.
    NFS's .nfs* placeholder for a file still open) leaves only a hidden temporary.
    """
    paths = [Path(path) for path in paths]
    root = Path(inside).resolve()
    for path in paths:
        if path.name in ("", ".", "..") or path.parent.resolve() != root:
            raise PipelineError(f"refusing to delete {path}: it is not an entry of {inside} (which resolves to {root})")
    for path in paths:
        hidden = path.with_name(f"{TMP_PREFIX}{os.getpid()}-discard-{path.name}")
        try:
            os.rename(path, hidden)
        except FileNotFoundError:
            continue
        if hidden.is_dir() and not hidden.is_symlink():
            shutil.rmtree(hidden, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                hidden.unlink()
