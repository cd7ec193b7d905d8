"""Kubernetes manifests for the tf.data service that feeds training (pipeline/data/service.py): the dispatcher and its
workers, run from the kit's own image (it installs the whole project with TensorFlow) as `python -m pipeline
data-service ...`.

Why StatefulSets. TensorFlow's dispatcher does not drop a dead worker's task from a running job: the trainers wait
until a worker registers again at the SAME address (measured on TF 2.21). So each worker needs an address that
outlives it: a StatefulSet pod keeps its name (data-worker-0, -1, ...) when it is replaced, the headless Service
gives each name a DNS record, and each worker registers as `$(POD_NAME).data-worker:5051`. The dispatcher journals
its state to --work_dir (fault-tolerant mode) so a restarted dispatcher resumes its jobs; the journal lives on a
PersistentVolumeClaim, which a StatefulSet of one replica creates from its volumeClaimTemplate and keeps.

Why a NetworkPolicy. TensorFlow's servers bind every interface and offer no bind-address option, and they accept
anyone who connects; the policy admits only pods labelled as trainers (TRAINER_LABEL) and the service's own pods.
docs/deploying.md explains how to apply it and point a trainer at it (data.service).
"""

from __future__ import annotations

from typing import Any

from pipeline.data.service import DISPATCHER_PORT, WORKER_PORT  # imports no TensorFlow
from pipeline.deploy.kubernetes import PART_OF, container_security_context, pod_security_context
from pipeline.deploy.settings import DeploySettings

DISPATCHER = "data-dispatcher"  # its Service is the trainers' data.service: grpc://data-dispatcher:5050
WORKERS = "data-worker"  # the StatefulSet and its headless Service: workers are data-worker-<i>.data-worker
COMPONENT = {"app.kubernetes.io/component": "data-service"}  # both kinds of pod, as the NetworkPolicy selects them
# The label a trainer's pods must carry to reach the service (docs/deploying.md).
TRAINER_LABEL = {"app.kubernetes.io/component": "trainer"}
PIPELINE_COMMAND = ("python", "-m", "pipeline")  # the image's ENTRYPOINT is the model server; these pods run the CLI
JOURNAL_VOLUME, JOURNAL_MOUNT = "journal", "/var/lib/data-service"
DATA_VOLUME = "data"
# The dispatcher hands out shards and tracks heartbeats; no record passes through it.
DISPATCHER_RESOURCES = {"cpu": "1", "memory": "1Gi"}
STARTUP_BUDGET_S = 120  # importing TensorFlow before the server binds its port


def manifests(image: str, settings: DeploySettings) -> dict[str, dict[str, Any]]:
    """{file name: resource} for kubernetes/data-service/."""
    return {"dispatcher-statefulset.yaml": dispatcher(image, settings),
            "dispatcher-service.yaml": service(DISPATCHER, DISPATCHER_PORT, headless=False),
            "worker-statefulset.yaml": workers(image, settings),
            "worker-service.yaml": service(WORKERS, WORKER_PORT, headless=True),
            "worker-pdb.yaml": worker_budget(),
            "networkpolicy.yaml": network_policy()}


def dispatcher_args() -> list[str]:
    """The journal on the claim: a restarted dispatcher (a new pod, the same claim) resumes its jobs."""
    return ["data-service", "dispatcher", f"--port={DISPATCHER_PORT}", f"--work_dir={JOURNAL_MOUNT}/journal"]


def worker_args() -> list[str]:
    """The worker registers under its pod's stable DNS name; Kubernetes expands $(POD_NAME) from the container's env."""
    return ["data-service", "worker", f"--dispatcher={DISPATCHER}:{DISPATCHER_PORT}", f"--port={WORKER_PORT}",
            f"--worker_address=$(POD_NAME).{WORKERS}:{WORKER_PORT}"]


def dispatcher(image: str, settings: DeploySettings) -> dict[str, Any]:
    """One replica with a volumeClaimTemplate: the claim (journal-data-dispatcher-0) outlives every pod, and the
    StatefulSet never runs two dispatchers on one journal, as a Deployment's surge would during a rollout."""
    container = _container("dispatcher", image, dispatcher_args(), DISPATCHER_PORT, DISPATCHER_RESOURCES,
                           [{"name": JOURNAL_VOLUME, "mountPath": JOURNAL_MOUNT}])
    claim = {"metadata": {"name": JOURNAL_VOLUME, "labels": _labels(DISPATCHER)},
             "spec": {"accessModes": ["ReadWriteOnce"],
                      "resources": {"requests": {"storage": settings.data_service_journal_size}}}}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _metadata(DISPATCHER),
            "spec": {"serviceName": DISPATCHER, "replicas": 1, "selector": {"matchLabels": _selector(DISPATCHER)},
                     "template": {"metadata": {"labels": _labels(DISPATCHER)},
                                  "spec": _pod(container, [])},
                     "volumeClaimTemplates": [claim]}}


