"""The typed experiment config: one frozen class per YAML section, validated before any work starts.

A YAML file states only what differs from the defaults below. `load_config` merges `--set key=value`
overrides (parsed as YAML scalars), validates everything, and raises ConfigError carrying one line
per problem: the key path, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger(__name__)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# The sections that decide what the weights are: a run resumes, exports and is verified only under these.
WEIGHT_SECTIONS = ("seed", "precision", "data", "model")


class _SafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads '1e-3' as a float (PyYAML follows YAML 1.1, which needs '1.0e-3'), and
    refuses a key given twice in one mapping (YAML requires unique keys; PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) or key is None:
                continue  # unhashable or merge keys: left to PyYAML's own checks
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first_line[key] + 1}); "
                                "each key may appear once per section", key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader subclass


class ConfigError(Exception):
    """A config problem a user must fix; str() is one line per problem, each naming the key path."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in problems))


class Section(BaseModel):
    # allow_inf_nan=False: .inf and .nan are refused for every number (a learning rate of .inf trains to NaN).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PrecisionConfig(Section):
    policy: Literal["float32", "mixed_float16", "mixed_bfloat16", "auto"] = Field(
        "mixed_float16", description="Keras dtype policy for training and serving; 'auto' picks one for the hardware "
                                     "(by timing train steps on a CPU with native bfloat16)")
    loss_scale: Union[str, float] = Field(
        "dynamic", description="'dynamic', 'none', or a static scale (a number); only float16 compute needs one")
    initial_scale: float = Field(2.0 ** 15, gt=0, description="starting dynamic loss scale")
    dynamic_growth_steps: int = Field(2000, gt=0, description="finite steps before the dynamic scale doubles")
    float32_layers: list[Annotated[str, Field(min_length=1)]] = Field(
        [], description="layer names forced to compute in float32 whatever the policy (e.g. normalization layers)")
    float16_layers: list[Annotated[str, Field(min_length=1)]] = Field(
        [], description="numerically sensitive layers (normalization, softmax, small epsilons) allowed to compute in "
                        "the policy's reduced dtype; by default they compute in float32")
    max_skipped_share: float = Field(
        0.05, ge=0, le=1, description="warn when more than this share of steps is skipped (after a 50-step warm-up)")
    check_numerics: bool = Field(
        False, description="check every op for NaN/inf and stop at the first, naming the op and its layer (slow)")

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _check_loss_scale(cls, value: Any) -> Any:
        if value in ("dynamic", "none"):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
            return float(value)
        raise ValueError(f"expected 'dynamic', 'none' or a positive finite number, got {_show(value)}")

    @field_validator("policy", mode="before")
    @classmethod
    def _check_policy(cls, value: Any) -> Any:
        if value in (*POLICIES, "auto"):
            return value
        raise ValueError(f"expected one of 'float32', 'mixed_float16' or 'mixed_bfloat16', got {_show(value)} "
                         "('auto' picks one for the hardware)")


class FeatureSpec(Section):
    dtype: Literal["float32", "int64"] = Field(
        "float32", description="the tf.Example list type: float32 (float_list) or int64 (int64_list)")
    shape: list[Annotated[int, Field(gt=0)]] = Field([], description="values per example; [] is a scalar")


FILE_SOURCES = ("npz", "csv", "tfrecord", "images")
TEXT_CONTEXT_LENGTH = 256  # data.sequence_length's default for data.source text
SENTENCEPIECE_VOCAB_SIZE = 512  # data.vocab_size's default for data.tokenizer sentencepiece
SENTENCEPIECE_MIN_VOCAB = 261  # pad, bos, eos, unk, the 256 byte ids and one piece (pipeline/lm/tokenizers.py)


