"""What an operator chooses for a deployment kit: images, replicas, resources, drain, where models come from, and
the tf.data service's workers.

Everything else in the kit follows from the experiment configs and their exported models. Checked before
anything is written: a bad value costs one line and exit code 2 (DeployError).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import PurePosixPath

from pipeline.errors import DeployError

# The pod's preStop pause before SIGTERM: time for endpoint controllers and kube-proxy to stop sending
# new connections to a terminating pod, so they do not meet a server that already refuses them.
PRE_STOP_S = 5
# After the drain: the server's last accept-and-refuse pass, closing the request log, TensorFlow's exit.
SHUTDOWN_MARGIN_S = 5

_IMAGE = re.compile(r"^[a-z0-9]+([._/:-][a-z0-9]+)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_MEMORY = re.compile(r"^[1-9][0-9]*(Mi|Gi)$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_STORAGE_URI = re.compile(r"^(pvc|gs|s3|hdfs|webhdfs|https?|oci|hf)://\S+$")


@dataclasses.dataclass(frozen=True)
class DeploySettings:
    """The operator's choices; defaults suit a small CPU model (see docs/deploying.md)."""

    image: str = "mixed-precision-serving"  # repository[:tag]; without a tag, the kit's content hash is the tag
    tensorflow_serving_image: str = "tensorflow/serving:2.20.0"  # the real TF Serving, for the same models
    min_replicas: int = 2  # the HorizontalPodAutoscaler's floor; 2 keeps one serving through a node drain
    max_replicas: int = 6
    cpu: int = 2  # whole cores per replica (requests = limits); sizes TensorFlow's and the RPC thread pools
    memory: str = "2Gi"
    grace_period_s: float = 10.0  # python -m serving --grace_period_s: the drain on SIGTERM
    models_pvc: str | None = None  # a PersistentVolumeClaim holding <model_name>/<version>/ (hot swaps); default: the image's copy
    storage_uri: str = "pvc://models"  # KServe: models are fetched from <storage_uri>/<model_name>
    container_base: str = "/models"  # where the models lie inside the containers
    batching_parameters_file: str | None = None  # TF Serving's BatchingParameters text; default: BATCHING_PARAMETERS
    # The tf.data service for training input (data_service.py): its workers, and where their input files come from.
    data_service_workers: int = 2  # worker pods; each one a trainer waits for if it dies mid-epoch (docs/deploying.md)
    data_service_worker_cpu: int = 2  # whole cores per worker (requests = limits): reading and decoding shards
    data_service_worker_memory: str = "2Gi"
    data_service_journal_size: str = "1Gi"  # the dispatcher's PersistentVolumeClaim for its journal (--work_dir)
    data_service_pvc: str | None = None  # a PersistentVolumeClaim holding the training files; default: none mounted
    data_service_mount: str = "/data"  # where the workers mount it: the trainers' data.path must name files there

    @property
    def termination_grace_period_s(self) -> int:
        """terminationGracePeriodSeconds: the preStop pause, then the whole drain, then a margin."""
        return PRE_STOP_S + math.ceil(self.grace_period_s) + SHUTDOWN_MARGIN_S


def check_settings(settings: DeploySettings) -> None:
    """Raises DeployError naming every bad value and what is allowed."""
    s = settings
    problems = []
    if not _IMAGE.match(s.image):
        problems.append(f"--image: expected a lowercase image repository, optionally with :tag, got {s.image!r}")
    if not _IMAGE.match(s.tensorflow_serving_image):
        problems.append(f"--tensorflow_serving_image: expected an image reference, got {s.tensorflow_serving_image!r}")
    if not 1 <= s.min_replicas <= s.max_replicas:
        problems.append(f"--min_replicas/--max_replicas: expected 1 <= min <= max, got {s.min_replicas} and {s.max_replicas}")
    if s.cpu < 1:
        problems.append(f"--cpu: expected whole cores (1 or more), got {s.cpu}")
    if not _MEMORY.match(s.memory):
        problems.append(f"--memory: expected a quantity in Mi or Gi such as 2Gi, got {s.memory!r}")
    if not 0 < s.grace_period_s <= 3600:
        problems.append(f"--grace_period_s: expected seconds in (0, 3600], got {s.grace_period_s}")
    if s.models_pvc is not None and not (_DNS_LABEL.match(s.models_pvc) and len(s.models_pvc) <= 63):
        problems.append(f"--models_pvc: expected a PersistentVolumeClaim name (lowercase letters, digits, '-'), got {s.models_pvc!r}")
    if not _STORAGE_URI.match(s.storage_uri):
        problems.append(f"--storage_uri: expected a KServe storage URI such as pvc://models or gs://bucket/models, got {s.storage_uri!r}")
    base = PurePosixPath(s.container_base)
    if not base.is_absolute() or base == PurePosixPath("/") or ".." in base.parts:
        problems.append(f"--container_base: expected an absolute directory other than /, got {s.container_base!r}")
    problems += _data_service_problems(s)
    if problems:
        raise DeployError("; ".join(problems))


def _data_service_problems(s: DeploySettings) -> list[str]:
    """The tf.data service's settings: each would otherwise surface only in the cluster, as a pod that never starts."""
    problems = []
    if s.data_service_workers < 1:
        problems.append(f"--data_service_workers: expected 1 or more workers, got {s.data_service_workers}")
    if s.data_service_worker_cpu < 1:
        problems.append(f"--data_service_worker_cpu: expected whole cores (1 or more), got {s.data_service_worker_cpu}")
    if not _MEMORY.match(s.data_service_worker_memory):
        problems.append(f"--data_service_worker_memory: expected a quantity in Mi or Gi such as 2Gi, "
                        f"got {s.data_service_worker_memory!r}")
    if not _MEMORY.match(s.data_service_journal_size):
        problems.append(f"--data_service_journal_size: expected a quantity in Mi or Gi such as 1Gi, "
                        f"got {s.data_service_journal_size!r}")
    if s.data_service_pvc is not None and not (_DNS_LABEL.match(s.data_service_pvc) and len(s.data_service_pvc) <= 63):
        problems.append(f"--data_service_pvc: expected a PersistentVolumeClaim name (lowercase letters, digits, '-'), "
                        f"got {s.data_service_pvc!r}")
    mount = PurePosixPath(s.data_service_mount)
    # /tmp is the workers' scratch emptyDir: Kubernetes refuses two volumes mounted at one path.
    if not mount.is_absolute() or mount in (PurePosixPath("/"), PurePosixPath("/tmp")) or ".." in mount.parts:
        problems.append(f"--data_service_mount: expected an absolute directory other than / and /tmp, "
                        f"got {s.data_service_mount!r}")
    return problems