def workers(image: str, settings: DeploySettings) -> dict[str, Any]:
    """Started in parallel (no worker waits for another); a replaced pod comes back under the same name, so its
    address is the one the dispatcher knows. A replicas field and no autoscaler: a worker scaled away mid-job is
    one the trainers wait for."""
    resources = {"cpu": str(settings.data_service_worker_cpu), "memory": settings.data_service_worker_memory}
    volumes, mounts = [], []
    if settings.data_service_pvc:
        volumes.append({"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": settings.data_service_pvc,
                                                                      "readOnly": True}})
        mounts.append({"name": DATA_VOLUME, "mountPath": settings.data_service_mount, "readOnly": True})
    container = _container("worker", image, worker_args(), WORKER_PORT, resources, mounts)
    container["env"].insert(0, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    pod = _pod(container, volumes)
    pod["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                         "whenUnsatisfiable": "ScheduleAnyway",
                                         "labelSelector": {"matchLabels": _selector(WORKERS)}}]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _metadata(WORKERS),
            "spec": {"serviceName": WORKERS, "replicas": settings.data_service_workers,
                     "podManagementPolicy": "Parallel", "selector": {"matchLabels": _selector(WORKERS)},
                     "template": {"metadata": {"labels": _labels(WORKERS)}, "spec": pod}}}


def service(name: str, port: int, headless: bool) -> dict[str, Any]:
    """The dispatcher: a ClusterIP, whose address stays put when its pod moves. The workers: headless, so each pod
    name resolves to that pod; published before the pod is ready, because the name is the worker's identity (the
    dispatcher's and the trainers'), not a load-balancing entry."""
    spec: dict[str, Any] = {"type": "ClusterIP", "selector": _selector(name), "ports": [
        {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]}
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(name), "spec": spec}


def worker_budget() -> dict[str, Any]:
    """At most one worker away in a node drain: the trainers wait for it until it is back under its name."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(WORKERS),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(WORKERS)}}}


def network_policy() -> dict[str, Any]:
    """TensorFlow's servers listen on every interface: only trainers and the service's own pods (workers registering,
    heartbeats) may connect, and only to the service's ports."""
    service_pods = {**COMPONENT, "app.kubernetes.io/part-of": PART_OF}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata("data-service"),
            "spec": {"podSelector": {"matchLabels": service_pods}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": dict(TRAINER_LABEL)}},
                                           {"podSelector": {"matchLabels": dict(service_pods)}}],
                                  "ports": [{"protocol": "TCP", "port": DISPATCHER_PORT},
                                            {"protocol": "TCP", "port": WORKER_PORT}]}]}}


def _pod(container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """The kit's pod security (kubernetes.pod_security_context: fsGroup makes the journal writable) and /tmp."""
    return {"securityContext": pod_security_context(), "containers": [container],
            "volumes": [*volumes, {"name": "tmp", "emptyDir": {}}]}


def _container(name: str, image: str, args: list[str], port: int, resources: dict[str, str],
               mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """A TCP probe on the port: the server binds it once TensorFlow is imported, and has no health service."""
    tcp_probe = {"tcpSocket": {"port": "grpc"}}
    return {"name": name, "image": image, "command": list(PIPELINE_COMMAND), "args": args,
            "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"}],
            "env": [{"name": "TMPDIR", "value": "/tmp"}],
            "resources": {"requests": dict(resources), "limits": dict(resources)},
            "startupProbe": {**tcp_probe, "periodSeconds": 5, "failureThreshold": STARTUP_BUDGET_S // 5},
            "readinessProbe": {**tcp_probe, "periodSeconds": 10, "failureThreshold": 2},
            "livenessProbe": {**tcp_probe, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
            "securityContext": container_security_context(),
            "volumeMounts": [*mounts, {"name": "tmp", "mountPath": "/tmp"}]}


def _metadata(name: str) -> dict[str, Any]:
    return {"name": name, "labels": _labels(name)}


def _labels(name: str) -> dict[str, str]:
    return {**_selector(name), **COMPONENT, "app.kubernetes.io/part-of": PART_OF}


def _selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name}