class DataConfig(Section):
    source: Literal["digits", "diabetes", "synthetic", "pointer", "npz", "csv", "tfrecord", "images", "text"] = Field(
        "digits", description="digits | diabetes (scikit-learn, embedded) | synthetic | pointer (a generated sequence "
                              "task) | npz (in memory) | csv | tfrecord | images (streamed from files) | text (UTF-8 "
                              "files or the embedded corpus, for model.kind causal_lm)")
    path: str | list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="npz: the file; csv, tfrecord: a file or a glob of shards; images: a folder with one "
                          "sub-folder of JPEG/PNG files per class; text: a glob or a list of globs of UTF-8 files "
                          "(null: the embedded pydoc_data.topics)")
    validation_path: str | None = Field(
        None, description="separate validation data, in the form of data.path; default: split off validation_split")
    validation_split: float = Field(0.2, gt=0, lt=1, description="share of the training rows held out for validation "
                                    "(streamed sources: each record by a hash of the seed, its file and its position; "
                                    "text: whole documents by a hash of the seed and their names, or one file's tail)")
    tokenizer: Literal["bytes", "sentencepiece", "gpt2"] = Field(
        "bytes", description="text: how text becomes token ids: bytes (each UTF-8 byte an id, then PAD, BOS, EOS; no "
                             "vocabulary file) | sentencepiece (BPE with byte fallback, data.vocab_size ids, trained at "
                             "make train on the training split and stored in the run; needs tensorflow-text) | gpt2 "
                             "(GPT-2's byte-level BPE from model.init_from's vocab.json and merges.txt, copied into "
                             "the run)")
    input_name: str = Field("features", min_length=1, description="the SavedModel's input name")
    shuffle_buffer: int = Field(10000, gt=0, description="tf.data shuffle buffer size")
    cache: bool = Field(False, description="in-memory sources: cache the tf.data pipelines' elements after the first epoch")
    max_bad_records: int = Field(
        0, ge=0, description="streamed and in-memory rows that do not decode or fail a check: 0 stops at the first, "
                             "naming its file and record; N skips and counts up to N (named in the run's "
                             "data/statistics.json) and stops beyond")
    statistics_rows: int | None = Field(
        None, gt=0, description="streamed sources: the statistics pass decodes and checks the files holding the first "
                                "N training rows (at least N) and only counts the others' records, which training "
                                "checks as it reads them; default: every row")
    parallel_reads: int = Field(4, gt=0, description="streamed sources: files read at once (tf.data interleave), and "
                                                     "threads of the statistics pass")
    deterministic: bool = Field(
        True, description="streamed sources: the same record order for the same seed (false: faster when some files "
                          "are slower to read than others)")
    service: str | None = Field(
        None, min_length=1, description="training batches from a tf.data service dispatcher, e.g. "
                                        "grpc://data-dispatcher:5050 (python -m pipeline data-service)")
    task: Literal["classification", "regression", "language_model"] | None = Field(
        None, description="default: regression for diabetes, language_model (the next token at every position) for "
                          "text, classification for every other source")
    num_classes: int | None = Field(None, ge=2, description="declared class count (labels 0..n-1); default: largest label + 1")
    label_names: list[str] | None = Field(None, description="one name per class; default '0', '1', ...")
    label: str = Field("label", min_length=1, description="csv: the label column; tfrecord: the label feature")
    feature_columns: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="csv: the feature columns; default: every column but the label")
    feature_spec: dict[str, FeatureSpec] | None = Field(
        None, min_length=1, description="tfrecord: feature name -> {dtype, shape}, concatenated in this order")
    categorical_columns: list[Union[str, int]] = Field(
        [], description="features holding category ids (integers >= 0, e.g. an Embedding's input), never standardised: "
                        "csv column names and tfrecord feature names (patterns such as 'merchant_*' allowed), "
                        "else positions in the flattened row")
    image_shape: list[Annotated[int, Field(gt=0)]] | None = Field(
        None, description="[height, width, channels]: rows are fed to the model as images of this shape")
    num_examples: int = Field(1000, ge=10, description="synthetic, pointer: rows to generate")
    feature_shape: list[Annotated[int, Field(gt=0)]] = Field([16], min_length=1, description="synthetic: the shape of one row")
    seed: int | None = Field(None, ge=0, description="synthetic, pointer: seed of the generated rows; default: the experiment seed")
    vocab_size: int | None = Field(
        None, ge=2, description="rows are token-id sequences with ids 0..vocab_size-1, 0 the padding; default: rows are "
                                "numeric features; text with data.tokenizer sentencepiece: the vocabulary's size, "
                                f"special and byte ids included (default {SENTENCEPIECE_VOCAB_SIZE}, at least "
                                f"{SENTENCEPIECE_MIN_VOCAB})")
    sequence_length: int | None = Field(
        None, ge=3, description="token sequences are padded to this length (longer ones are refused); default: the "
                                "longest sequence (pointer: 16); text: the windows' length, the model's context "
                                "(default 256)")

    @field_validator("categorical_columns", mode="before")
    @classmethod
    def _check_categorical_columns(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # the type check says what is wrong
        for item in value:
            if not (isinstance(item, str) and item) and not (type(item) is int and item >= 0):
                raise ValueError(f"expected column names or positions in the row (integers >= 0), got {_show(item)}")
        return value

    @field_validator("image_shape")
    @classmethod
    def _check_image_shape(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) != 3:
            raise ValueError(f"expected [height, width, channels], got {_show(value)}")
        return value

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _check_tokenizer(cls, value: Any) -> Any:
        if value == "sentencepiece":
            missing = [name for name in ("tensorflow_text", "sentencepiece") if importlib.util.find_spec(name) is None]
            if missing:
                raise ValueError(f"'sentencepiece' needs {' and '.join(name.replace('_', '-') for name in missing)}, "
                                 "not installed here (pip install -e '.[text]'); or use 'bytes'")
        return value

    @model_validator(mode="after")
    def _default_task(self) -> "DataConfig":
        if self.task is None:
            task = {"diabetes": "regression", "text": "language_model"}.get(self.source, "classification")
            object.__setattr__(self, "task", task)
        if self.source == "text" and self.sequence_length is None:
            object.__setattr__(self, "sequence_length", TEXT_CONTEXT_LENGTH)
        if self.source == "text" and self.tokenizer == "sentencepiece" and self.vocab_size is None:
            object.__setattr__(self, "vocab_size", SENTENCEPIECE_VOCAB_SIZE)
        if self.source == "synthetic" and self.task == "classification" and self.num_classes is None:
            object.__setattr__(self, "num_classes", 2)
        if self.source == "pointer" and self.sequence_length is None:
            object.__setattr__(self, "sequence_length", 16)
        return self


def _data_problems(d: DataConfig) -> list[str]:
    """Data settings that are each valid but do not fit the source or each other."""
    problems = []
    if d.source in FILE_SOURCES and not d.path:
        example = {"npz": "data/mnist.npz", "csv": "data/train-*.csv", "tfrecord": "data/train-*.tfrecord",
                   "images": "data/flowers (one sub-folder per class)"}[d.source]
        problems.append(f"data.path: required when data.source is '{d.source}' (e.g. {example})")
    for key in ("path", "validation_path"):
        if d.source not in FILE_SOURCES + ("text",) and getattr(d, key):
            problems.append(f"data.{key}: not used by data.source '{d.source}' (it reads no files), "
                            f"got {getattr(d, key)!r}")
    fixed_task = {"digits": "classification", "diabetes": "regression", "pointer": "classification",
                  "text": "language_model"}.get(d.source)
    if fixed_task and d.task != fixed_task:
        problems.append(f"data.task: data.source '{d.source}' is a {fixed_task} dataset, got {d.task!r}")
    if d.task != "classification" and (d.num_classes is not None or d.label_names is not None):
        key = "num_classes" if d.num_classes is not None else "label_names"
        problems.append(f"data.{key}: only for classification, but data.task is {d.task!r}")
    if d.num_classes is not None and d.label_names is not None and len(d.label_names) != d.num_classes:
        problems.append(f"data.label_names: {len(d.label_names)} names for data.num_classes {d.num_classes}")
    if fixed_task and d.num_classes is not None and d.source != "text":
        problems.append(f"data.num_classes: data.source '{d.source}' has a fixed number of classes; remove it")
    if d.feature_columns is not None and d.source != "csv":
        problems.append(f"data.feature_columns: only for data.source 'csv', got source '{d.source}'")
    if d.feature_columns is not None and d.label in d.feature_columns:
        problems.append(f"data.feature_columns: includes the label column {d.label!r}")
    if d.source == "tfrecord" and not d.feature_spec:
        problems.append("data.feature_spec: required when data.source is 'tfrecord' "
                        "(e.g. {pixels: {dtype: float32, shape: [64]}})")
    if d.feature_spec is not None and d.source != "tfrecord":
        problems.append(f"data.feature_spec: only for data.source 'tfrecord', got source '{d.source}'")
    if d.feature_spec is not None and d.label in d.feature_spec:
        problems.append(f"data.feature_spec: lists the label feature {d.label!r}; it is read from data.label")
    if d.source == "synthetic":
        problems += _synthetic_size_problems(d)
    if d.source == "images":
        if d.image_shape is None:
            problems.append("data.image_shape: required when data.source is 'images': the [height, width, channels] "
                            "every image is decoded and resized to (e.g. [224, 224, 3])")
        elif d.image_shape[2] not in (1, 3):
            problems.append(f"data.image_shape: images decode to 1 (grey) or 3 (RGB) channels, got {d.image_shape[2]}")
        if d.vocab_size is not None:
            problems.append("data.vocab_size: data.source 'images' holds pixels, not token ids")
    if d.service is not None and not re.fullmatch(r"(grpc://)?[A-Za-z0-9_.\-\[\]:]+:\d+", d.service):
        problems.append(f"data.service: expected a dispatcher address such as grpc://data-dispatcher:5050, got {d.service!r}")
    if d.statistics_rows is not None and d.source not in ("csv", "tfrecord", "images", "text"):
        problems.append(f"data.statistics_rows: data.source '{d.source}' is held in memory and read whole")
    elif (d.statistics_rows is not None and d.source in ("csv", "tfrecord") and d.task == "classification"
          and d.num_classes is None):
        problems.append("data.statistics_rows: a sample cannot tell how many classes the other files hold; set "
                        "data.num_classes")
    if d.cache and d.source in ("csv", "tfrecord", "images"):
        problems.append(f"data.cache: data.source '{d.source}' is streamed from its files every epoch, never held in "
                        "memory; remove data.cache (or convert small data to npz)")
    if d.service is not None and d.source not in ("csv", "tfrecord", "images", "text"):
        problems.append(f"data.service: a tf.data service reads files; data.source '{d.source}' is held in memory")
    return problems + _sequence_problems(d) + _categorical_problems(d) + _text_problems(d)


def _text_problems(d: DataConfig) -> list[str]:
    """data.source text (a language model's documents) and the keys that do not fit it, or it them."""
    if d.source != "text":
        problems = []
        if isinstance(d.path, list):
            problems.append(f"data.path: a list of globs is only for data.source 'text', got source '{d.source}'; "
                            "give one path or glob")
        if d.task == "language_model":
            problems.append(f"data.task: 'language_model' needs data.source 'text', got source '{d.source}'")
        if d.tokenizer != "bytes":
            problems.append(f"data.tokenizer: only for data.source 'text', got source '{d.source}'; remove it")
        return problems
    problems = []
    if d.validation_path is not None:
        problems.append("data.validation_path: data.source 'text' splits data.path itself by data.validation_split "
                        "(whole documents, or one file's tail); remove it")
    if d.tokenizer == "sentencepiece" and d.vocab_size is not None and d.vocab_size < SENTENCEPIECE_MIN_VOCAB:
        problems.append(f"data.vocab_size: {d.vocab_size} is too small for sentencepiece: its pad, bos, eos and unk "
                        f"ids and the 256 byte ids come first; use at least {SENTENCEPIECE_MIN_VOCAB} (default "
                        f"{SENTENCEPIECE_VOCAB_SIZE})")
    misfits = {
        "vocab_size": (d.vocab_size is not None and d.tokenizer != "sentencepiece",
                       f"data.tokenizer {d.tokenizer!r} has its fixed ids (259 for bytes, the checkpoint's vocab.json "
                       "for gpt2; data.vocab_size sizes a sentencepiece one)"),
        "image_shape": (d.image_shape is not None, "text is not images"),
        "categorical_columns": (bool(d.categorical_columns), "text has no columns"),
        "max_bad_records": (d.max_bad_records != 0, "every text file is checked whole before training, and a bad "
                                                     "one stops the run naming it (0 only)"),
        "cache": (d.cache, "its windows are cut anew from the documents every epoch"),
        "statistics_rows": (d.statistics_rows is not None, "text is read whole (the baselines count every byte)"),
        "service": (d.service is not None, "its windows are cut in the training process"),
    }
    problems += [f"data.{key}: not for data.source 'text': {why}; remove it"
                 for key, (found, why) in misfits.items() if found]
    return problems


GENERATED = ("synthetic", "pointer")


def _sequence_problems(d: DataConfig) -> list[str]:
    """Token-id sequences: from the generated pointer task or a file (npz, csv, tfrecord) with data.vocab_size."""
    problems = []
    tokens = d.vocab_size is not None or d.source == "pointer"
    if d.source == "pointer" and d.vocab_size is not None:
        problems.append(f"data.vocab_size: data.source 'pointer' sets its own vocabulary (sequence_length + 10 ids), "
                        f"got {d.vocab_size}; remove it")
    if d.vocab_size is not None and d.source not in FILE_SOURCES + ("pointer", "text"):
        problems.append(f"data.vocab_size: data.source '{d.source}' holds numeric features, not token ids; token "
                        "sequences come from npz, csv, tfrecord or pointer")
    if d.sequence_length is not None and not tokens and d.source != "text":
        problems.append("data.sequence_length: only for token sequences (set data.vocab_size, or data.source 'pointer')")
    if tokens and d.image_shape is not None and d.source != "text":
        problems.append("data.image_shape: token sequences are not images; remove it or data.vocab_size")
    if d.vocab_size is not None and d.task == "regression":
        problems.append("data.task: token sequences are classified here; regression needs numeric features")
    if d.source == "tfrecord" and d.vocab_size is not None and d.feature_spec:
        specs = list(d.feature_spec.items())
        if len(specs) != 1 or specs[0][1].dtype != "int64" or specs[0][1].shape:
            problems.append("data.feature_spec: token sequences are one int64 feature of any length per record, "
                            "e.g. {tokens: {dtype: int64}} (no shape; data.sequence_length pads them)")
    return problems



def _categorical_problems(d: DataConfig) -> list[str]:
    """data.categorical_columns names columns where the rows have names (csv, tfrecord), else gives positions."""
    named = d.source in ("csv", "tfrecord")
    wrong = [c for c in d.categorical_columns if isinstance(c, str) != named]
    if wrong:
        what = ("column names or patterns (e.g. 'merchant_*')" if d.source == "csv" else
                "feature names of data.feature_spec" if named else "positions in the flattened row (0, 1, ...)")
        return [f"data.categorical_columns: data.source '{d.source}' takes {what}, got {_show(wrong[0])}"]
    if d.image_shape is not None and d.categorical_columns:
        return ["data.categorical_columns: not for image rows (data.image_shape); category ids are flat features"]
    return []


# Bytes per generated value at the peak of data.py's generation: float64 centres, noise and their sum, then the
# float32 rows and their train/validation split.
_SYNTHETIC_BYTES_PER_VALUE = 32


def _synthetic_size_problems(d: DataConfig) -> list[str]:
    """Synthetic rows that could not fit in this machine's memory: refused here, in one line, rather than by a
    MemoryError deep inside NumPy after the run has started."""
    values = d.num_examples * math.prod(d.feature_shape)
    needed, memory = values * _SYNTHETIC_BYTES_PER_VALUE, _physical_memory()
    if memory is None or needed <= memory:
        return []
    return [f"data.feature_shape: {d.num_examples:,} synthetic rows of shape {d.feature_shape} ({values:,} values) "
            f"need about {_show_bytes(needed)} of memory to generate, more than this machine's "
            f"{_show_bytes(memory)}; lower data.num_examples or data.feature_shape"]


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return None


def _show_bytes(n: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.1f} {units[0]}"


TRANSFORMER_KEYS = ("num_layers", "width", "num_heads", "mlp_units", "dropout", "patch_size")
# The keys a causal_lm shares with the transformer (it has no patches) and the one it adds.
CAUSAL_LM_KEYS = ("num_layers", "width", "num_heads", "mlp_units", "dropout", "tied_embeddings", "remat")


class ModelConfig(Section):
    kind: Literal["mlp", "cnn", "transformer", "causal_lm", "custom"] = Field(
        "mlp", description="model family (causal_lm: a decoder-only language model over data.source text)")
    hidden_units: list[Annotated[int, Field(gt=0)]] | None = Field(
        None, min_length=1, description="units per hidden Dense+ReLU layer; default [256, 256] (mlp), [128] (cnn)")
    filters: list[Annotated[int, Field(gt=0)]] = Field(
        [32, 64], min_length=1, description="cnn: filters per 3x3 Conv+ReLU, each followed by 2x2 max-pooling")
    num_layers: int = Field(2, gt=0, description="transformer, causal_lm: pre-norm blocks (self-attention + MLP, each "
                                                 "with a residual)")
    width: int = Field(64, gt=0, description="transformer, causal_lm: the embedding width carried through the blocks")
    num_heads: int = Field(4, gt=0, description="transformer, causal_lm: attention heads per block (each width / "
                                                "num_heads wide)")
    mlp_units: int = Field(128, gt=0, description="transformer, causal_lm: hidden units of each block's MLP (GELU)")
    dropout: float = Field(0.0, ge=0, lt=1, description="transformer, causal_lm: dropout of the attention weights and "
                                                        "of each block's two residual branches (causal_lm: and of the "
                                                        "embeddings)")
    tied_embeddings: bool = Field(True, description="causal_lm: the logits reuse the token embedding table (false: a "
                                                    "float32 Dense of their own)")
    remat: bool = Field(False, description="causal_lm: recompute each block's activations in the backward pass "
                                           "instead of keeping them (keras.remat): less training memory, more time")
    init_from: str | None = Field(
        None, min_length=1, description="causal_lm: a GPT-2-family checkpoint directory as Hugging Face writes one "
                                        "(config.json, model.safetensors, vocab.json, merges.txt; docs/pretrained.md): "
                                        "the architecture and the starting weights come from it (leave num_layers, "
                                        "width, num_heads, mlp_units and tied_embeddings unset), with "
                                        "data.tokenizer: gpt2. Read from disk, never downloaded")
    patch_size: int = Field(2, gt=0, description="transformer on images: square patches of this many pixels a side "
                                                 "become the tokens")
    normalize: bool = Field(True, description="bake feature standardisation (fitted on training rows) into the model")
    builder: str | None = Field(None, description="custom: 'module:function' returning a keras.Model")
    params: dict[str, Any] = Field({}, description="custom: keyword arguments for the builder")

    @field_validator("builder")
    @classmethod
    def _check_builder(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError(f"expected 'module:function' (e.g. 'my_models:build'), got {_show(value)}")
        return value

    @model_validator(mode="after")
    def _default_hidden_units(self) -> "ModelConfig":
        if self.hidden_units is None and self.kind in ("mlp", "cnn"):
            object.__setattr__(self, "hidden_units", [256, 256] if self.kind == "mlp" else [128])
        return self


def _model_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.kind == "custom" and not m.builder:
        problems.append("model.builder: required when model.kind is 'custom' "
                        "(e.g. 'my_models:build', a function returning a keras.Model)")
    if m.kind != "custom" and (m.builder or m.params):
        key = "builder" if m.builder else "params"
        problems.append(f"model.{key}: only for model.kind 'custom', got kind '{m.kind}'")
    if m.kind in ("custom", "transformer", "causal_lm") and m.hidden_units is not None:
        where = "pass sizes in model.params" if m.kind == "custom" else "the blocks' MLP width is model.mlp_units"
        problems.append(f"model.hidden_units: not used by model.kind '{m.kind}'; {where}")
    kinds = {key: [kind for kind, keys in (("transformer", TRANSFORMER_KEYS), ("causal_lm", CAUSAL_LM_KEYS))
                   if key in keys] for key in dict.fromkeys(TRANSFORMER_KEYS + CAUSAL_LM_KEYS)}
    # a value other than the default (a resolved config lists every key)
    problems += [f"model.{key}: only for model.kind {' or '.join(repr(k) for k in kinds[key])}, got kind '{m.kind}'"
                 for key in kinds if m.kind not in kinds[key] and getattr(m, key) != ModelConfig.model_fields[key].default]
    if m.kind in ("transformer", "causal_lm") and m.width % m.num_heads:
        problems.append(f"model.num_heads: {m.num_heads} heads do not divide model.width {m.width}; pick a divisor "
                        f"(e.g. {max(h for h in range(1, min(m.num_heads, m.width) + 1) if m.width % h == 0)})")
    return problems


class DistributionConfig(Section):
    strategy: Literal["default", "mirrored", "multi_worker"] = Field(
        "default", description="'default' (one device), 'mirrored' (all local GPUs, or the CPU), "
                               "'multi_worker' (MultiWorkerMirroredStrategy, cluster from TF_CONFIG)")


class TrainConfig(Section):
    epochs: int = Field(20, gt=0, description="epochs to train (an epoch is a pass over the training rows unless "
                                              "train.steps_per_epoch says otherwise); train.max_steps replaces it")
    steps_per_epoch: int | None = Field(
        None, gt=0, description="batches per epoch (between validations and epoch-end checkpoints); null = one pass "
                                "over the training rows. Epochs read on through one stream of passes, each shuffled "
                                "anew, so fewer leaves the rest of a pass to the next epoch")
    max_steps: int | None = Field(
        None, gt=0, description="the run's training steps (batches); replaces train.epochs (the last epoch is cut "
                                "short where it does not divide); null = train.epochs epochs")
    validation_steps: int | None = Field(
        None, gt=0, description="validation batches per evaluation, the first ones in their stored order; "
                                "null = all the validation rows")
    batch_size: int = Field(64, gt=0, description="examples per step (the global batch across all replicas)")
    optimizer: Literal["rmsprop", "adam", "sgd"] = Field("rmsprop", description="optimizer")
    learning_rate: float = Field(1e-3, gt=0, description="optimizer learning rate (the peak, after warm-up)")
    learning_rate_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="'constant', or 'cosine': decays to 0 over the updates after warm-up")
    warmup_steps: int = Field(0, ge=0, description="updates over which the learning rate rises linearly from 0")
    global_clipnorm: float | None = Field(
        None, gt=0, description="clip each update's gradients (unscaled, averaged over accumulated batches) to this "
                                "global L2 norm; null = no clipping")
    runs_dir: str = Field("runs", min_length=1, description="runs are written to <runs_dir>/<experiment>/")
    loop: Literal["fit", "custom"] = Field(
        "fit", description="'fit' (Keras Model.fit) or 'custom' (a tf.function step with explicit loss scaling); same results")
    jit_compile: Union[bool, Literal["auto"]] = Field(
        "auto", description="XLA-compile the train step: true, false, or 'auto' (Keras: on for GPUs, off on CPU)")
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="batches whose gradients are averaged into one update (1 = off); an update with a "
                             "non-finite batch is skipped whole")
    max_nonfinite_steps: int = Field(
        20, gt=0, description="consecutive steps with a non-finite loss or gradients before training stops")
    checkpoint_every_steps: int = Field(
        500, ge=0, description="checkpoint every N steps (0 = only at epoch ends, which always checkpoint)")
    keep_checkpoints: int = Field(3, gt=0, description="how many of the newest checkpoints to keep")
    distribution: DistributionConfig = DistributionConfig()

    @field_validator("jit_compile", mode="before")
    @classmethod
    def _check_jit_compile(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"expected true, false or 'auto', got {_show(value)}")

    @field_validator("distribution")
    @classmethod
    def _check_distribution(cls, value: DistributionConfig, info: Any) -> DistributionConfig:
        # Both limits are Keras 3.15's, verified on TF 2.21 (see pipeline/train/distribute.py).
        if value.strategy == "multi_worker" and info.data.get("loop") == "fit":
            raise ValueError("strategy 'multi_worker' needs train.loop 'custom' (Keras 3.15's Model.fit and "
                             "evaluate fail to reduce distributed batches across workers)")
        accumulation = info.data.get("gradient_accumulation_steps") or 1
        if value.strategy != "default" and accumulation > 1:
            raise ValueError(f"strategy {value.strategy!r} cannot be combined with train.gradient_accumulation_steps "
                             f"{accumulation} (Keras 3's accumulating optimizer all-reduces inside a cond, which "
                             "tf.distribute refuses); raise train.batch_size instead")
        return value


