"""The deploy tests' checks, offline: kubernetes-validate --strict over several Kubernetes versions, KServe's
CRD schemas (vendored in kserve_crd/), and the references between resources no schema can see (port names,
selectors, volumes). Loaded by tests/pipeline/deploy/conftest.py; test files `import manifest_checks`.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

# Three Kubernetes minors the kit must pass, oldest to newest, all bundled by the pinned kubernetes-validate.
KUBERNETES_VERSIONS = ("1.29", "1.33", "1.37")
CRD_DIR = Path(__file__).with_name("kserve_crd")
CRDS = {"ServingRuntime": "serving.kserve.io_servingruntimes.yaml",
        "InferenceService": "serving.kserve.io_inferenceservices.yaml"}
_IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")  # what a port name must be


def load_resources(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def validate_kubernetes(paths: list[Path]) -> list[str]:
    """`kubernetes-validate --strict` for each of KUBERNETES_VERSIONS: the problems it reports.

    The CLI only warns (exit 0) when it has no schema for a kind; here that is a problem, as is any
    resource without a 'passed' line for every version."""
    command = [str(Path(sys.executable).with_name("kubernetes-validate")), "--strict",
               *[arg for version in KUBERNETES_VERSIONS for arg in ("-k", version)], *map(str, paths)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = (result.stdout + result.stderr).splitlines()
    problems = [line for line in lines if not line.startswith("INFO ")]
    expected = sum(len(load_resources(path)) for path in paths) * len(KUBERNETES_VERSIONS)
    passed = sum(" passed for resource " in line for line in lines)
    if passed != expected:
        problems.append(f"{passed} of {expected} resource/version checks passed (exit code {result.returncode})")
    return problems


@functools.cache
def _crd_schema(kind: str) -> tuple[str, dict[str, Any]]:
    crd = yaml.load((CRD_DIR / CRDS[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [version] = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    return f"{crd['spec']['group']}/{version['name']}", _closed(version["schema"]["openAPIV3Schema"])


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused, as the API server's strict field validation (kubectl
    --validate=strict) refuses them: objects with properties and no additionalProperties become closed."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _closed(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [_closed(sub) for sub in schema[key]]
    return schema


def kserve_problems(resource: dict[str, Any]) -> list[str]:
    """Problems against KServe's CRD schema (strict), apiVersion and name included."""
    kind = resource.get("kind")
    if kind not in CRDS:
        return [f"no KServe schema for kind {kind!r}"]
    api_version, schema = _crd_schema(kind)
    problems = [] if resource.get("apiVersion") == api_version else [f"apiVersion {resource.get('apiVersion')!r}, expected {api_version!r}"]
    name = resource.get("metadata", {}).get("name", "")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name):
        problems.append(f"metadata.name {name!r} is not a DNS-1035 label")
    for error in jsonschema.Draft7Validator(schema).iter_errors(resource):
        problems.append(f"{'.'.join(map(str, error.absolute_path))}: {error.message}")
    return problems


def reference_problems(resources: list[dict[str, Any]]) -> list[str]:
    """What a schema cannot see: port names that are not IANA service names, probes and Services naming ports
    no container declares, selectors that match no pod template, volume mounts without a volume, ConfigMaps
    and Deployments named but not in the set."""
    by_kind: dict[str, dict[str, dict]] = {}
    for resource in resources:
        by_kind.setdefault(resource["kind"], {})[resource["metadata"]["name"]] = resource
    problems = []
    for name, deployment in by_kind.get("Deployment", {}).items():
        template = deployment["spec"]["template"]
        if not _selects(deployment["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]):
            problems.append(f"Deployment {name}: selector does not match its pod template's labels")
        problems += [f"Deployment {name}: {p}" for p in _pod_problems(template["spec"], by_kind.get("ConfigMap", {}))]
    for name, svc in by_kind.get("Service", {}).items():
        pods = [d["spec"]["template"] for d in by_kind.get("Deployment", {}).values()
                if _selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        if not pods:
            problems.append(f"Service {name}: its selector matches no Deployment's pods")
        ports = {p.get("name") for pod in pods for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            if isinstance(port.get("targetPort"), str) and port["targetPort"] not in ports:
                problems.append(f"Service {name}: targetPort {port['targetPort']!r} names no container port")
            if not _IANA_SVC_NAME.match(port.get("name", "")):
                problems.append(f"Service {name}: port name {port.get('name')!r} is not an IANA service name")
    for kind in ("HorizontalPodAutoscaler",):
        for name, hpa in by_kind.get(kind, {}).items():
            if hpa["spec"]["scaleTargetRef"]["name"] not in by_kind.get("Deployment", {}):
                problems.append(f"{kind} {name}: scales {hpa['spec']['scaleTargetRef']['name']!r}, not in the kit")
    for name, pdb in by_kind.get("PodDisruptionBudget", {}).items():
        if not any(_selects(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
                   for d in by_kind.get("Deployment", {}).values()):
            problems.append(f"PodDisruptionBudget {name}: its selector matches no Deployment's pods")
    for name, runtime in by_kind.get("ServingRuntime", {}).items():
        problems += [f"ServingRuntime {name}: {p}" for p in _pod_problems(runtime["spec"], {})]
    return problems


def _pod_problems(pod: dict[str, Any], config_maps: dict[str, dict]) -> list[str]:
    problems = []
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for volume in volumes.values():
        if "configMap" in volume and volume["configMap"]["name"] not in config_maps:
            problems.append(f"volume {volume['name']}: ConfigMap {volume['configMap']['name']!r} is not in the kit")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        numbers = {p["containerPort"] for p in container.get("ports", [])}
        problems += [f"container {container['name']}: port name {n!r} is not an IANA service name (at most 15 of "
                     "a-z, 0-9, '-', a letter among them)" for n in ports if not _IANA_SVC_NAME.match(n)]
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(probe_name) or {}
            for handler in ("httpGet", "tcpSocket", "grpc"):
                port = probe.get(handler, {}).get("port")
                if port is not None and not (port in ports if isinstance(port, str) else port in numbers):
                    problems.append(f"container {container['name']}: {probe_name}.{handler}.port {port!r} is no port it declares")
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                problems.append(f"container {container['name']}: volumeMount {mount['name']!r} names no volume")
    return problems


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())
