"""The model of each model.kind, and the float32 rule they share (docs/precision.md).

    build.py          build_model (one per kind, below), the serving model, rebuild under another policy,
                      load_trained_model, compile_settings and the language model's nats-per-byte metric
    mlp.py  cnn.py    the built-in kinds' bodies; transformer.py the pre-norm encoder and its Keras layers
    custom.py         model.builder: the user's own Keras model, checked on training rows before it trains
    float32_rule.py   the numerically sensitive layers that compute in float32 under every policy, at any depth
    over_range.py     the layers the training rows would take past float16's range, in float32 too
    nonfinite.py      the first layer whose output is inf or NaN, and the one line that names the fix
    preprocessing.py  the standardisation inside the model (floored divisors) and the image reshape
    exportable.py     a builder's model must load back from model.keras before it trains
    columns.py        category-id columns that a model indexes by, found before training

The language model (model.kind causal_lm) lives in pipeline/lm/, beside its tokenizers and decode loop.
"""

import sys

from pipeline import LazyPackage

# The exported names load from their modules on first use (pipeline.LazyPackage), so that a module here can import
# another (float32_rule from transformer) without loading build.py, which imports them all.
sys.modules[__name__].__class__ = LazyPackage
sys.modules[__name__].exports = {
    **dict.fromkeys(["build_model", "compile_settings", "NatsPerByte", "NATS_PER_BYTE", "NATS_PER_TOKEN",
                     "serving_model", "graph_outputs", "graph_function", "rebuild", "copy_weights",
                     "load_trained_model"], "build"),
    **dict.fromkeys(["apply_precision_rules", "check_float32_outputs", "layer_paths", "numerically_sensitive",
                     "sensitive_layers", "attention_logit_layers", "attention_weights_dropout"], "float32_rule"),
    "standardization_divisors": "preprocessing",
}
__all__ = sorted(sys.modules[__name__].exports)