class PolicyTolerance(Section):
    """What serving under one policy may cost against float32 (export.tolerances.<policy>); an unset value
    takes that policy's default (pipeline/precision.py TOLERANCES)."""

    max_rel_diff: float | None = Field(
        None, ge=0, description="largest |path - float32| on any output on the golden rows, as a fraction of that "
                                "output's largest float32 magnitude")
    max_abs_diff: float | None = Field(
        None, ge=0, description="largest |path - float32| on any output on the golden rows, in the output's own units "
                                "(none by default: outputs differ in scale)")
    min_argmax_agreement: float | None = Field(
        None, ge=0, le=1, description="share of golden rows whose predicted class the path must keep (classifiers)")
    max_metric_drop: float | None = Field(
        None, ge=0, description="validation rows: accuracy drop in points (classifiers), or MAE rise in percent of "
                                "float32's MAE (regressors)")


# What a serving graph can compute under: the training policies, and float16 or bfloat16 weights (export only).
GRAPH_POLICIES = (*POLICIES, "float16", "bfloat16")
# Keys that moved: their old spelling gets a pointer to the new one instead of "unknown key".
_MOVED_KEYS = {
    "export.policy_tolerance": "export.tolerances.<policy>.max_rel_diff",
    "export.min_argmax_agreement": "export.tolerances.<policy>.min_argmax_agreement",
}


