"""`make deploy`: the container recipe, Kubernetes and KServe manifests for the configs' exported models, and the
tf.data service's manifests for training input.

run.py is the recipe (deploy(configs, output, settings)); settings.py the operator's choices;
servers.py both servers' command lines; container.py the Containerfile; kubernetes.py and
kserve.py the servers' manifests; data_service.py the tf.data service's. docs/deploying.md is the operator's guide.
"""

from pipeline.deploy.run import deploy
from pipeline.deploy.settings import DeploySettings

__all__ = ["deploy", "DeploySettings"]
