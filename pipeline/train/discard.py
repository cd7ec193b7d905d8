"""Deletes run-directory entries crash-safely: each is hidden by a rename first, then removed.

Removing a checkpoint or a logs directory takes many unlinks; a process killed midway would leave a
half-deleted directory under its real name, where the next run would take it for a good one (a ckpt-N
that has lost its data files, say). Renamed to a `.tmp-<pid>-discard-<name>` sibling first, it is
out of sight in one atomic step, and a kill leaves only a temporary behind (Checkpointer.write removes
those of dead processes from the checkpoints directory).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterable

from pipeline.artifacts import TMP_PREFIX


def discard(paths: Iterable[Path]) -> None:
    """Hides, then deletes, each path that exists (a file or a directory), in order.

    The rename must succeed (it raises otherwise); the deletion after it is best effort, since a failure
    there (e.g. NFS's .nfs* placeholder for a file still open) leaves only a hidden temporary.
    """
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