class ExportConfig(Section):
    base_path: str = Field("models", min_length=1, description="versions go to <base_path>/<model_name>/<version>/")
    model_name: str | None = Field(None, description="defaults to the experiment name")
    version: int | None = Field(None, gt=0, description="explicit version number; default: next integer")
    parity_rows: int = Field(256, gt=0, description="held-out rows in the parity gate's golden batch")
    validation_rows: int = Field(
        20000, ge=0, description="the first validation rows on which the parity gate compares each path's accuracy "
                                 "(or MAE) with float32's; 0: every validation row")
    parity_tolerance: float = Field(
        1e-5, ge=0, description="max difference SavedModel vs the Keras model it was exported from (both run as "
                                "graphs), as a fraction of the output's largest magnitude")
    serving_policy: Literal[("trained", *GRAPH_POLICIES, "auto")] = Field(
        "trained", description="policy of the serving graph: the training policy, the same float32 master weights "
                               "rebuilt under another, or float16/bfloat16 weights (auto: chosen for this machine, by "
                               "timing on a CPU with native bfloat16)")
    max_image_pixels: int = Field(
        4_194_304, gt=0, description="image-folder models' predict_images signature: the most pixels (width x height, "
                                      "read from each image's header before it is decoded) a client's image may declare")
    min_image_side: int = Field(
        8, gt=0, description="predict_images: images with a side shorter than this (or than the model's input side, if "
                             "smaller) are refused: too little to resize from")
    tolerances: dict[Literal[GRAPH_POLICIES], PolicyTolerance] = Field(
        {}, description="per policy, what the parity gate lets it cost against float32 (max_rel_diff, max_abs_diff, "
                        "min_argmax_agreement, max_metric_drop); unset values take the policy's default")

    @field_validator("model_name", mode="before")
    @classmethod
    def _check_model_name(cls, value: Any) -> Any:
        return value if value is None else _safe_name(value)


