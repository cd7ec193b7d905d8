"""The SavedModel the Open Inference Protocol tests serve: serving_default (FP32 x [N, 3] -> y = x / 2 + 2, and
y_half / y_bf16 = x * 0.1 computed in float16 / bfloat16) and echo_<DATATYPE> for each of the protocol's datatypes
(x of any shape -> y, the same values).
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

DTYPES = {"BOOL": tf.bool, "UINT8": tf.uint8, "UINT16": tf.uint16, "UINT32": tf.uint32, "UINT64": tf.uint64,
          "INT8": tf.int8, "INT16": tf.int16, "INT32": tf.int32, "INT64": tf.int64, "FP16": tf.float16,
          "BF16": tf.bfloat16, "FP32": tf.float32, "FP64": tf.float64, "BYTES": tf.string}


def write_echo_model(version_dir: Path) -> Path:
    module = tf.Module()

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def default(x):
        return {"y": x * 0.5 + 2.0, "y_half": tf.cast(x, tf.float16) * tf.constant(0.1, tf.float16),
                "y_bf16": tf.cast(x, tf.bfloat16) * tf.constant(0.1, tf.bfloat16)}

    signatures = {"serving_default": default}
    for name, dtype in DTYPES.items():
        def echo(x):
            return {"y": tf.identity(x)}
        signatures[f"echo_{name}"] = tf.function(echo, input_signature=[tf.TensorSpec(None, dtype, name="x")])
    tf.saved_model.save(module, str(version_dir), signatures=signatures)
    return version_dir
