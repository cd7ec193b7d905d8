"""The experiment's rows, from the source the config names, as tf.data pipelines (docs/data.md).

    spec.py        DataSpec: what the model is trained on and serves
    datasets.py    load_datasets → Datasets (spec, statistics, train/val sources): checks, one statistics pass
    arrays.py      the small sources held in memory: digits, diabetes, synthetic, pointer, npz
    shards.py      the streamed sources' reader (shards, the split rule, the epoch pipeline) and the pass
    tfrecord.py  csv.py  images.py     one module per streamed format
    checks.py      the checks every row passes (labels, finite values, category ids, token ids)
    statistics.py  Statistics in float64 from one streaming pass, the build's sample rows; recorded per run
    service.py     the tf.data service: dispatcher and workers, and training batches read from it

Features stay raw (preprocessing lives inside the model, so serving takes the same raw rows).
"""

from pipeline.data.datasets import (STREAMED, Datasets, categorical_positions, explain_input_failure, in_memory,
                                    input_advice, load_datasets, record)
from pipeline.data.spec import DataSpec
from pipeline.data.statistics import Statistics
from pipeline.data.tfrecord import count_tfrecords
from pipeline.errors import DataError

__all__ = ["STREAMED", "DataError", "DataSpec", "Datasets", "Statistics", "categorical_positions", "count_tfrecords",
           "explain_input_failure", "in_memory", "input_advice", "load_datasets", "record"]