class ServingConfig(Section):
    host: str = Field("127.0.0.1", min_length=1, description="gRPC bind/connect host")
    port: int = Field(8500, ge=0, le=65535, description="gRPC port (TF Serving's default 8500)")
    batch_size: int = Field(32, gt=0, description="rows per Predict call from the client")
    num_examples: int = Field(0, ge=0, description="validation rows the client sends; 0 = all")
    timeout_seconds: float = Field(30.0, gt=0, description="per-RPC deadline for the client")


class Config(Section):
    experiment: str = Field("digits_mlp", description="run name: runs/<experiment>/")
    seed: int = Field(42, ge=0, description="seeds Python, NumPy and TensorFlow")
    precision: PrecisionConfig = PrecisionConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    export: ExportConfig = ExportConfig()
    serving: ServingConfig = ServingConfig()

    @field_validator("experiment", mode="before")
    @classmethod
    def _check_experiment(cls, value: Any) -> Any:
        return _safe_name(value)

    @model_validator(mode="after")
    def _default_model_name(self) -> "Config":
        if self.export.model_name is None:
            object.__setattr__(self, "export", self.export.model_copy(update={"model_name": self.experiment}))
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.train.runs_dir) / self.experiment

    @property
    def model_base_path(self) -> Path:
        return Path(self.export.base_path) / self.export.model_name

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Reads a YAML experiment file (or only defaults when path is None), applies overrides, validates.

    Raises:
        ConfigError: with one line per problem, e.g. "train.epochs: expected a positive integer, got -1".
    """
    source = str(path) if path else "<defaults>"
    raw = _read_yaml(path) if path else {}
    for override in overrides:
        _apply_override(raw, override, source)
    return validate_config(raw, source)


def validate_config(raw: dict[str, Any], source: str = "") -> Config:
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError([_describe(err) for err in e.errors()], source) from None
    problems = _combination_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(["config file not found (expected a YAML file such as configs/default.yaml)"], str(path))
    try:
        raw = _parse_yaml(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError([f"{where}invalid YAML: {getattr(e, 'problem', e)}"], str(path)) from None
    if raw is None or raw == {}:
        log.warning("%s sets no keys (the file is empty): every key takes its default, e.g. experiment %r "
                    "(docs/configuration.md lists them)", path, Config.model_fields["experiment"].default)
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(raw).__name__}"], str(path))
    return raw


def _apply_override(raw: dict[str, Any], override: str, source: str) -> None:
    """Sets a dotted key from 'a.b=value'; the value is parsed as a YAML scalar (3 → int, 1e-3 → float)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"--set {override!r}: expected KEY=VALUE, e.g. --set train.epochs=3"], source)
    try:
        value = _parse_yaml(text)
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([f"--set {override!r}: {part} is not a section"], source)
        node = child
    node[parts[-1]] = value


