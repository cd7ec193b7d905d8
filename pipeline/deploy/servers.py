"""The command lines of the two servers a kit can run: `python -m serving` and the real tensorflow_model_server.

One home for every flag the kit passes. Both servers take tensorflow_model_server's flag names
(docs/serving.md), so the lists differ only where the servers do: ours binds 127.0.0.1 unless told
--host, and drains on SIGTERM for --grace_period_s; TF Serving serves grpc.health.v1 only with
--enable_grpc_healthcheck_service (tensorflow_serving/model_servers/main.cc, server.h) and has no drain.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from pipeline.deploy.settings import DeploySettings

GRPC_PORT = 8500  # TF Serving's defaults, as its image exposes them
REST_PORT = 8501
CONFIG_DIR = "/etc/serving"  # the ConfigMap's mount in Kubernetes pods
MODELS_CONFIG = "models.config"
BATCHING_CONFIG = "batching.config"
MONITORING_CONFIG = "monitoring.config"
METRICS_PATH = "/monitoring/prometheus/metrics"

# KServe's TF Serving runtime, verbatim (kserve config/runtimes/kserve-tensorflow-serving.yaml): the model
# name is the InferenceService's name, and the storage initializer puts the model at /mnt/models.
KSERVE_MODEL_DIR = "/mnt/models"
KSERVE_TF_ARGS = ("--model_name={{.Name}}", "--port=9000", "--rest_api_port=8080",
                  f"--model_base_path={KSERVE_MODEL_DIR}", "--rest_api_timeout_in_ms=60000")
KSERVE_REST_PORT = 8080

SERVING_COMMAND = ("python", "-m", "serving")
TENSORFLOW_SERVING_COMMAND = ("/usr/bin/tensorflow_model_server",)

# TF Serving's BatchingParameters for the kit: a batch runs as soon as a batch thread is free (no waiting
# for a lone request); one batch thread, since TensorFlow spreads one batch over every core already
# (docs/operations.md, Batching). Both servers read this file.
BATCHING_PARAMETERS = """\
max_batch_size { value: 64 }
batch_timeout_micros { value: 0 }
max_enqueued_batches { value: 100 }
num_batch_threads { value: 1 }
"""
MONITORING = f'prometheus_config {{ enable: true, path: "{METRICS_PATH}" }}\n'


def config_flags(config_dir: str) -> list[str]:
    """The model list, batching and metrics: the same files for both servers."""
    config_dir = PurePosixPath(config_dir)
    return [f"--model_config_file={config_dir / MODELS_CONFIG}", "--enable_batching=true",
            f"--batching_parameters_file={config_dir / BATCHING_CONFIG}",
            f"--monitoring_config_file={config_dir / MONITORING_CONFIG}"]


def thread_flags(cpu: int) -> list[str]:
    """TensorFlow's and the RPC thread pools sized for the pod's cores: each server would otherwise size
    them for the whole node, which a CPU limit then throttles (TF Serving's defaults: 4 RPC threads per core)."""
    return [f"--tensorflow_intra_op_parallelism={cpu}", f"--tensorflow_inter_op_parallelism={cpu}",
            f"--grpc_max_threads={4 * cpu}", f"--rest_api_num_threads={4 * cpu}"]


def image_args(settings: DeploySettings) -> list[str]:
    """The image's default arguments (CMD): serve every model copied into the image, on all addresses."""
    return [*_listen(), *config_flags(settings.container_base), f"--grace_period_s={settings.grace_period_s:g}"]


def serving_args(settings: DeploySettings) -> list[str]:
    """`python -m serving` in a Kubernetes pod: the image's arguments, with the ConfigMap's files and the pod's threads."""
    return [*_listen(), *config_flags(CONFIG_DIR), f"--grace_period_s={settings.grace_period_s:g}",
            *thread_flags(settings.cpu)]


def tensorflow_serving_args(settings: DeploySettings) -> list[str]:
    """tensorflow_model_server in a Kubernetes pod, for the same models and files (it binds all addresses)."""
    return [f"--port={GRPC_PORT}", f"--rest_api_port={REST_PORT}", *config_flags(CONFIG_DIR),
            "--enable_grpc_healthcheck_service=true", *thread_flags(settings.cpu)]


def kserve_serving_args(settings: DeploySettings) -> list[str]:
    """Our server under KServe: KServe's TF Serving arguments as they are, then what ours needs besides."""
    return [*KSERVE_TF_ARGS, "--host=0.0.0.0", f"--grace_period_s={settings.grace_period_s:g}",
            *thread_flags(settings.cpu)]


def kserve_tensorflow_serving_args(settings: DeploySettings) -> list[str]:
    """The real TF Serving under KServe: KServe's own arguments, with the pod's threads."""
    return [*KSERVE_TF_ARGS, *thread_flags(settings.cpu)]


def _listen() -> list[str]:
    return ["--host=0.0.0.0", f"--port={GRPC_PORT}", f"--rest_api_port={REST_PORT}"]
