"""GPT-2-family checkpoints in Hugging Face's layout (issue 43; docs/pretrained.md): a directory's config.json and
model.safetensors read into causal_lm.build_causal_lm's model, and a model written back in that layout.

    config.json: n_embd, n_layer, n_head, n_positions, n_inner (null: 4·n_embd), vocab_size, layer_norm_epsilon,
                 activation_function, tie_word_embeddings
    model.safetensors: [transformer.]wte.weight [V, D], wpe.weight [P, D], per block h.N.{ln_1, attn.c_attn [D, 3D]
                 (q|k|v side by side), attn.c_proj, ln_2, mlp.c_fc [D, I], mlp.c_proj [I, D]}, ln_f, lm_head.weight
                 (untied only); h.N.attn.bias / masked_bias are causal-mask buffers, skipped

Every tensor's name and shape is checked against the config before the model is built, so a config with absurd
sizes costs a line, not the memory it names; GPT-2's Conv1D stores [in, out], a Dense kernel as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from pipeline.errors import CheckpointError
from pipeline.lm import bpe, causal_lm
from pipeline.lm.safetensors_file import NAMES, TensorFile, write

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
# activation_function → causal_lm.ACTIVATIONS (transformers' ACT2FN: gelu_new and gelu_pytorch_tanh are the tanh
# form, gelu the erf one)
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
# config keys that change the computation in a way this model does not have: (key, the value it must have)
UNSUPPORTED = (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
               ("scale_attn_weights", True))


@dataclass(frozen=True)
class Gpt2Config:
    """A checkpoint's architecture, in build_causal_lm's terms."""
    vocab_size: int
    context_length: int
    num_layers: int
    num_heads: int
    width: int
    mlp_width: int
    norm_epsilon: float
    activation: str
    tied_embeddings: bool

    def model_arguments(self) -> dict:
        """build_causal_lm's keyword arguments: GPT-2's untied head has no bias."""
        return {**asdict(self), "logits_bias": False}


def read_config(directory: str | Path) -> Gpt2Config:
    """config.json → Gpt2Config, every key checked: a missing, mistyped or unsupported one is one line naming it."""
    path = Path(directory) / CONFIG_FILE
    try:
        if os.path.getsize(path) > 1_000_000:
            raise CheckpointError(f"{path}: {os.path.getsize(path):,} bytes; a GPT-2 config is a few hundred")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {CONFIG_FILE} (a GPT-2 checkpoint directory holds {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE}, as Hugging Face writes them)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: a JSON {type(raw).__name__}, not an object of settings")
    if raw.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{path}: model_type {raw['model_type']!r}; this importer reads 'gpt2' checkpoints")
    sizes = {}
    for key in SIZES:
        value = raw.get(key)
        if type(value) is not int or value < 1:
            raise CheckpointError(f"{path}: {key} is {value!r}; it must be a positive integer")
        sizes[key] = value
    mlp_width = raw.get("n_inner") or 4 * sizes["n_embd"]
    if type(mlp_width) is not int or mlp_width < 1:
        raise CheckpointError(f"{path}: n_inner is {raw.get('n_inner')!r}; a positive integer, or null for 4 * n_embd")
    if sizes["n_embd"] % sizes["n_head"]:
        raise CheckpointError(f"{path}: n_embd {sizes['n_embd']} is not a multiple of n_head {sizes['n_head']}")
    epsilon = raw.get("layer_norm_epsilon", 1e-5)
    if type(epsilon) not in (int, float) or not 0 < epsilon < 1:
        raise CheckpointError(f"{path}: layer_norm_epsilon is {epsilon!r}; a number between 0 and 1")
    activation = raw.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{path}: activation_function {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    for key, value in UNSUPPORTED:
        if raw.get(key, value) != value:
            raise CheckpointError(f"{path}: {key} is {raw[key]!r}; this importer supports {key}: "
                                  f"{json.dumps(value)} only (GPT-2's own)")
    tied = raw.get("tie_word_embeddings", True)
    if type(tied) is not bool:
        raise CheckpointError(f"{path}: tie_word_embeddings is {tied!r}; true or false")
    return Gpt2Config(sizes["vocab_size"], sizes["n_positions"], sizes["n_layer"], sizes["n_head"], sizes["n_embd"],
                      mlp_width, float(epsilon), ACTIVATIONS[activation], tied)


def expected_shapes(config: Gpt2Config) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of this config holds, unprefixed, with their shapes."""
    d, inner = config.width, config.mlp_width
    shapes = {"wte.weight": (config.vocab_size, d), "wpe.weight": (config.context_length, d),
              "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for n in range(config.num_layers):
        shapes.update({f"h.{n}.ln_1.weight": (d,), f"h.{n}.ln_1.bias": (d,),
                       f"h.{n}.attn.c_attn.weight": (d, 3 * d), f"h.{n}.attn.c_attn.bias": (3 * d,),
                       f"h.{n}.attn.c_proj.weight": (d, d), f"h.{n}.attn.c_proj.bias": (d,),
                       f"h.{n}.ln_2.weight": (d,), f"h.{n}.ln_2.bias": (d,),
                       f"h.{n}.mlp.c_fc.weight": (d, inner), f"h.{n}.mlp.c_fc.bias": (inner,),
                       f"h.{n}.mlp.c_proj.weight": (inner, d), f"h.{n}.mlp.c_proj.bias": (d,)})
    if not config.tied_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def checked_tensors(directory: str | Path, config: Gpt2Config) -> tuple[TensorFile, dict[str, str]]:
    """The weights file with every tensor's name, dtype and shape checked against the config, and the map from
    expected_shapes' names to the file's (which may carry a `transformer.` prefix). Nothing is read yet."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        sharded = " (a sharded checkpoint, model.safetensors.index.json, is not read yet)" if (
            Path(directory) / (WEIGHTS_FILE + ".index.json")).exists() else ""
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}{sharded}")
    tensors = TensorFile(path)
    expected = expected_shapes(config)
    names = {}
    for name in tensors.names():
        plain = name.removeprefix("transformer.")
        if plain.endswith((".attn.bias", ".attn.masked_bias")) or (plain == "lm_head.weight"
                                                                   and config.tied_embeddings):
            continue  # the causal-mask buffers; a tied head's copy of wte
        if plain not in expected:
            raise CheckpointError(f"{path}: tensor {name!r} is not part of a GPT-2 model of this config "
                                  f"({config.num_layers} layers{', tied' if config.tied_embeddings else ''})")
        if plain in names:
            raise CheckpointError(f"{path}: tensor {plain!r} appears twice ({names[plain]!r} and {name!r})")
        if tensors.shape(name) != expected[plain]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(tensors.shape(name))}; config.json "
                                  f"makes it {list(expected[plain])}")
        dtype = NAMES[tensors.dtype(name)]
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} is {dtype}; weights are one of {', '.join(FLOAT_DTYPES)}")
        names[plain] = name
    missing = [name for name in expected if name not in names]
    if missing:
        raise CheckpointError(f"{path}: no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                      if len(missing) > 1 else ""))
    return tensors, names


def build(directory: str | Path) -> keras.Model:
    """The checkpoint's architecture as a causal_lm model, built under the global policy (precision.apply_policy
    first), its weights file checked but not read: what every build of a run from it makes (training, an export's
    rebuild under the serving policy, diagnose), the weights coming from load_weights or the run's own."""
    config = read_config(directory)
    checked_tensors(directory, config)
    return causal_lm.build_causal_lm(**config.model_arguments())


