"""The float32 rule every model kind shares: numerically sensitive layers compute in float32 under every policy.

Whatever a builder set, unless precision.float16_layers names them (apply_precision_rules): normalisation, softmax,
embeddings, anything with an epsilon below float16's smallest normal number (numerically_sensitive), and
attention's query and key projections (attention_logit_layers) and the dropout of its weights
(attention_weights_dropout), at any depth: inside a MultiHeadAttention, a custom layer or a nested model, each
named by its full path (layer_paths). Keras does not save a sublayer's dtype policy
(docs/keras3-mixed-precision.md §12), so build.load_trained_model applies the rules again to every model loaded
from disk. The over-range rule (over_range.py) adds the layers the training rows themselves would overflow.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

import keras
from keras import layers

from pipeline.errors import ModelError
from pipeline.models import transformer
from pipeline.models.nonfinite import FLOAT16_SMALLEST_NORMAL

# Activations whose float16 exp() overflows or whose small outputs underflow (the audit's errors too).
PROBABILITY_ACTIVATIONS = ("softmax", "log_softmax", "sigmoid")
NORMALIZATION_LAYERS = (layers.BatchNormalization, layers.LayerNormalization, layers.GroupNormalization,
                        layers.Normalization, layers.UnitNormalization, layers.RMSNormalization)
EMBEDDING_LAYERS = (layers.Embedding, transformer.TokenEmbedding)
# Layers that compute query·key scores and their softmax in their own call, from their inputs.
SCORING_ATTENTION_LAYERS = (layers.Attention, layers.AdditiveAttention)
# Layers whose query and key projections are sublayers (docs/keras3-mixed-precision.md §12).
PROJECTING_ATTENTION_LAYERS = (layers.MultiHeadAttention, layers.GroupQueryAttention)


def check_float32_outputs(model: keras.Model) -> None:
    """Raises ModelError when any output is not float32: float16 must never reach a serving client."""
    for tensor in keras.tree.flatten(model.outputs):
        if str(tensor.dtype) != "float32":
            layer = tensor._keras_history.operation.name if hasattr(tensor, "_keras_history") else "?"
            raise ModelError(
                f"model output of layer '{layer}' is {tensor.dtype}; the pipeline serves float32 outputs. "
                "Give the last layer dtype='float32', e.g. keras.layers.Activation('softmax', dtype='float32')")


def numerically_sensitive(layer: layers.Layer) -> str | None:
    """Why the layer must not compute in float16 (None if it may): normalisation divides by a variance that
    float16 flushes or rounds; softmax/sigmoid exp() overflows and small probabilities underflow; an embedding's
    gradient sums over every occurrence of a token (docs/keras3-mixed-precision.md §12); Attention and
    AdditiveAttention compute query·key scores from their inputs; an epsilon below float16's smallest normal
    number becomes subnormal or zero."""
    if isinstance(layer, NORMALIZATION_LAYERS):
        return f"{type(layer).__name__} (means and variances need float32's range)"
    if isinstance(layer, EMBEDDING_LAYERS):
        return "embedding (a token's gradient sums over all its occurrences in a batch; float16 overflows)"
    if isinstance(layer, SCORING_ATTENTION_LAYERS):
        return f"{type(layer).__name__} (query·key scores overflow float16 beyond inputs of ~250)"
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    if isinstance(layer, layers.Softmax) or activation in PROBABILITY_ACTIVATIONS:
        return f"{activation or 'softmax'} (exp() overflows float16, small probabilities underflow)"
    epsilon = getattr(layer, "epsilon", None)
    if isinstance(epsilon, (int, float)) and 0 < epsilon < FLOAT16_SMALLEST_NORMAL:
        return f"epsilon {epsilon:g} (below float16's smallest normal number {FLOAT16_SMALLEST_NORMAL:.2g})"
    return None


def attention_logit_layers(layer: layers.Layer) -> list[layers.Layer]:
    """The query and key projections of a MultiHeadAttention or GroupQueryAttention (once built): their outputs'
    dot product is the attention logits, which overflow float16 (65504) as soon as the inputs reach a few hundred;
    in float32 they make the whole score computation and the softmax float32 (docs/keras3-mixed-precision.md §12)."""
    if not isinstance(layer, PROJECTING_ATTENTION_LAYERS) or not layer.built:
        return []
    return [layer._query_dense, layer._key_dense]


def attention_weights_dropout(layer: layers.Layer) -> layers.Layer | None:
    """The Dropout a MultiHeadAttention or GroupQueryAttention (once built, dropout > 0) applies to its softmax:
    under a mixed policy it casts the float32 weights to the compute dtype, even when not training, so the
    weighted sum ran in float16 whenever model.dropout was set; in float32 it keeps the weights as they are."""
    if not isinstance(layer, PROJECTING_ATTENTION_LAYERS) or not layer.built:
        return None
    return getattr(layer, "_dropout_layer", None)


def layer_paths(model: layers.Layer) -> dict[str, layers.Layer]:
    """Every layer inside model, at any depth (nested models, a layer's sublayers such as a MultiHeadAttention's
    query, key, value, softmax and output), by its full path, e.g. 'block_1_attention/query'. A layer reached
    twice keeps its first path; input layers are left out."""
    found: dict[str, layers.Layer] = {}
    seen: set[int] = set()

    def walk(parent: layers.Layer, prefix: str) -> None:
        for layer in parent._flatten_layers(include_self=False, recursive=False):
            if id(layer) in seen or isinstance(layer, layers.InputLayer):
                continue
            seen.add(id(layer))
            name = layer.name if isinstance(parent, keras.Model) else _stable_name(layer)
            path = prefix + (name if prefix + name not in found else layer.name)
            found[path] = layer
            walk(layer, path + "/")

    walk(model, "")
    return found


def _stable_name(sublayer: layers.Layer) -> str:
    """A sublayer's name without the counter Keras appends to names it makes up ('softmax_7' → 'softmax'): a
    MultiHeadAttention names its softmax and dropout so, and the counter differs between processes."""
    base = re.sub(r"(?<!^)(?=[A-Z])", "_", type(sublayer).__name__).lower()
    return base if re.fullmatch(rf"{re.escape(base)}(_\d+)?", sublayer.name) else sublayer.name


def sensitive_layers(model: layers.Layer) -> dict[str, str]:
    """Full path → why the layer computes in float32 by default, for every layer the precision rules pin."""
    paths = layer_paths(model)
    path_of = {id(layer): path for path, layer in paths.items()}
    reasons = {path: reason for path, layer in paths.items() if (reason := numerically_sensitive(layer))}
    for layer in paths.values():
        for projection in attention_logit_layers(layer):
            reasons[path_of[id(projection)]] = ("attention logits: query·key overflows float16 beyond inputs of "
                                                "~250; float32 here makes the scores and softmax float32")
        dropout = attention_weights_dropout(layer)
        if dropout is not None and id(dropout) in path_of:
            reasons[path_of[id(dropout)]] = ("attention weights' dropout: in the compute dtype it casts the float32 "
                                             "softmax down, and the weighted sum with it")
    return reasons


def apply_precision_rules(model: layers.Layer, float32_layers: Sequence[str] = (),
                          float16_layers: Sequence[str] = ()) -> None:
    """Sets the dtype policy of layers in place, at any depth: float32 for float32_layers and for the numerically
    sensitive layers (sensitive_layers) unless float16_layers names them; naming a layer includes its sublayers.
    In place, so it reaches nested and subclassed models and sublayers alike and keeps the weights
    (docs/keras3-mixed-precision.md §1)."""
    paths = layer_paths(model)
    forced, opted_in = _named_paths(paths, float32_layers), _named_paths(paths, float16_layers)
    pinned = [path for path in paths if _within(path, forced)]
    pinned += [path for path in sensitive_layers(model) if not _within(path, opted_in)]
    for path in pinned:
        layer = paths[path]
        if layer.dtype_policy.name == "float32":
            continue
        layer.dtype_policy = "float32"
        if isinstance(layer, layers.Normalization):  # its mean and variance are cast to the compute dtype here
            layer.finalize_state()


def _named_paths(paths: dict[str, layers.Layer], names: Sequence[str]) -> set[str]:
    """The paths a list of precision.*_layers names: by full path or by layer name."""
    wanted = set(names)
    return {path for path, layer in paths.items() if path in wanted or layer.name in wanted}


def _within(path: str, named: set[str]) -> bool:
    """path is one of named or lies inside one of them."""
    parts = path.split("/")
    return any("/".join(parts[:i]) in named for i in range(1, len(parts) + 1))


def dtype_for(float32_layers: Sequence[str]) -> Callable[[str], str | None]:
    """name → 'float32' for precision.float32_layers, else None (the global policy)."""
    names = set(float32_layers)
    return lambda name: "float32" if name in names else None


def sensitive_dtype_for(float16_layers: Sequence[str]) -> Callable[[str], str | None]:
    """name → None (the policy) for a numerically sensitive layer the config opts into float16, else 'float32'."""
    names = set(float16_layers)
    return lambda name: None if name in names else "float32"


def check_layer_names(model: keras.Model, names: Sequence[str], key: str) -> None:
    """Every name in precision.float32_layers/float16_layers (`key`) is a layer of the model, by name or full path;
    else one ModelError line with the closest name and the model's layers."""
    paths = layer_paths(model)
    known = set(paths) | {layer.name for layer in paths.values()}
    unknown = [name for name in names if name not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(f"precision.{key}: no layer named {unknown[0]!r} in model {model.name!r}; {hint}"
                         f"its layers are: {', '.join(layer.name for layer in model.layers if not isinstance(layer, layers.InputLayer))} "
                         "(a layer inside another by its full path, e.g. 'block_1_attention/query')")
