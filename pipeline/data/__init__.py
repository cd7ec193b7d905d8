"""The experiment's rows, from the source the config names, as tf.data pipelines (docs/data.md).

    spec.py        DataSpec: what the model is trained on and serves
    datasets.py    load_datasets → Datasets (spec, statistics, train/val sources): checks, one statistics pass
    arrays.py      the small sources held in memory: digits, diabetes, synthetic, pointer, npz
    shards.py      the streamed sources' reader (shards, the split rule, the epoch pipeline) and the pass
    tfrecord.py  csv.py  images.py     one module per streamed format
    text.py        text for a language model: UTF-8 files or the embedded corpus, the split, windows, baselines
    checks.py      the checks every row passes (labels, finite values, category ids, token ids)
    statistics.py  Statistics in float64 from one streaming pass, the build's sample rows; recorded per run
    service.py     the tf.data service: dispatcher and workers, and training batches read from it
    parquet.py     Parquet converted once to TFRecord shards (python -m pipeline convert)
    examples.py    scikit-learn's digits as PNG folders and CSV shards (python -m pipeline example-data)

Features stay raw (preprocessing lives inside the model, so serving takes the same raw rows).
"""

import sys

from pipeline import LazyPackage
from pipeline.errors import DataError

__all__ = ["Datasets", "DataError", "DataSpec", "Statistics", "explain_input_failure", "in_memory", "input_advice",
           "load_datasets", "record"]

# The CLI reads the data service's defaults (service.py) without loading TensorFlow, which every other module here
# imports: the exported names load from their modules on first use (pipeline.LazyPackage).
sys.modules[__name__].__class__ = LazyPackage
sys.modules[__name__].exports = {
    "Datasets": "datasets", "explain_input_failure": "datasets", "in_memory": "datasets", "input_advice": "datasets",
    "load_datasets": "datasets", "record": "datasets", "DataSpec": "spec", "Statistics": "statistics",
}
