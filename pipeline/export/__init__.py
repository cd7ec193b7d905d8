"""`make export`: publishes a trained run as a TF Serving version directory, checked by the parity gate.

publish.py is the recipe (export(cfg)); signatures.py writes the SavedModel's signatures and warmup
file; parity.py is the gate; auto.py the rebuilt serving models and export.serving_policy auto's timing
of them; models_config.py writes TF Serving's models.config.
"""

import sys

from pipeline import VerbPackage
from pipeline.errors import ExportError

__all__ = ["export", "ExportError"]

sys.modules[__name__].__class__ = VerbPackage
sys.modules[__name__].exports = {"export": "publish"}
