"""What the kit tells each server and each pod: KServe's own arguments, probes, drain and security settings."""

from __future__ import annotations

import json
import re

from manifest_checks import CRD_DIR, load_resources, reference_problems, validate_kubernetes

from pipeline.deploy import servers
from pipeline.deploy.settings import PRE_STOP_S, DeploySettings

SERVERS = ("mixed-precision-serving", "tensorflow-serving")


def test_kserve_arguments_are_kserves_tf_serving_runtime_verbatim():
    [runtime] = load_resources(CRD_DIR / "kserve-tensorflow-serving.yaml")
    [container] = runtime["spec"]["containers"]
    assert tuple(container["args"]) == servers.KSERVE_TF_ARGS
    assert tuple(container["command"]) == servers.TENSORFLOW_SERVING_COMMAND


def test_both_kserve_runtimes_start_with_kserves_arguments(kit):
    for server, command in zip(SERVERS, (["python", "-m", "serving"], ["/usr/bin/tensorflow_model_server"])):
        [runtime] = load_resources(kit / f"kserve/{server}/servingruntime.yaml")
        [container] = runtime["spec"]["containers"]
        assert container["name"] == "kserve-container" and container["command"] == command
        assert tuple(container["args"][:len(servers.KSERVE_TF_ARGS)]) == servers.KSERVE_TF_ARGS
    [ours] = load_resources(kit / "kserve/mixed-precision-serving/servingruntime.yaml")
    assert "--host=0.0.0.0" in ours["spec"]["containers"][0]["args"]  # ours binds 127.0.0.1 unless told


def test_inference_services_keep_the_exported_model_name(kit):
    for server, suffix in zip(SERVERS, ("", "-tfserving")):
        [isvc] = load_resources(kit / f"kserve/{server}/inferenceservice-tiny-digits-b.yaml")
        assert isvc["metadata"]["name"] == f"tiny-digits-b{suffix}"
        model = isvc["spec"]["predictor"]["model"]
        assert (model["runtime"], model["storageUri"], model["args"]) == (
            server, "pvc://models/tiny_digits_b", ["--model_name=tiny_digits_b"])


def test_pods_outlast_the_drain_probe_health_and_status_and_run_unprivileged(kit):
    grace = DeploySettings().grace_period_s
    for server in SERVERS:
        [deployment] = load_resources(kit / f"kubernetes/{server}/deployment.yaml")
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert pod["terminationGracePeriodSeconds"] > PRE_STOP_S + grace
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRE_STOP_S)]
        assert container["readinessProbe"]["grpc"] == {"port": servers.GRPC_PORT}
        assert container["startupProbe"]["grpc"] == {"port": servers.GRPC_PORT}
        assert container["livenessProbe"]["httpGet"] == {"path": "/v1/models/tiny_digits", "port": "http"}
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert "replicas" not in deployment["spec"]  # the autoscaler's
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_pods_run_the_images_command_with_the_configmaps_files_and_their_own_threads(kit):
    settings = DeploySettings(container_base=str(kit / "models"))
    image_args = servers.image_args(settings)
    [ours] = load_resources(kit / "kubernetes/mixed-precision-serving/deployment.yaml")
    [container] = ours["spec"]["template"]["spec"]["containers"]
    assert "command" not in container  # the image's ENTRYPOINT
    pod_args = [arg.replace(servers.CONFIG_DIR, settings.container_base) for arg in container["args"]]
    assert pod_args == [*image_args, *servers.thread_flags(DeploySettings().cpu)]
    [tf] = load_resources(kit / "kubernetes/tensorflow-serving/deployment.yaml")
    [container] = tf["spec"]["template"]["spec"]["containers"]
    # TF Serving answers grpc.health.v1 only when asked to (main.cc: enable_grpc_healthcheck_service, default false).
    assert "--enable_grpc_healthcheck_service=true" in container["args"]
    assert set(servers.config_flags(servers.CONFIG_DIR)) <= set(container["args"])
    [copy_models] = tf["spec"]["template"]["spec"]["initContainers"]
    assert copy_models["image"] == ours["spec"]["template"]["spec"]["containers"][0]["image"]


def test_the_containerfile_runs_the_server_as_a_non_root_user(kit):
    text = (kit / "Containerfile").read_text()
    assert re.search(r"^USER 1000:1000$", text, re.MULTILINE)
    assert re.search(rf"^COPY models/ {re.escape(str(kit / 'models'))}/$", text, re.MULTILINE)
    assert json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.MULTILINE)[1]) == ["python", "-m", "serving"]
    assert text.index("RUN pip install .") < text.index("USER 1000:1000")


def test_a_models_pvc_replaces_the_images_copy_for_both_servers(kit, tiny_config, tmp_path):
    from pipeline.deploy import deploy

    output = deploy([tiny_config], tmp_path / "kit", DeploySettings(models_pvc="models"))
    for server in SERVERS:
        [deployment] = load_resources(output / f"kubernetes/{server}/deployment.yaml")
        pod = deployment["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
        resources = [r for path in sorted((output / "kubernetes" / server).glob("*.yaml")) for r in load_resources(path)]
        assert reference_problems(resources) == []
    assert validate_kubernetes(sorted((output / "kubernetes").rglob("*.yaml"))) == []
