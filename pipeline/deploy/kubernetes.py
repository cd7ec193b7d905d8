"""Kubernetes manifests for one server: ConfigMap, Deployment, Service, HorizontalPodAutoscaler, PodDisruptionBudget.

The same layout serves either server (`python -m serving` or the real TF Serving) for the same models.
A pod is ready when its server's grpc.health.v1 says SERVING (both servers bind their ports only once
every model is AVAILABLE) and alive while the REST model-status URL answers. On termination the pod
waits PRE_STOP_S for the endpoints to drop it, then gets SIGTERM: ours drains (health NOT_SERVING, new
calls UNAVAILABLE, accepted ones answered within --grace_period_s), and terminationGracePeriodSeconds
outlasts that drain. docs/deploying.md walks through a rolling update.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any
from urllib.parse import quote

from pipeline.deploy import servers
from pipeline.deploy.container import USER_ID
from pipeline.deploy.settings import PRE_STOP_S, DeploySettings

PART_OF = "mixed-precision-pipeline"
CPU_TARGET_PERCENT = 70  # the autoscaler's target: headroom for a burst while new replicas load their models
STARTUP_BUDGET_S = 600  # loading (and retrying) the models may take this long before liveness counts
MODELS_VOLUME = "models"


@dataclasses.dataclass(frozen=True)
class Server:
    """One server as a Deployment runs it."""

    name: str  # its Kubernetes name and app label
    image: str
    command: tuple[str, ...] | None  # None: the image's ENTRYPOINT
    args: tuple[str, ...]
    models_image: str | None = None  # an image whose container_base holds the models, copied in by an init container


def manifests(server: Server, settings: DeploySettings, config_data: dict[str, str],
              model_names: list[str]) -> dict[str, dict[str, Any]]:
    """{file name: resource} for one server; the ConfigMap's name carries a hash of its data, so a changed
    config rolls the pods onto a new ConfigMap while the old ReplicaSet keeps its own (rollbacks too)."""
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(config_data.items())).encode()).hexdigest()[:10]
    config_map_name = f"{server.name}-config-{digest}"
    return {
        "configmap.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(config_map_name, server),
                           "immutable": True, "data": dict(sorted(config_data.items()))},
        "deployment.yaml": deployment(server, settings, config_map_name, model_names[0]),
        "service.yaml": service(server),
        "hpa.yaml": autoscaler(server, settings),
        "pdb.yaml": {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(server.name, server),
                     "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(server)}}},
    }


def deployment(server: Server, settings: DeploySettings, config_map_name: str, probe_model: str) -> dict[str, Any]:
    """No replicas field: the HorizontalPodAutoscaler owns the count, and `kubectl apply` would reset it."""
    volumes = [{"name": "config", "configMap": {"name": config_map_name}}, {"name": "tmp", "emptyDir": {}}]
    pod: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": settings.termination_grace_period_s,
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": _selector(server)}}],
        "containers": [_server_container(server, settings, probe_model)],
        "volumes": volumes,
    }
    if settings.models_pvc:
        volumes.append({"name": MODELS_VOLUME, "persistentVolumeClaim": {"claimName": settings.models_pvc, "readOnly": True}})
    elif server.models_image:
        volumes.append({"name": MODELS_VOLUME, "emptyDir": {}})
        pod["initContainers"] = [_copy_models_container(server.models_image, settings)]
    template_metadata = {"labels": _labels(server), "annotations": {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(servers.REST_PORT),
        "prometheus.io/path": servers.METRICS_PATH}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(server.name, server),
            "spec": {"selector": {"matchLabels": _selector(server)},
                     # A new pod serves before an old one goes: capacity never drops during a rollout.
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "minReadySeconds": 5, "revisionHistoryLimit": 5,
                     "template": {"metadata": template_metadata, "spec": pod}}}


def _server_container(server: Server, settings: DeploySettings, probe_model: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "server", "image": server.image}
    if server.command:
        container["command"] = list(server.command)
    grpc_probe = {"grpc": {"port": servers.GRPC_PORT}}
    mounts = [{"name": "config", "mountPath": servers.CONFIG_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if settings.models_pvc or server.models_image:
        mounts.append({"name": MODELS_VOLUME, "mountPath": settings.container_base, "readOnly": True})
    return {
        **container,
        "args": list(server.args),
        "ports": [{"name": "grpc", "containerPort": servers.GRPC_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": servers.REST_PORT, "protocol": "TCP"}],
        "env": [{"name": "TMPDIR", "value": "/tmp"}],
        "resources": {"requests": {"cpu": str(settings.cpu), "memory": settings.memory},
                      "limits": {"cpu": str(settings.cpu), "memory": settings.memory}},
        "startupProbe": {**grpc_probe, "periodSeconds": 5, "failureThreshold": STARTUP_BUDGET_S // 5},
        "readinessProbe": {**grpc_probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": f"/v1/models/{quote(probe_model, safe='')}", "port": "http"},
                          "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_S)]}}},
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }


def _copy_models_container(models_image: str, settings: DeploySettings) -> dict[str, Any]:
    """Copies the models out of our image for a server whose image has none (TF Serving's)."""
    return {"name": "copy-models", "image": models_image,
            "command": ["cp", "-R", f"{settings.container_base}/.", "/mnt/models/"],
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}},
            "securityContext": container_security_context(),
            "volumeMounts": [{"name": MODELS_VOLUME, "mountPath": "/mnt/models"}]}


def service(server: Server) -> dict[str, Any]:
    """Both ports by name. gRPC balances per connection through a ClusterIP: see docs/deploying.md."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(server.name, server),
            "spec": {"type": "ClusterIP", "selector": _selector(server), "ports": [
                {"name": "grpc", "port": servers.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
                {"name": "http", "port": servers.REST_PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}]}}


def autoscaler(server: Server, settings: DeploySettings) -> dict[str, Any]:
    """CPU-based: model calls are CPU-bound here; scale-down waits 5 minutes so a dip does not unload warm replicas."""
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _metadata(server.name, server),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": server.name},
                     "minReplicas": settings.min_replicas, "maxReplicas": settings.max_replicas,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                         "type": "Utilization", "averageUtilization": CPU_TARGET_PERCENT}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def pod_security_context() -> dict[str, Any]:
    """Every pod of the kit runs as the image's non-root user; fsGroup lets that user write the volumes it is given
    (the tf.data dispatcher's journal); RuntimeDefault seccomp, as the restricted Pod Security Standard asks."""
    return {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """Every container of the kit: no privilege escalation, no capabilities, a read-only root filesystem (what a
    process must write goes to a volume: /tmp, a journal)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _metadata(name: str, server: Server) -> dict[str, Any]:
    return {"name": name, "labels": _labels(server)}


def _labels(server: Server) -> dict[str, str]:
    return {**_selector(server), "app.kubernetes.io/part-of": PART_OF}


def _selector(server: Server) -> dict[str, str]:
    return {"app.kubernetes.io/name": server.name}
