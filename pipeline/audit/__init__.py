"""`pipeline audit`: a server's request log replayed through the float32 twin of the served version.

run.py is the recipe (audit(model_dir, logs)); twin.py builds the reference; replay.py holds the engine's tasks
(scan a log file, replay and compare its requests); report.py writes the text, report.json, plot, reproducers.
"""

import sys

from pipeline import VerbPackage

__all__ = ["audit", "print_report"]

sys.modules[__name__].__class__ = VerbPackage
sys.modules[__name__].exports = {"audit": "run", "print_report": "run"}
