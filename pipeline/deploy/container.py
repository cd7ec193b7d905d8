"""The container recipe: a Containerfile whose build context is the kit itself (the project's source and the models).

The kit is self-contained so that it can be built wherever an engine and a registry are, with one
command (docs/deploying.md); no image can be built on the development machines. The image installs the
project with pip (both packages and their dependencies, TensorFlow among them), copies the exported models in,
and runs `python -m serving` as a non-root user. The tf.data service's pods run the same image as
`python -m pipeline data-service ...` (data_service.py): one image for serving and for training input.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.deploy import servers
from pipeline.deploy.settings import DeploySettings
from pipeline.errors import DeployError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILES = ("pyproject.toml", "README.md")
# serving is what runs by default; pipeline for the tf.data service's pods and `python -m pipeline verify` in a pod
PROJECT_PACKAGES = ("pipeline", "serving")
BASE_IMAGE = "python:3.11-slim-bookworm"  # the project's Python (pyproject.toml: >=3.11,<3.12)
USER_ID = 1000  # the non-root user the image runs as, and the pods' runAsUser
SOURCE_DIR = "src"  # inside the kit: what `pip install` installs
MODELS_DIR = "models"  # inside the kit: models.config, batching.config, monitoring.config, <model>/<version>/


def project_files() -> dict[str, bytes]:
    """The project's source as the image installs it: {path in the kit: content}, sorted, no caches.

    Raises:
        DeployError: the pipeline does not run from a source tree (a checkout with pyproject.toml).
    """
    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        raise DeployError(f"{PROJECT_ROOT} holds no pyproject.toml: run deploy from a checkout of the project "
                          "(make setup installs it in editable mode)")
    paths = [PROJECT_ROOT / name for name in PROJECT_FILES]
    for package in PROJECT_PACKAGES:
        paths += [path for path in (PROJECT_ROOT / package).rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"]
    return {f"{SOURCE_DIR}/{path.relative_to(PROJECT_ROOT).as_posix()}": path.read_bytes() for path in sorted(paths)}


def entrypoint_argv(settings: DeploySettings) -> list[str]:
    """What the image runs by default: ENTRYPOINT followed by CMD."""
    return [*servers.SERVING_COMMAND, *servers.image_args(settings)]


def containerfile(settings: DeploySettings, sources: list[str]) -> str:
    """The Containerfile (Dockerfile syntax); the image's name, with its content tag, is in the kit's README.md."""
    command = json.dumps(list(servers.SERVING_COMMAND))
    arguments = json.dumps(servers.image_args(settings))
    return f"""\
# The model server image: `python -m serving` and the models of {", ".join(sources)}.
# Written by `python -m pipeline deploy`; edit the configs or the flags and run it again instead of this file.
# Build it where a container engine and a registry are (the build context is this directory):
#   docker build -t IMAGE . && docker push IMAGE      (IMAGE: as README.md and the manifests name it; podman alike)
# The tf.data service's pods run it too, as `python -m pipeline data-service ...` (kubernetes/data-service/).
FROM {BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp
RUN groupadd --gid {USER_ID} serving \\
 && useradd --uid {USER_ID} --gid {USER_ID} --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin serving
WORKDIR /opt/mixed-precision-pipeline
COPY {SOURCE_DIR}/ ./
RUN pip install . && rm -rf build *.egg-info
# Owned by root and read-only to the server: a compromised server cannot change what it serves.
COPY {MODELS_DIR}/ {settings.container_base}/
USER {USER_ID}:{USER_ID}
EXPOSE {servers.GRPC_PORT} {servers.REST_PORT}
# On SIGTERM the server drains for --grace_period_s (docs/serving.md); the runtime's stop timeout must be longer.
STOPSIGNAL SIGTERM
ENTRYPOINT {command}
CMD {arguments}
"""