def load_weights(model: keras.Model, directory: str | Path) -> None:
    """The checkpoint's weights into a model of its architecture (build's), one tensor read at a time: float32
    logits equal to the reference implementation's within float32 rounding (docs/pretrained.md#parity)."""
    config = read_config(directory)
    if config_of(model) != config:
        raise CheckpointError(f"{directory}: the model is not of this checkpoint's architecture")
    _assign(model, config, *checked_tensors(directory, config))


def load(directory: str | Path) -> keras.Model:
    """build and load_weights in one pass over the config and the header."""
    config = read_config(directory)
    tensors, names = checked_tensors(directory, config)
    model = causal_lm.build_causal_lm(**config.model_arguments())
    _assign(model, config, tensors, names)
    return model


def _assign(model: keras.Model, config: Gpt2Config, tensors: TensorFile, names: dict[str, str]) -> None:
    for variable, name, how in _weight_map(model, config):
        variable.assign(tf.cast(_to_variable(tensors.read(names[name]).astype(np.float32), how), variable.dtype))


def save(model: keras.Model, directory: str | Path, tokenizer_files: dict[str, bytes] | None = None) -> None:
    """A causal_lm model written as a GPT-2 checkpoint (config.json, model.safetensors with the `transformer.`
    prefix, float32), as transformers' save_pretrained writes one, so the user's other tools load it, with its
    tokenizer's files (name → bytes: vocab.json, merges.txt) beside them. The directory is made whole under a
    temporary name and renamed into place."""
    directory = Path(directory)
    if directory.exists():
        raise CheckpointError(f"{directory}: exists; a checkpoint is written to a new directory")
    config = config_of(model)
    head = next((layer for layer in model.layers if layer.name == "logits"), None)
    if head is not None and head.use_bias and np.any(np.asarray(tf.cast(head.bias, tf.float32))):
        raise CheckpointError("causal_lm: its logits layer has a bias, which a GPT-2 checkpoint has no tensor for")
    shapes, tensors = expected_shapes(config), {}
    for variable, name, how in _weight_map(model, config):
        _into_tensor(tensors, name, shapes[name], np.asarray(tf.cast(variable, tf.float32)), how)
    tensors = {name: tensors[name] for name in shapes}  # the checkpoint's own order
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a write that died left
    partial.mkdir(parents=True)
    write(partial / WEIGHTS_FILE, {f"transformer.{name}" if not name.startswith("lm_head") else name: value
                                   for name, value in tensors.items()}, {"format": "pt"})
    (partial / CONFIG_FILE).write_text(json.dumps(config_json(config), indent=2) + "\n")
    for name, content in (tokenizer_files or {}).items():
        (partial / name).write_bytes(content)
    os.replace(partial, directory)


