"""Fixtures for the deploy tests: `kit`, a kit written once per session; and the offline manifest checks
(manifest_checks.py), loaded by path and registered so that test files can `import manifest_checks`."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest


def _load_manifest_checks():
    spec = importlib.util.spec_from_file_location("manifest_checks", Path(__file__).with_name("manifest_checks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sys.modules.setdefault("manifest_checks", module)


_load_manifest_checks()


@pytest.fixture(scope="session")
def kit(exported_model, tiny_config, workdir):
    """A kit for two exported models (the tiny export and a copy of it under another name), in workdir/kit."""
    from pipeline.config import load_config
    from pipeline.deploy import DeploySettings, deploy

    other = load_config(None, [f"export.base_path={workdir / 'deploy-models'}", "export.model_name=tiny_digits_b"])
    shutil.copytree(exported_model.base_path, other.model_base_path)
    output = workdir / "kit"
    # The containers' model directory is the kit's own models/, so the image's command line runs here unchanged.
    deploy([tiny_config, other], output, DeploySettings(container_base=str(output / "models")),
           sources=["tiny.yaml", "tiny_b.yaml"])
    return output

