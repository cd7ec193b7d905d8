"""`python -m pipeline deploy CONFIG... --output DIR`: the deployment kit for the configs' exported models.

The kit (docs/deploying.md):
    Containerfile, src/, models/       the image of `python -m serving` and the models (build context: the kit)
    kubernetes/<server>/               ConfigMap, Deployment, Service, HorizontalPodAutoscaler, PodDisruptionBudget
    kserve/<server>/                   a ServingRuntime and one InferenceService per model
for both servers: mixed-precision-serving (ours) and tensorflow-serving (the real one, same models); and
    kubernetes/data-service/           the tf.data service for training input, from the same image
It is written in a temporary sibling and renamed into place whole, so a reader sees the old kit or the
new one, never a mix; the same inputs give the same bytes (the image tag is a hash of what it holds).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import yaml

from pipeline import artifacts
from pipeline.config import Config
from pipeline.deploy import container, data_service, kserve, kubernetes, servers
from pipeline.deploy.settings import DeploySettings, check_settings
from pipeline.errors import DeployError
from serving.servable import saved_model

OURS = "mixed-precision-serving"
TENSORFLOW_SERVING = "tensorflow-serving"
DATA_SERVICE = "data-service"
KIT_MARKER = ".pipeline-deploy-kit"  # an existing --output is replaced only if it holds this (a kit written before)
_KUBERNETES_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035, as KServe wants InferenceService names

Files = dict[str, "bytes | Path"]  # path in the kit → content, or a file to copy


def deploy(configs: list[Config], output: str | Path, settings: DeploySettings = DeploySettings(),
           sources: list[str] | None = None) -> Path:
    """Writes the kit for the configs' exported models to output, replacing an earlier kit there whole.

    Raises:
        DeployError: a bad setting, a model never exported, a name Kubernetes cannot take, an output that
            is something else than a kit; nothing is written then.
    """
    check_settings(settings)
    sources = sources or [f"config {i + 1}" for i in range(len(configs))]
    output = Path(output)
    _check_output(output)
    versions = _served_versions(configs, sources)
    config_data = _config_data(configs, sources, settings)
    files: Files = {**container.project_files(), **_model_files(versions, config_data),
                    "Containerfile": container.containerfile(settings, sources).encode()}
    image = settings.image if ":" in settings.image.rsplit("/", 1)[-1] else f"{settings.image}:{_content_tag(files)}"
    names = _kubernetes_names(list(versions))
    files.update(_kubernetes_files(image, settings, config_data, list(versions)))
    files.update(_kserve_files(image, settings, names))
    files["README.md"] = _readme(image, sources, names).encode()
    files[KIT_MARKER] = b"written by python -m pipeline deploy; the whole directory is replaced when it runs again\n"
    _publish(files, output)
    return output


def _check_output(output: Path) -> None:
    if output.exists() and not (output.is_dir() and ((output / KIT_MARKER).is_file() or not any(output.iterdir()))):
        raise DeployError(f"--output {output}: exists and is not a kit written by deploy (no {KIT_MARKER}); "
                          "choose a new directory, as the kit replaces it whole")


def _served_versions(configs: list[Config], sources: list[str]) -> dict[str, Path]:
    """{model name: the version directory it serves (the latest: TF Serving's default policy)}."""
    versions: dict[str, Path] = {}
    for cfg, source in zip(configs, sources):
        name = cfg.export.model_name
        if name in versions:
            raise DeployError(f"{source}: export.model_name '{name}' is listed twice; TF Serving needs unique model names")
        found = {v: path for v, path in saved_model.version_dirs(cfg.model_base_path).items() if saved_model.has_saved_model(path)}
        if not found:
            raise DeployError(f"{source}: {name} has no exported version under {cfg.model_base_path} "
                              f"(make export CONFIG={source}); nothing was written")
        versions[name] = found[max(found)]
    return versions


def _config_data(configs: list[Config], sources: list[str], settings: DeploySettings) -> dict[str, str]:
    """The files both servers read: models.config (container paths), batching.config, monitoring.config."""
    from pipeline.export.models_config import models_config
    from serving.batching.parameters import BatchingConfigError, parse_batching_parameters

    batching = servers.BATCHING_PARAMETERS
    if settings.batching_parameters_file:
        try:
            batching = Path(settings.batching_parameters_file).read_text()
            parse_batching_parameters(batching, settings.batching_parameters_file)
        except (OSError, UnicodeDecodeError, BatchingConfigError) as error:
            raise DeployError(f"--batching_parameters_file: {error}") from None
    return {servers.MODELS_CONFIG: models_config(configs, container_base=settings.container_base, sources=sources),
            servers.BATCHING_CONFIG: batching, servers.MONITORING_CONFIG: servers.MONITORING}


def _model_files(versions: dict[str, Path], config_data: dict[str, str]) -> Files:
    files: Files = {f"{container.MODELS_DIR}/{name}": text.encode() for name, text in config_data.items()}
    for name, version_dir in versions.items():
        for path in sorted(version_dir.rglob("*")):
            if path.is_file():
                files[f"{container.MODELS_DIR}/{name}/{version_dir.name}/{path.relative_to(version_dir).as_posix()}"] = path
    return files


def _content_tag(files: Files) -> str:
    """The image tag: a hash of everything the image is built from, so a new export makes a new tag and rollout."""
    digest = hashlib.sha256()
    for name in sorted(files):
        content = files[name]
        digest.update(name.encode() + b"\0")
        digest.update(content.read_bytes() if isinstance(content, Path) else content)
    return f"sha-{digest.hexdigest()[:12]}"


def _kubernetes_names(model_names: list[str]) -> dict[str, str]:
    """{model name: the InferenceService name}: lowercase, '_' and other characters to '-'."""
    names: dict[str, str] = {}
    for model_name in model_names:
        name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", model_name.lower())).strip("-")
        if not (_KUBERNETES_NAME.match(name) and len(name) <= 40):
            raise DeployError(f"model '{model_name}' makes no Kubernetes name (a letter first, then letters, digits "
                              "and '-', at most 40); rename it with export.model_name")
        if name in names.values():
            raise DeployError(f"models '{model_name}' and '{next(m for m, n in names.items() if n == name)}' "
                              f"both become the Kubernetes name '{name}'; rename one with export.model_name")
        names[model_name] = name
    return names


def _kubernetes_files(image: str, settings: DeploySettings, config_data: dict[str, str], model_names: list[str]) -> Files:
    ours = kubernetes.Server(OURS, image, None, tuple(servers.serving_args(settings)))
    tf = kubernetes.Server(TENSORFLOW_SERVING, settings.tensorflow_serving_image, servers.TENSORFLOW_SERVING_COMMAND,
                           tuple(servers.tensorflow_serving_args(settings)), models_image=image)
    files: Files = {f"kubernetes/{server.name}/{file}": _yaml(resource) for server in (ours, tf)
                    for file, resource in kubernetes.manifests(server, settings, config_data, model_names).items()}
    files.update({f"kubernetes/{DATA_SERVICE}/{file}": _yaml(resource)
                  for file, resource in data_service.manifests(image, settings).items()})
    return files


def _kserve_files(image: str, settings: DeploySettings, names: dict[str, str]) -> Files:
    runtimes = {OURS: (image, list(servers.SERVING_COMMAND), servers.kserve_serving_args(settings), "",
                       kserve.OUR_PROTOCOLS),
                TENSORFLOW_SERVING: (settings.tensorflow_serving_image, list(servers.TENSORFLOW_SERVING_COMMAND),
                                     servers.kserve_tensorflow_serving_args(settings), "-tfserving",
                                     kserve.TF_SERVING_PROTOCOLS)}
    files: Files = {}
    for runtime, (runtime_image, command, args, suffix, protocols) in runtimes.items():
        files[f"kserve/{runtime}/servingruntime.yaml"] = _yaml(
            kserve.serving_runtime(runtime, runtime_image, command, args, settings, protocols))
        for model_name, name in names.items():
            files[f"kserve/{runtime}/inferenceservice-{name}.yaml"] = _yaml(
                kserve.inference_service(name + suffix, model_name, runtime, settings))
    return files


class _ManifestDumper(yaml.SafeDumper):
    """Plain YAML as people write manifests: no anchors for repeated parts, multi-line text as `|` blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_ManifestDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _yaml(resource: dict) -> bytes:
    return yaml.dump(resource, Dumper=_ManifestDumper, sort_keys=False, width=120).encode()


def _readme(image: str, sources: list[str], names: dict[str, str]) -> str:
    models = ", ".join(names)
    return f"""\
# Deployment kit: {models}

Written by `python -m pipeline deploy {" ".join(sources)}`; run it again rather than editing these files
(the project's docs/deploying.md explains each one).

| path | what |
|---|---|
| `Containerfile`, `src/`, `models/` | the image `{image}`: `python -m serving` and the models (this directory is the build context) |
| `kubernetes/{OURS}/` | ConfigMap, Deployment, Service, HorizontalPodAutoscaler, PodDisruptionBudget for `python -m serving` |
| `kubernetes/{TENSORFLOW_SERVING}/` | the same for the real TF Serving image, serving the same models |
| `kubernetes/{DATA_SERVICE}/` | the tf.data service for training input (same image): dispatcher and worker StatefulSets, their Services, a PodDisruptionBudget, a NetworkPolicy admitting pods labelled `{_label(data_service.TRAINER_LABEL)}` |
| `kserve/{OURS}/`, `kserve/{TENSORFLOW_SERVING}/` | a KServe ServingRuntime and an InferenceService per model, for either server |

```
docker build -t {image} . && docker push {image}   # where an engine and a registry are (podman alike)
kubectl apply -f kubernetes/{OURS}/                 # or kubernetes/{TENSORFLOW_SERVING}/
kubectl rollout status deployment/{OURS}
kubectl apply -f kubernetes/{DATA_SERVICE}/             # training with data.service: grpc://{data_service.DISPATCHER}:{data_service.DISPATCHER_PORT}
```
"""


def _label(labels: dict[str, str]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in labels.items())


def _publish(files: Files, output: Path) -> None:
    with artifacts.atomic_dir(output, replace=True) as staging:
        for name, content in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, path)
            else:
                path.write_bytes(content)