def differences(trained: dict[str, Any], wanted: dict[str, Any], sections: tuple[str, ...] = WEIGHT_SECTIONS,
                prefix: str = "") -> list[str]:
    """Each key whose value differs between two resolved configs (Config.to_dict()), with both values:
    "precision.float32_layers: [amount_scale] in training, [] now"."""
    found = []
    for key in sections:
        old, new = trained.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            found += differences(old, new, tuple(dict.fromkeys([*old, *new])), f"{prefix}{key}.")
        elif old != new:
            found.append(f"{prefix}{key}: {_show(old)} in training, {_show(new)} now")
    return found


def _combination_problems(cfg: Config) -> list[str]:
    """Values that are each valid but impossible together."""
    problems = []
    p = cfg.precision
    if p.policy == "auto" and p.loss_scale != "dynamic":
        # The machine decides the policy, so only the setting that is right for each outcome is
        # allowed: dynamic scaling under mixed_float16, no scaling under mixed_bfloat16 or float32.
        problems.append(f"precision.loss_scale: policy 'auto' needs 'dynamic' (it becomes no scaling when auto "
                        f"picks mixed_bfloat16 or float32), got {_show(p.loss_scale)}; name the policy to use it")
    elif isinstance(p.loss_scale, float) and p.policy != "mixed_float16":
        problems.append(f"precision.loss_scale: a static loss scale ({p.loss_scale:g}) needs policy mixed_float16, "
                        f"got policy {p.policy}; use 'dynamic' or 'none'")
    if p.loss_scale == "none" and p.policy == "mixed_float16":
        problems.append("precision.loss_scale: 'none' is unsafe under mixed_float16 (small float16 gradients "
                        "underflow to zero); use 'dynamic' or a static number")
    problems += _data_problems(cfg.data) + _model_problems(cfg.model)
    if cfg.model.kind == "causal_lm" and cfg.data.source != "text":
        problems.append(f"model.kind: 'causal_lm' is a language model over text; set data.source: text (data.path: "
                        f"your UTF-8 files, or null for the embedded corpus), got source '{cfg.data.source}'")
    if cfg.data.source == "text" and cfg.model.kind != "causal_lm":
        problems.append(f"data.source: 'text' trains model.kind 'causal_lm', got kind '{cfg.model.kind}'")
    problems += _pretrained_problems(cfg)
    if cfg.model.kind == "causal_lm" and p.float16_layers:
        problems.append("precision.float16_layers: model.kind 'causal_lm' sets which of its parts compute in float32 "
                        "itself (docs/precision.md); it takes no float16_layers")
    tokens = cfg.data.vocab_size is not None or cfg.data.source == "pointer"
    if tokens and cfg.model.kind in ("mlp", "cnn"):
        problems.append(f"model.kind: token sequences (data.{'vocab_size' if cfg.data.vocab_size else 'source'}) need "
                        f"kind 'transformer' or 'custom', got '{cfg.model.kind}'")
    return problems


