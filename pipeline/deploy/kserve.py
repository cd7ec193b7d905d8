"""KServe: a ServingRuntime per server and an InferenceService per model that uses it.

The runtime's container takes the arguments KServe's own TF Serving runtime passes
(kserve config/runtimes/kserve-tensorflow-serving.yaml; servers.KSERVE_TF_ARGS), so `python -m
serving` stands where tensorflow_model_server stands there. KServe names the model after the
InferenceService (`--model_name={{.Name}}`), but Kubernetes names cannot hold '_', so each
InferenceService adds `--model_name=<the exported name>`: KServe appends an InferenceService's args
to the runtime's, and both servers keep a flag's last value, so clients keep the name they know.
"""

from __future__ import annotations

from typing import Any

from pipeline.deploy.container import USER_ID
from pipeline.deploy.settings import DeploySettings

MODEL_FORMAT = {"name": "tensorflow", "version": "2"}
# The protocols each server speaks: TF Serving's REST and gRPC APIs; ours adds the Open Inference Protocol (serving/v2/),
# so KServe may place `protocolVersion: v2` TensorFlow models on it rather than on Triton.
TF_SERVING_PROTOCOLS = ("v1", "grpc-v1")
OUR_PROTOCOLS = (*TF_SERVING_PROTOCOLS, "v2", "grpc-v2")


def serving_runtime(name: str, image: str, command: list[str], args: list[str], settings: DeploySettings,
                    protocols: tuple[str, ...] = TF_SERVING_PROTOCOLS) -> dict[str, Any]:
    """A namespaced ServingRuntime whose one container (KServe requires the name kserve-container) is the server,
    declaring the protocols it speaks."""
    resources = {"cpu": str(settings.cpu), "memory": settings.memory}
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "mixed-precision-pipeline"}},
            "spec": {"supportedModelFormats": [{**MODEL_FORMAT, "autoSelect": False}],
                     "protocolVersions": list(protocols),
                     "containers": [{"name": "kserve-container", "image": image, "command": command, "args": args,
                                     "securityContext": {"runAsUser": USER_ID, "runAsNonRoot": True,
                                                         "allowPrivilegeEscalation": False, "privileged": False,
                                                         "capabilities": {"drop": ["ALL"]}},
                                     "resources": {"requests": resources, "limits": dict(resources)}}]}}


def inference_service(name: str, model_name: str, runtime: str, settings: DeploySettings) -> dict[str, Any]:
    """One model on a runtime, fetched by KServe's storage initializer from <storage_uri>/<model_name> to /mnt/models."""
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "mixed-precision-pipeline"}},
            "spec": {"predictor": {
                "minReplicas": settings.min_replicas, "maxReplicas": settings.max_replicas,
                "terminationGracePeriodSeconds": settings.termination_grace_period_s,
                "model": {"modelFormat": dict(MODEL_FORMAT), "runtime": runtime,
                          "storageUri": f"{settings.storage_uri.rstrip('/')}/{model_name}",
                          "args": [f"--model_name={model_name}"]}}}}