def write_random(directory: str | Path, vocabulary: str | Path | None = None, num_layers: int = 2, width: int = 64,
                 num_heads: int = 4, context_length: int = 128, seed: int = 0) -> Path:
    """A random-initialised GPT-2 checkpoint with its tokenizer's files (vocabulary: a directory with vocab.json
    and merges.txt; default bpe.PACKAGED, 457 ids): what the demo and the tests fine-tune when no pretrained one is
    at hand. GPT-2's numerics (tanh GELU, a tied head, epsilon 1e-5), mlp 4 x width."""
    from pipeline import precision

    source = Path(vocabulary) if vocabulary else bpe.PACKAGED
    files = {name: bpe.read_file(source / name) for name in (bpe.VOCAB_FILE, bpe.MERGES_FILE)}
    vocab_size = bpe.parse(files[bpe.VOCAB_FILE], files[bpe.MERGES_FILE], str(source)).vocab_size
    keras.utils.set_random_seed(seed)
    with precision.policy_scope("float32"):
        model = causal_lm.build_causal_lm(vocab_size, context_length, num_layers, num_heads, width, 4 * width,
                                          activation="gelu_tanh", logits_bias=False)
    save(model, directory, files)
    return Path(directory)


def save_run(cfg, directory: str | Path) -> Path:
    """A trained run from a GPT-2 checkpoint (model.init_from, data.tokenizer gpt2) written back in Hugging Face's
    layout, its recorded tokenizer beside it: `python -m pipeline gpt2-checkpoint CONFIG --output DIR`."""
    from pipeline import artifacts, models

    if cfg.data.tokenizer != "gpt2":
        raise CheckpointError(f"gpt2-checkpoint: the run of experiment {cfg.experiment!r} has data.tokenizer "
                              f"{cfg.data.tokenizer!r}; a GPT-2 checkpoint carries GPT-2's tokenizer (data.tokenizer: "
                              "gpt2, with model.init_from)")
    trained = cfg.run_dir / artifacts.MODEL_FILE
    if not trained.exists():
        raise CheckpointError(f"{trained}: not found; train the run first (make train)")
    recorded = cfg.run_dir / artifacts.DATA_DIR
    files = {name: bpe.read_file(recorded / name) for name in (bpe.VOCAB_FILE, bpe.MERGES_FILE)}
    save(models.load_trained_model(trained, cfg.model), directory, files)
    return Path(directory)


