"""The fields of assets.extra/pipeline.json that every exported version has, whatever its model kind
(publish.py writes a classifier's or regressor's, lm.py a language model's; docs/export.md lists them)."""

from __future__ import annotations

import datetime
from pathlib import Path

from pipeline import artifacts, precision
from pipeline.config import Config
from pipeline.errors import ExportError
from serving.servable import saved_model


def version_to_publish(cfg: Config) -> int:
    """The version an export writes: export.version, or one more than the highest under the base path. Versions are
    immutable, so an existing one is refused (ExportError) before any work goes into it."""
    base = cfg.model_base_path
    version = cfg.export.version or artifacts.next_version(base)
    if version in saved_model.list_versions(base):
        raise ExportError(f"export.version: {base}/{version} already exists; versions are immutable, "
                          "omit export.version to publish the next one")
    return version


def version_header(cfg: Config, version: int, policies: tuple[precision.PolicyInfo, precision.PolicyInfo],
                   version_dir: Path) -> dict:
    """format, name, version, creation time, the trained and the serving policy, and the stored weights."""
    trained_policy, policy = policies
    return {
        "format": 1,
        "model_name": cfg.export.model_name,
        "version": version,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "policy": trained_policy.to_dict(),
        "serving_policy": {**policy.to_dict(), "setting": cfg.export.serving_policy},
        "weights": {"dtype": policy.variable_dtype, "bytes_by_dtype": saved_model.weights_by_dtype(version_dir)},
    }
