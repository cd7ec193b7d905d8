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

PIPELINE_JSON = Path("assets.extra") / "pipeline.json"
TMP_PREFIX = ".tmp-"


def list_versions(model_dir: str | os.PathLike) -> list[int]:
    """Numeric version directories under a model's base path, ascending (TF Serving ignores the rest)."""
    root = Path(model_dir)
    if not root.is_dir():
        return []
    versions = []
    for child in root.iterdir():
        if child.is_dir() and child.name.isdigit():
            versions.append(int(child.name))
    return sorted(versions)


def version_dir(model_dir: str | os.PathLike, version: int) -> Path:
    """The directory of one version; TF Serving accepts zero-padded names, so look for those too."""
    root = Path(model_dir)
    for child in root.iterdir() if root.is_dir() else ():
        if child.is_dir() and child.name.isdigit() and int(child.name) == version:
            return child
    return root / str(version)


def latest_version_dir(model_dir: str | os.PathLike) -> Path:
    """The highest numeric version under a base path; FileNotFoundError names the path when there is none."""
    versions = list_versions(model_dir)
    if not versions:
        raise FileNotFoundError(f"{model_dir}: no numeric version directories (expected e.g. {model_dir}/1/saved_model.pb)")
    return version_dir(model_dir, versions[-1])


def next_version(model_dir: str | os.PathLike) -> int:
    """One more than the highest existing version, starting at 1."""
    versions = list_versions(model_dir)
    return versions[-1] + 1 if versions else 1


def read_pipeline_json(version_path: str | os.PathLike) -> dict[str, Any] | None:
    """The pipeline's metadata of an exported version, or None for a model this pipeline did not write."""
    path = Path(version_path) / PIPELINE_JSON
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def serving_policy(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The policy a version's serving graph computes under: pipeline.json's serving_policy, or (exports
    from before export.serving_policy existed) the training policy, which was then always the serving one."""
    metadata = metadata or {}
    return metadata.get("serving_policy") or metadata.get("policy") or {}


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary sibling directory that is renamed to final_path only if the block succeeds.

    On any error the temporary directory is removed and final_path is untouched. The temporary name
    starts with '.tmp-' and is not numeric, so model servers polling the parent never load it.
    """
    final_path = Path(final_path)
    if final_path.exists():
        raise FileExistsError(f"{final_path} already exists; refusing to overwrite it")
    final_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final_path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{final_path.name}-", dir=final_path.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a serving container may run as another user
        yield tmp
        os.rename(tmp, final_path)  # atomic on one filesystem; fails if final_path appeared meanwhile
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(parent: Path) -> None:
    """Removes temporaries left by processes that died (SIGKILL skips `finally`)."""
    for child in parent.glob(f"{TMP_PREFIX}*"):
        pid = child.name[len(TMP_PREFIX):].split("-")[0]
        if child.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)


def _umask() -> int:
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
    """Writes a file through a temporary sibling and os.replace, so it is either old or new, never partial."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())