def config_of(model: keras.Model) -> Gpt2Config:
    """The Gpt2Config of a causal_lm model (what save writes in config.json)."""
    block = causal_lm.blocks(model)[0]
    tied = not any(layer.name == "logits" for layer in model.layers)
    return Gpt2Config(model.get_layer("token_embedding").vocab_size, causal_lm.context_length(model),
                      len(causal_lm.blocks(model)), block.num_heads, block.width, block.mlp_width, block.norm_epsilon,
                      block.activation, tied)


def config_json(config: Gpt2Config) -> dict:
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[config.activation]
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": config.vocab_size,
            "n_positions": config.context_length, "n_embd": config.width, "n_layer": config.num_layers,
            "n_head": config.num_heads, "n_inner": config.mlp_width, "layer_norm_epsilon": config.norm_epsilon,
            "activation_function": activation, "tie_word_embeddings": config.tied_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


# ---- which checkpoint tensor fills which variable ----

def _weight_map(model: keras.Model, config: Gpt2Config):
    """(variable, checkpoint tensor name, how the tensor becomes the variable's value), for every weight the model
    has that a GPT-2 checkpoint holds. how: AS_IS, STRAY_ROW (wte gains the zero row a stray id reads:
    causal_lm.ReversibleEmbedding), TRANSPOSED (lm_head is [V, D]) or (start, stop): c_attn's columns of q, k or v."""
    d = config.width
    rows = [(model.get_layer("token_embedding").embeddings, "wte.weight", STRAY_ROW),
            (model.get_layer("positions").positions, "wpe.weight", AS_IS)]
    for n, block in enumerate(causal_lm.blocks(model)):
        attention = block.attention
        for norm, name in ((block.norm_1, "ln_1"), (block.norm_2, "ln_2")):
            rows += [(norm.gamma, f"h.{n}.{name}.weight", AS_IS), (norm.beta, f"h.{n}.{name}.bias", AS_IS)]
        for i, dense in enumerate((attention.query, attention.key, attention.value)):
            rows += [(dense.kernel, f"h.{n}.attn.c_attn.weight", (i * d, (i + 1) * d)),
                     (dense.bias, f"h.{n}.attn.c_attn.bias", (i * d, (i + 1) * d))]
        for dense, name in ((attention.output_projection, "attn.c_proj"), (block.mlp_1, "mlp.c_fc"),
                            (block.mlp_2, "mlp.c_proj")):
            rows += [(dense.kernel, f"h.{n}.{name}.weight", AS_IS), (dense.bias, f"h.{n}.{name}.bias", AS_IS)]
    final = model.get_layer("final_norm")
    rows += [(final.gamma, "ln_f.weight", AS_IS), (final.beta, "ln_f.bias", AS_IS)]
    if not config.tied_embeddings:
        rows.append((model.get_layer("logits").kernel, "lm_head.weight", TRANSPOSED))
    return rows


AS_IS, STRAY_ROW, TRANSPOSED = "as is", "stray row", "transposed"


def _to_variable(tensor: np.ndarray, how) -> np.ndarray:
    if how == STRAY_ROW:
        return np.concatenate([tensor, np.zeros((1, tensor.shape[1]), tensor.dtype)])
    if how == TRANSPOSED:
        return tensor.T
    return tensor if how == AS_IS else tensor[..., how[0]:how[1]]


def _into_tensor(tensors: dict, name: str, shape, value: np.ndarray, how) -> None:
    """The inverse of _to_variable: a variable's value written into the checkpoint tensor it came from."""
    if how == STRAY_ROW:
        tensors[name] = value[:-1]
    elif how == TRANSPOSED:
        tensors[name] = value.T
    elif how == AS_IS:
        tensors[name] = value
    else:
        tensors.setdefault(name, np.zeros(shape, np.float32))[..., how[0]:how[1]] = value
