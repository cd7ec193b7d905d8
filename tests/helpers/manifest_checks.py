"""The deploy tests' checks, offline: kubernetes-validate --strict over several Kubernetes versions, KServe's
CRD schemas (vendored in tests/pipeline/deploy/kserve_crd/), and the references between resources no schema can
see (port names, selectors, volumes, a StatefulSet's Service, $(VAR) in command lines, a NetworkPolicy's ports).
Test files `import manifest_checks` (tests/helpers/ is on sys.path: tests/conftest.py).
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
CRD_DIR = Path(__file__).resolve().parents[1] / "pipeline" / "deploy" / "kserve_crd"
CRDS = {"ServingRuntime": "serving.kserve.io_servingruntimes.yaml",
        "InferenceService": "serving.kserve.io_inferenceservices.yaml"}
_IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")  # what a port name must be
WORKLOADS = ("Deployment", "StatefulSet")  # the kinds whose pod templates the other resources point at
_VARIABLE = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # $(VAR) as Kubernetes expands it ($$(VAR) escapes)


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
    no container declares, selectors that match no pod template, volume mounts without a volume (or a
    StatefulSet's claim template), ConfigMaps, Deployments and a StatefulSet's Service named but not in the set,
    `$(VAR)` in a command line that names no env var of its container, NetworkPolicy ports no selected pod has."""
    by_kind: dict[str, dict[str, dict]] = {}
    for resource in resources:
        by_kind.setdefault(resource["kind"], {})[resource["metadata"]["name"]] = resource
    workloads = {f"{kind} {name}": workload for kind in WORKLOADS for name, workload in by_kind.get(kind, {}).items()}
    templates = [workload["spec"]["template"] for workload in workloads.values()]
    problems = []
    for name, workload in workloads.items():
        template = workload["spec"]["template"]
        if not _selects(workload["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]):
            problems.append(f"{name}: selector does not match its pod template's labels")
        claims = [claim["metadata"]["name"] for claim in workload["spec"].get("volumeClaimTemplates", [])]
        problems += [f"{name}: {p}" for p in _pod_problems(template["spec"], by_kind.get("ConfigMap", {}), claims)]
    for name, stateful_set in by_kind.get("StatefulSet", {}).items():
        governing = by_kind.get("Service", {}).get(stateful_set["spec"]["serviceName"])
        if governing is None or not _selects(governing["spec"]["selector"],
                                             stateful_set["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"StatefulSet {name}: serviceName {stateful_set['spec']['serviceName']!r} is no Service "
                            "in the kit that selects its pods")
    for name, svc in by_kind.get("Service", {}).items():
        pods = [t for t in templates if _selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        if not pods:
            problems.append(f"Service {name}: its selector matches no Deployment's or StatefulSet's pods")
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
        if not any(_selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]) for t in templates):
            problems.append(f"PodDisruptionBudget {name}: its selector matches no Deployment's or StatefulSet's pods")
    for name, policy in by_kind.get("NetworkPolicy", {}).items():
        problems += [f"NetworkPolicy {name}: {p}" for p in _policy_problems(policy, templates)]
    for name, runtime in by_kind.get("ServingRuntime", {}).items():
        problems += [f"ServingRuntime {name}: {p}" for p in _pod_problems(runtime["spec"], {})]
    return problems


def _policy_problems(policy: dict[str, Any], templates: list[dict[str, Any]]) -> list[str]:
    """The pods it guards must be in the kit, and each port it admits must be one of theirs (a typo admits nothing)."""
    selected = [t for t in templates if _selects(policy["spec"]["podSelector"].get("matchLabels", {}), t["metadata"]["labels"])]
    if not selected:
        return ["its podSelector matches no Deployment's or StatefulSet's pods"]
    declared = {(p.get("protocol", "TCP"), key) for t in selected for c in t["spec"]["containers"]
                for p in c.get("ports", []) for key in (p["containerPort"], p.get("name"))}
    return [f"ingress port {port['port']!r} is no port of the pods it selects"
            for rule in policy["spec"].get("ingress", []) for port in rule.get("ports", [])
            if (port.get("protocol", "TCP"), port["port"]) not in declared]


def _pod_problems(pod: dict[str, Any], config_maps: dict[str, dict], claims: list[str] = ()) -> list[str]:
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
            if mount["name"] not in volumes and mount["name"] not in claims:
                problems.append(f"container {container['name']}: volumeMount {mount['name']!r} names no volume")
        # Kubernetes leaves a $(VAR) that names no env var of the container as it is, silently.
        env = {variable["name"] for variable in container.get("env", [])}
        for variable in sorted({v for arg in [*container.get("command", []), *container.get("args", [])]
                                for v in _VARIABLE.findall(arg)} - env):
            problems.append(f"container {container['name']}: $({variable}) in its command line is no env var it has")
    return problems


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())
