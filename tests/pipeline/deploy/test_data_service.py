"""The tf.data service's manifests (kubernetes/data-service/): what makes the service survive in a cluster. Workers
keep their addresses across restarts (a StatefulSet, a headless Service, --worker_address from the pod's name: the
trainers wait for a worker at the address it had), the dispatcher's journal is on a persistent volume, and a
NetworkPolicy admits only trainers and the service's own pods (TensorFlow's servers bind every interface). Then
the manifests' command lines, run from the kit's src/: a dispatcher and a worker that serve a tf.data job."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from manifest_checks import load_resources, reference_problems, validate_kubernetes

from pipeline.config import load_config
from pipeline.deploy import DeploySettings, data_service
from pipeline.deploy.container import USER_ID

TRAINER_LABEL = {"app.kubernetes.io/component": "trainer"}


def _resources(directory: Path) -> dict[tuple[str, str], dict]:
    """{(kind, name): resource}"""
    return {(r["kind"], r["metadata"]["name"]): r for path in sorted(directory.glob("*.yaml")) for r in load_resources(path)}


@pytest.fixture(scope="module")
def service(kit):
    return _resources(kit / "kubernetes/data-service")


def _container(workload: dict) -> dict:
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


def _flags(container: dict) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if arg.startswith("--"))


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def test_the_kits_command_lines_parse():
    from pipeline.cli import _parser

    dispatcher = _parser().parse_args(data_service.dispatcher_args())
    assert (dispatcher.role, dispatcher.port, dispatcher.work_dir) == ("dispatcher", 5050, "/var/lib/data-service/journal")
    worker = _parser().parse_args(data_service.worker_args())
    assert (worker.role, worker.port, worker.dispatcher, worker.worker_address) == (
        "worker", 5051, "data-dispatcher:5050", "$(POD_NAME).data-worker:5051")


def test_workers_keep_their_address_across_restarts(service):
    """A StatefulSet names its pods data-worker-0, -1, ... and gives a replacement the same name; the headless
    Service makes <pod>.data-worker resolve (before readiness too); each worker registers under that name."""
    workers = service["StatefulSet", "data-worker"]
    headless = service["Service", workers["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert _selects(headless["spec"]["selector"], workers["spec"]["template"]["metadata"]["labels"])
    assert workers["spec"]["replicas"] == DeploySettings().data_service_workers
    assert workers["spec"]["podManagementPolicy"] == "Parallel"
    container = _container(workers)
    assert container["command"] == ["python", "-m", "pipeline"] and container["args"][:2] == ["data-service", "worker"]
    [port] = container["ports"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [port["containerPort"]] == [data_service.WORKER_PORT]
    flags = _flags(container)
    assert flags["port"] == str(port["containerPort"])
    assert flags["worker_address"] == f"$(POD_NAME).{headless['metadata']['name']}:{port['containerPort']}"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    # The dispatcher's Service, by name and port.
    dispatcher_service = service["Service", flags["dispatcher"].split(":")[0]]
    assert [p["port"] for p in dispatcher_service["spec"]["ports"]] == [int(flags["dispatcher"].split(":")[1])]
    # No autoscaler: a worker scaled away mid-job is one the trainers wait for. At most one away in a drain.
    assert not [key for key in service if key[0] == "HorizontalPodAutoscaler"]
    budget = service["PodDisruptionBudget", "data-worker"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert _selects(budget["spec"]["selector"]["matchLabels"], workers["spec"]["template"]["metadata"]["labels"])


def test_the_dispatcher_journals_to_a_persistent_volume(service):
    dispatcher = service["StatefulSet", "data-dispatcher"]
    assert dispatcher["spec"]["replicas"] == 1  # one dispatcher per journal, never two (no surge as in a Deployment)
    container = _container(dispatcher)
    assert container["args"][:2] == ["data-service", "dispatcher"]
    work_dir = _flags(container)["work_dir"]
    [mount] = [m for m in container["volumeMounts"] if Path(work_dir).is_relative_to(m["mountPath"])]
    [claim] = [c for c in dispatcher["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == mount["name"]]
    assert mount["name"] not in {v["name"] for v in dispatcher["spec"]["template"]["spec"]["volumes"]}  # not an emptyDir
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == DeploySettings().data_service_journal_size
    assert not mount.get("readOnly")
    # The root filesystem is read-only, so the journal has to be on the volume; fsGroup lets the user write it.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert dispatcher["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == USER_ID
    # Trainers reach it at the Service's stable address, which the config accepts as data.service.
    front = service["Service", dispatcher["spec"]["serviceName"]]
    assert front["spec"]["type"] == "ClusterIP" and "clusterIP" not in front["spec"]
    address = f"grpc://{front['metadata']['name']}:{front['spec']['ports'][0]['port']}"
    assert address == "grpc://data-dispatcher:5050"
    cfg = load_config(None, ["data.source=csv", "data.path=/data/train-*.csv", f"data.service={address}"])
    assert cfg.data.service == address


def test_the_network_policy_admits_only_trainers_and_the_service_itself(kit, service):
    [policy] = [r for (kind, _), r in service.items() if kind == "NetworkPolicy"]
    spec = policy["spec"]
    pods = {name: r["spec"]["template"]["metadata"]["labels"] for (kind, name), r in service.items() if kind == "StatefulSet"}
    assert {name for name, labels in pods.items() if _selects(spec["podSelector"]["matchLabels"], labels)} == {
        "data-dispatcher", "data-worker"}
    assert spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    sources = [source["podSelector"]["matchLabels"] for source in rule["from"]]
    assert sources[0] == TRAINER_LABEL == data_service.TRAINER_LABEL
    assert all(_selects(sources[1], labels) for labels in pods.values())
    assert all(set(source) == {"podSelector"} for source in rule["from"])  # this namespace only: no namespaceSelector
    assert sorted((p["protocol"], p["port"]) for p in rule["ports"]) == [("TCP", 5050), ("TCP", 5051)]
    # The model servers' pods are neither guarded by it nor admitted by it.
    [serving] = load_resources(kit / "kubernetes/mixed-precision-serving/deployment.yaml")
    serving_labels = serving["spec"]["template"]["metadata"]["labels"]
    assert not _selects(spec["podSelector"]["matchLabels"], serving_labels)
    assert not any(_selects(source, serving_labels) for source in sources)


def test_the_pods_run_the_kits_image_as_the_serving_pods_run(kit, service):
    [serving] = load_resources(kit / "kubernetes/mixed-precision-serving/deployment.yaml")
    serving_pod = serving["spec"]["template"]["spec"]
    for name in ("data-dispatcher", "data-worker"):
        pod = service["StatefulSet", name]["spec"]["template"]["spec"]
        container = _container(service["StatefulSet", name])
        assert container["image"] == serving_pod["containers"][0]["image"]
        assert pod["securityContext"] == serving_pod["securityContext"]
        assert container["securityContext"] == serving_pod["containers"][0]["securityContext"]
        assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed QoS
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["tcpSocket"] == {"port": "grpc"}
    assert _container(service["StatefulSet", "data-worker"])["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}


def test_the_operators_choices_reach_the_manifests_and_still_validate(tmp_path):
    settings = DeploySettings(data_service_workers=5, data_service_worker_cpu=4, data_service_worker_memory="6Gi",
                              data_service_journal_size="3Gi", data_service_pvc="training-data",
                              data_service_mount="/mnt/training")
    manifests = data_service.manifests("registry.example.com/ml/serving:v1", settings)
    for name, resource in manifests.items():
        (tmp_path / name).write_text(yaml.safe_dump(resource))
    assert validate_kubernetes(sorted(tmp_path.glob("*.yaml"))) == []
    assert reference_problems(list(manifests.values())) == []
    workers = manifests["worker-statefulset.yaml"]
    assert workers["spec"]["replicas"] == 5
    container = _container(workers)
    assert container["resources"]["limits"] == {"cpu": "4", "memory": "6Gi"}
    assert {"name": "data", "mountPath": "/mnt/training", "readOnly": True} in container["volumeMounts"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "training-data", "readOnly": True}} in \
        workers["spec"]["template"]["spec"]["volumes"]
    [claim] = manifests["dispatcher-statefulset.yaml"]["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "3Gi"


def _worker(r):
    return r["StatefulSet", "data-worker"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("plant, expected", [
    (lambda r: _worker(r).update(env=[e for e in _worker(r)["env"] if e["name"] != "POD_NAME"]),
     "$(POD_NAME) in its command line is no env var it has"),
    (lambda r: r["StatefulSet", "data-worker"]["spec"].update(serviceName="data-workers"),
     "serviceName 'data-workers' is no Service in the kit that selects its pods"),
    (lambda r: r["NetworkPolicy", "data-service"]["spec"]["ingress"][0]["ports"][1].update(port=5052),
     "ingress port 5052 is no port of the pods it selects"),
    (lambda r: r["NetworkPolicy", "data-service"]["spec"]["podSelector"]["matchLabels"].update(
        {"app.kubernetes.io/component": "data-services"}), "its podSelector matches no Deployment's or StatefulSet's pods"),
    (lambda r: r["StatefulSet", "data-dispatcher"]["spec"]["volumeClaimTemplates"][0]["metadata"].update(name="journals"),
     "volumeMount 'journal' names no volume"),
    (lambda r: r["PodDisruptionBudget", "data-worker"]["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/name": "data-workers"}), "PodDisruptionBudget data-worker: its selector matches no"),
    (lambda r: _worker(r)["startupProbe"]["tcpSocket"].update(port="gprc"), "startupProbe.tcpSocket.port 'gprc'"),
])
def test_a_broken_reference_in_the_data_service_fails(service, plant, expected):
    planted = copy.deepcopy(service)
    plant(planted)
    problems = reference_problems(list(planted.values()))
    assert any(expected in p for p in problems), problems


def test_a_misspelled_field_in_a_statefulset_fails_kubernetes_validate(kit, tmp_path):
    [workers] = load_resources(kit / "kubernetes/data-service/worker-statefulset.yaml")
    workers["spec"]["podManagementPolicies"] = workers["spec"].pop("podManagementPolicy")
    (tmp_path / "worker-statefulset.yaml").write_text(yaml.safe_dump(workers))
    problems = validate_kubernetes([tmp_path / "worker-statefulset.yaml"])
    assert any("'podManagementPolicies' was unexpected" in p for p in problems), problems


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _here(container: dict, flags: dict[str, str]) -> list[str]:
    """The container's argv on this machine: this interpreter, and the flags that name cluster addresses replaced."""
    argv = [sys.executable if container["command"][0] == "python" else container["command"][0], *container["command"][1:]]
    for arg in container["args"]:
        flag = arg.split("=", 1)[0].removeprefix("--")
        argv.append(f"--{flag}={flags[flag]}" if arg.startswith("--") and flag in flags else arg)
    return argv


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """What the pods' TCP probes ask: does the port accept a connection."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"exited with {process.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"port {port} did not open in {timeout_s:g} s")


@pytest.mark.subprocess
@pytest.mark.timeout(240)
def test_the_manifests_command_lines_serve_a_tf_data_job_from_the_kits_source(kit, service, tmp_path):
    """Only what cannot hold outside a cluster changes: free ports on localhost for the Services' names and the pod's
    name, and the journal in tmp_path for the claim."""
    import tensorflow as tf

    dispatcher_port, worker_port = _free_port(), _free_port()
    dispatcher = _container(service["StatefulSet", "data-dispatcher"])
    worker = _container(service["StatefulSet", "data-worker"])
    journal = tmp_path / "journal"
    argvs = [_here(dispatcher, {"port": str(dispatcher_port), "work_dir": str(journal)}),
             _here(worker, {"port": str(worker_port), "dispatcher": f"localhost:{dispatcher_port}",
                            "worker_address": f"localhost:{worker_port}"})]
    processes = []
    try:
        for argv, port in zip(argvs, (dispatcher_port, worker_port)):
            processes.append(subprocess.Popen(argv, cwd=kit / "src", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True))
            _wait_for_port(port, processes[-1])
        dataset = tf.data.Dataset.range(20).apply(tf.data.experimental.service.distribute(
            processing_mode=tf.data.experimental.service.ShardingPolicy.OFF, service=f"grpc://localhost:{dispatcher_port}",
            job_name="kit"))
        assert sorted(int(x) for x in dataset) == list(range(20))
        assert any(journal.rglob("*"))  # fault-tolerant mode: the dispatcher wrote its journal
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
    assert [process.wait(timeout=30) for process in processes] == [0, 0]  # stopped cleanly on SIGTERM, as in a pod