# The architecture keys a checkpoint's config.json sets (pipeline/lm/gpt2.py)
PRETRAINED_KEYS = ("num_layers", "width", "num_heads", "mlp_units", "tied_embeddings")


def _pretrained_problems(cfg: Config) -> list[str]:
    """model.init_from and data.tokenizer gpt2: each needs the other, and the checkpoint sets the architecture."""
    m, problems = cfg.model, []
    if m.init_from is None:
        if cfg.data.tokenizer == "gpt2":
            problems.append("data.tokenizer: 'gpt2' reads vocab.json and merges.txt from the checkpoint of "
                            "model.init_from, which is not set (docs/pretrained.md)")
        return problems
    if m.kind != "causal_lm":
        return [f"model.init_from: a GPT-2-family checkpoint is a causal_lm, got kind '{m.kind}'"]
    if cfg.data.tokenizer != "gpt2":
        problems.append(f"data.tokenizer: model.init_from's checkpoint speaks GPT-2's byte-level BPE; set "
                        f"data.tokenizer: gpt2, got {_show(cfg.data.tokenizer)}")
    problems += [f"model.{key}: the architecture comes from model.init_from's config.json; remove it"
                 for key in PRETRAINED_KEYS if getattr(m, key) != ModelConfig.model_fields[key].default]
    return problems


