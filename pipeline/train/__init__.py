"""`make train`: trains one experiment under its precision policy into runs/<experiment>/.

run.py is the recipe (train(cfg)); loops.py the two training loops; recorder.py the callback that
writes the run directory, through guard.py (the stop rules and loss-scale health), scalars.py
(TensorBoard) and history.py (history.json/.png); checkpoints.py crash-safe checkpoints; discard.py
crash-safe deletion (checkpoint pruning, --fresh); numerics.py the check-numerics error message;
distribute.py tf.distribute strategies; auto.py precision.policy auto's timed train steps.
"""

import sys

from pipeline import VerbPackage
from pipeline.errors import TrainingError

__all__ = ["train", "build_compiled_model", "RunResult", "TrainingError"]

sys.modules[__name__].__class__ = VerbPackage
sys.modules[__name__].exports = {"train": "run", "build_compiled_model": "run", "RunResult": "run"}
