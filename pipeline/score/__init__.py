"""`pipeline score`: batch predictions for files of rows on the batch engine (engine.py).

run.py is the recipe (score(model_dir, inputs, output)); shards.py reads csv/npz/tfrecord files into rows of
the version's input, setting bad rows aside; images.py reads image folders, image files and tfrecords of
`image/encoded` as bytes for predict_images; predictions.py writes the Parquet parts.
"""

import sys

from pipeline import VerbPackage

__all__ = ["score", "print_summary"]

sys.modules[__name__].__class__ = VerbPackage
sys.modules[__name__].exports = {"score": "run", "print_summary": "run"}