_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping of keys",
    "model_type": "a mapping of keys", "model_attributes_type": "a mapping of keys",
    "string_too_short": "a non-empty string", "too_short": "a non-empty list",
    "finite_number": "a finite number",
}


def _describe(err: dict[str, Any]) -> str:
    """Turns one pydantic error into 'key.path: expected X, got Y' (or a did-you-mean for unknown keys)."""
    loc = [str(p) for p in err["loc"] if not _is_union_branch(p)]
    path = ".".join(loc)
    kind, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    if kind == "extra_forbidden":
        if path in _MOVED_KEYS:
            return f"{path}: replaced by {_MOVED_KEYS[path]} (docs/configuration.md)"
        return f"{path}: unknown key{_suggestion(loc)}"
    if kind == "literal_error" and loc[-1] == "[key]":  # a mapping's key, e.g. export.tolerances.float8
        return f"{'.'.join(loc[:-1])}: unknown key; expected one of {ctx['expected']}"
    if kind == "literal_error":
        return f"{path}: expected one of {ctx['expected']}, got {_show(value)}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        if kind == "greater_than" and limit == 0:
            noun = "integer" if _is_int_field(loc) else "number"
            return f"{path}: expected a positive {noun}, got {_show(value)}"
        return f"{path}: expected a number {bounds[kind]} {limit}, got {_show(value)}"
    if kind in _EXPECTED:
        return f"{path}: expected {_EXPECTED[kind]}, got {_show(value)}"
    if kind == "value_error":
        return f"{path}: {err['msg'].removeprefix('Value error, ')}"
    return f"{path}: {err['msg']}, got {_show(value)}"


def _is_union_branch(part: Any) -> bool:
    # pydantic adds the tried union member (e.g. "literal['dynamic','none']", "float") to the location.
    return isinstance(part, str) and (part.startswith(("literal[", "function-")) or part in ("float", "int", "str"))


def _section(loc: list[str]) -> type[BaseModel] | None:
    """The config class that holds the last key of loc."""
    section: type[BaseModel] = Config
    parts = iter(loc[:-1])
    for part in parts:
        field = section.model_fields.get(part)
        annotation = field and field.annotation
        if get_args(annotation)[1:] and _is_section(get_args(annotation)[1]):  # dict[key, Section]: skip the key
            annotation = get_args(annotation)[1]
            if next(parts, None) is None:
                return None
        if not _is_section(annotation):
            return None
        section = annotation
    return section


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_int_field(loc: list[str]) -> bool:
    section = _section(loc)
    field = section.model_fields.get(loc[-1]) if section else None
    if field is None:  # a list item such as model.hidden_units.1
        return loc[-1].isdigit()
    return field.annotation is int or int in get_args(field.annotation)


def _suggestion(loc: list[str]) -> str:
    """"; did you mean 'train'?" for a misspelt key, else the allowed keys."""
    section = _section(loc)
    if section is None:
        return ""
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; allowed keys: {', '.join(allowed)}"


# experiment and export.model_name become directory names (runs/<experiment>/, <base_path>/<model_name>/) and
# TF Serving model names: one path segment that cannot climb out ('..' is refused anywhere, as serving/limits.py
# does for model names), short enough for the temporaries that get a prefix and suffix beside it.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def _safe_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value == "." or ".." in value:
        raise ValueError(f"expected a name of 1-200 letters, digits, '.', '_' or '-' (not '.', no '..'), "
                         f"got {_show(value)}")
    return value


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a mapping"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
