"""Fixtures for the deploy tests: `kit`, a kit written once per session (the offline manifest checks are
tests/helpers/manifest_checks.py: `import manifest_checks`)."""

from __future__ import annotations

import shutil

import pytest


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

