"""Every manifest of the kit, validated offline: kubernetes-validate --strict for three Kubernetes versions, KServe's
CRD schemas, and the references between resources; planted mistakes must be caught."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from manifest_checks import KUBERNETES_VERSIONS, kserve_problems, load_resources, reference_problems, validate_kubernetes

SERVERS = ("mixed-precision-serving", "tensorflow-serving")
DATA_SERVICE_FILES = ("dispatcher-service", "dispatcher-statefulset", "networkpolicy", "worker-pdb", "worker-service",
                      "worker-statefulset")


def _kubernetes_files(kit: Path) -> list[Path]:
    return sorted((kit / "kubernetes").rglob("*.yaml"))


def test_every_kubernetes_manifest_passes_strict_validation_for_three_versions(kit):
    files = _kubernetes_files(kit)
    assert [f.relative_to(kit).as_posix() for f in files] == [
        *[f"kubernetes/data-service/{name}.yaml" for name in DATA_SERVICE_FILES],
        *[f"kubernetes/{server}/{name}.yaml" for server in SERVERS
          for name in ("configmap", "deployment", "hpa", "pdb", "service")]]
    assert len(KUBERNETES_VERSIONS) >= 3
    assert validate_kubernetes(files) == []


def test_every_kserve_resource_passes_kserves_crd_schema(kit):
    files = sorted((kit / "kserve").rglob("*.yaml"))
    assert [f.relative_to(kit).as_posix() for f in files] == [
        f"kserve/{server}/{name}.yaml" for server in SERVERS
        for name in ("inferenceservice-tiny-digits-b", "inferenceservice-tiny-digits", "servingruntime")]
    for path in files:
        for resource in load_resources(path):
            assert kserve_problems(resource) == [], path


def test_each_runtime_declares_the_protocols_its_server_speaks(kit):
    """Ours speaks the Open Inference Protocol too (serving/v2/), so KServe may place v2 TensorFlow models on it."""
    protocols = {server: load_resources(kit / f"kserve/{server}/servingruntime.yaml")[0]["spec"]["protocolVersions"]
                 for server in SERVERS}
    assert protocols == {"mixed-precision-serving": ["v1", "grpc-v1", "v2", "grpc-v2"],
                         "tensorflow-serving": ["v1", "grpc-v1"]}


def test_references_between_resources_hold(kit):
    for server in SERVERS:
        resources = [r for path in sorted((kit / "kubernetes" / server).glob("*.yaml")) for r in load_resources(path)]
        assert {r["kind"] for r in resources} == {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler",
                                                  "PodDisruptionBudget"}
        assert reference_problems(resources) == []
    data_service = [r for path in sorted((kit / "kubernetes/data-service").glob("*.yaml")) for r in load_resources(path)]
    assert sorted(r["kind"] for r in data_service) == ["NetworkPolicy", "PodDisruptionBudget", "Service", "Service",
                                                       "StatefulSet", "StatefulSet"]
    assert reference_problems(data_service) == []
    runtimes = [r for path in sorted((kit / "kserve").rglob("servingruntime.yaml")) for r in load_resources(path)]
    assert reference_problems(runtimes) == []


def test_a_misspelled_probe_field_fails_kubernetes_validate(kit, tmp_path):
    deployment = load_resources(kit / "kubernetes/mixed-precision-serving/deployment.yaml")[0]
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    planted = tmp_path / "deployment.yaml"
    planted.write_text(yaml.safe_dump(deployment))
    problems = validate_kubernetes([planted])
    assert len([p for p in problems if "'periodSecond' was unexpected" in p]) == len(KUBERNETES_VERSIONS), problems


def test_a_kind_without_a_schema_fails_rather_than_passing_with_a_warning(kit):
    runtime = kit / "kserve/mixed-precision-serving/servingruntime.yaml"
    problems = validate_kubernetes([runtime])
    assert any("Couldn't find schema for kind ServingRuntime" in p for p in problems), problems


@pytest.mark.parametrize("plant, expected", [
    (lambda r: r["Deployment"]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"].update(port="htpp"),
     "livenessProbe.httpGet.port 'htpp' is no port it declares"),
    (lambda r: r["Service"]["spec"]["ports"][0].update(targetPort="gprc"), "targetPort 'gprc' names no container port"),
    (lambda r: r["Deployment"]["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(name="grpc_port"),
     "port name 'grpc_port' is not an IANA service name"),
    (lambda r: r["Deployment"]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"].update(port=9000),
     "readinessProbe.grpc.port 9000 is no port it declares"),
    (lambda r: r["Service"]["spec"]["selector"].update({"app.kubernetes.io/name": "other"}), "matches no Deployment's or StatefulSet's pods"),
    (lambda r: r["Deployment"]["spec"]["template"]["spec"]["volumes"][0]["configMap"].update(name="stale"),
     "ConfigMap 'stale' is not in the kit"),
])
def test_a_wrong_port_name_or_reference_fails(kit, plant, expected):
    resources = {r["kind"]: r for path in (kit / "kubernetes/mixed-precision-serving").glob("*.yaml")
                 for r in load_resources(path)}
    planted = copy.deepcopy(resources)
    plant(planted)
    problems = reference_problems(list(planted.values()))
    assert any(expected in p for p in problems), problems


def test_a_misspelled_field_in_a_kserve_resource_fails_its_schema(kit):
    [runtime] = load_resources(kit / "kserve/mixed-precision-serving/servingruntime.yaml")
    runtime["spec"]["containers"][0]["readinessProbe"] = {"grpc": {"port": 9000}, "periodSecond": 5}
    assert any("'periodSecond' was unexpected" in p for p in kserve_problems(runtime))
    [service] = load_resources(kit / "kserve/mixed-precision-serving/inferenceservice-tiny-digits.yaml")
    model = service["spec"]["predictor"]["model"]
    model["storageURI"] = model.pop("storageUri")
    assert any("'storageURI' was unexpected" in p for p in kserve_problems(service))
    service["metadata"]["name"] = "tiny_digits"
    assert any("is not a DNS-1035 label" in p for p in kserve_problems(service))
