"""load_datasets: the configured source as training and validation pipelines, its DataSpec and its Statistics.

Three kinds of source, one interface (a `dataset()` of batches and the first `rows()`):
    in memory   digits, diabetes, synthetic, pointer, npz (arrays.py): small, read whole, split by a permutation
    streamed    csv, tfrecord, images (shards.py): read a shard at a time, never whole, split by files
                (data.validation_path) or by a rule on each record
    text        UTF-8 files or the embedded corpus (text.py): windows of token ids for a language model, split by
                document; its rows are windows, its statistics the windows' counts and a sample of them

Before the first step every file's header is checked (feature names, dtypes and shapes, the CSV header, an image
of every class folder), then one streaming pass (or the statistics recorded in the run directory for the same
data) gives the statistics, the rows per file and class, and the bad records. Every failure is a one-line
DataError naming the file and the record, line or column.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from pipeline.data import sequences
from pipeline.lm import tokenizers
from pipeline.config import DataConfig
from pipeline.data import arrays, checks, images, shards, statistics, text
from pipeline.data.csv import CsvFormat
from pipeline.data.images import ImageFormat
from pipeline.data.spec import DataSpec
from pipeline.data.statistics import Accumulator, Statistics
from pipeline.data.tfrecord import TFRecordFormat
from pipeline.errors import DataError

log = logging.getLogger(__name__)

STREAMED = ("csv", "tfrecord", "images")
SAMPLE_WINDOWS = 64  # text: the first training windows kept as the build's sample rows
TEXT_FILE = "text.json"  # text: the corpus, its split and the baselines, in the run's data directory


@dataclasses.dataclass(frozen=True)
class Datasets:
    spec: DataSpec
    statistics: Statistics
    train: arrays.ArraySource | shards.ShardSource | text.TextWindows
    val: arrays.ArraySource | shards.ShardSource | text.TextWindows
    corpus: text.TextData | None = None  # text: the documents and how they were split
    baselines: text.Baselines | None = None  # text: unigram and bigram nats per byte on the validation windows
    tokenizer: tokenizers.BytesTokenizer | tokenizers.SentencePieceTokenizer | tokenizers.Gpt2Tokenizer | None = None

    @property
    def streamed(self) -> bool:
        return isinstance(self.train, shards.ShardSource)

    @property
    def sample_x(self) -> np.ndarray:
        """Training rows for the build's checks: the first rows and each feature's extreme row (statistics.py)."""
        return self.statistics.sample_x

    @property
    def sample_y(self) -> np.ndarray:
        return self.statistics.sample_y

    @property
    def train_examples(self) -> int:
        return self.statistics.rows

    @property
    def val_examples(self) -> int:
        return self.statistics.validation_rows

    def train_dataset(self, batch_size: int, shuffle_buffer: int, seed, *, input_context=None,
                      skip: int = 0) -> tf.data.Dataset:
        """One epoch of training batches, shuffled from seed (a Python int or a scalar int64 tensor)."""
        return self.train.dataset(batch_size, shuffle_buffer, seed, input_context=input_context, skip=skip)

    def val_dataset(self, batch_size: int, *, input_context=None) -> tf.data.Dataset:
        """The validation batches in their stored order. Read whole by one process, they are as many as the
        statistics counted (checked as they are read: a file that changed since is an error, not a silent epoch
        of other rows), so Keras knows the number of validation steps."""
        batches = self.val.dataset(batch_size, input_context=input_context)
        if not isinstance(self.val, arrays.ArraySource) and input_context is None:
            batches = batches.apply(tf.data.experimental.assert_cardinality(math.ceil(len(self.val) / batch_size)))
        return batches

    def validation_rows(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first `limit` validation rows (None: all), the same ones for every command of a run."""
        return self.val.rows(limit)


def load_datasets(config: DataConfig, seed: int, recorded: Path | None = None,
                  pretrained: str | Path | None = None) -> Datasets:
    """Checks the configured source and gathers its statistics; returns its pipelines.

    Args:
        recorded: a run's data directory: statistics recorded there for the same data and settings are used
            instead of a new pass (a resumed run, export, verify); train records them there.
        pretrained: model.init_from, where data.tokenizer gpt2 finds its files when the run has not recorded them.

    Raises:
        DataError: one line naming the file and the record, line or column that is wrong.
    """
    if config.source in STREAMED:
        return _load_streamed(config, seed, recorded)
    if config.source == "text":
        return _load_text(config, seed, recorded, pretrained)
    return _load_in_memory(config, seed)


def _load_text(config: DataConfig, seed: int, recorded: Path | None, pretrained: str | Path | None) -> Datasets:
    """The documents split and cut into windows of data.sequence_length token ids, and the baselines on the
    validation windows' bytes. No statistics pass: the counts follow from the documents (and their tokens), and the
    build's sample rows are the first training windows. Read again by every command (the baselines take one pass
    over the bytes); only a sentencepiece tokenizer is recorded (in `recorded`, by record()) and reused while the
    training text and data.vocab_size are the same (tokenizers.prepare_sentencepiece); a GPT-2 one is copied there
    from the checkpoint (tokenizers.prepare_gpt2)."""
    started = time.perf_counter()
    corpus = text.load_text(config.path, config.sequence_length, config.validation_split, seed)
    tokenizer = tokenizers.BYTES
    if config.tokenizer == "sentencepiece":
        parts = corpus.train.parts
        tokenizer = tokenizers.prepare_sentencepiece(lambda: (part.read() for part in parts), config.vocab_size,
                                                     recorded)
        corpus = text.tokenize(corpus, tokenizer)
    elif config.tokenizer == "gpt2":
        tokenizer = tokenizers.prepare_gpt2(recorded, Path(pretrained) if pretrained else None)
        corpus = text.tokenize(corpus, tokenizer)
    baselines = text.text_baselines(corpus)
    sample_x, sample_y = corpus.train.rows(SAMPLE_WINDOWS)
    ids = sample_x.astype(np.float64)
    windows_per_document: dict[str, int] = {}
    for side in (corpus.train, corpus.validation):
        for name, count in zip(side.names, side.counts):
            windows_per_document[name] = windows_per_document.get(name, 0) + count
    documents = [(d.name, d.size) for side in (corpus.train, corpus.validation) for d in
                 dict.fromkeys(part.document for part in side.parts)]
    settings = [documents, seed, config.validation_split, config.sequence_length, config.tokenizer,
                getattr(tokenizer, "sha256", None)]
    stats = Statistics(rows=len(corpus.train), validation_rows=len(corpus.validation), value_rows=len(sample_x),
                       mean=ids.mean(axis=0), variance=ids.var(axis=0), minimum=ids.min(axis=0),
                       maximum=ids.max(axis=0), sample_x=sample_x, sample_y=sample_y,
                       rows_per_file=windows_per_document, longest_sequence=config.sequence_length,
                       seconds=round(time.perf_counter() - started, 3),
                       fingerprint=hashlib.sha1(json.dumps(settings).encode()).hexdigest())
    spec = DataSpec(input_name="ids", input_shape=(config.sequence_length,), num_classes=tokenizer.vocab_size,
                    label_names=(), task="language_model", vocab_size=tokenizer.vocab_size,
                    token_bytes=tuple(int(n) for n in tokenizer.token_bytes))
    log.info("data: text from %s, split %s: %d training windows (%s bytes in %d documents), %d validation windows "
             "(%s bytes in %d); baselines on the validation bytes: unigram %.3f, bigram %.3f nats/byte",
             corpus.source, corpus.rule, len(corpus.train), f"{corpus.train.bytes:,}", len(corpus.train.parts),
             len(corpus.validation), f"{corpus.validation.bytes:,}", len(corpus.validation.parts), baselines.unigram,
             baselines.bigram)
    return Datasets(spec, stats, corpus.train, corpus.validation, corpus, baselines, tokenizer)


def _load_in_memory(config: DataConfig, seed: int) -> Datasets:
    started = time.perf_counter()
    train = arrays.read(config, config.path, "data.path", seed)
    val = arrays.read(config, config.validation_path, "data.validation_path", seed) if config.validation_path else None
    vocab_size = _vocab_size(config)
    parts = [train] + ([val] if val is not None else [])
    if vocab_size is not None:
        arrays.pad_sequences(parts, config, vocab_size)
    if val is not None and val.x.shape[1:] != train.x.shape[1:]:
        raise DataError(f"data.validation_path: {config.validation_path}: rows have shape {list(val.x.shape[1:])} "
                        f"but the training rows ({config.path}) have {list(train.x.shape[1:])}")
    width = math.prod(train.x.shape[1:])
    input_shape = tuple(config.image_shape) if config.image_shape else (width,)
    if math.prod(input_shape) != width:
        raise DataError(f"data.image_shape: {list(input_shape)} holds {math.prod(input_shape)} values but the rows "
                        f"({train.name}) have {width} (shape {list(train.x.shape[1:])})")
    categorical = categorical_positions(config, (), width, train.name)
    rules = checks.Rules(config.task, config.num_classes, categorical, vocab_size=vocab_size)
    bad: list[dict] = []
    for part in parts:
        kept = _check_in_memory(part, rules, config, bad)
        part.x, part.y = part.x[kept], part.y[kept]
    _apply_policy(bad, config.max_bad_records)
    label_dtype = np.int64 if config.task == "classification" else np.float32
    xs = [part.x.reshape(len(part.x), *input_shape).astype(np.float32) for part in parts]
    ys = [part.y.astype(label_dtype).reshape(len(part.y)) for part in parts]
    if val is not None:
        (train_x, val_x), (train_y, val_y) = xs, ys
    else:
        train_x, train_y, val_x, val_y = arrays.split(xs[0], ys[0], config.validation_split, seed, train.name)
    validation_classes = np.bincount(val_y) if config.task == "classification" and len(val_y) else None
    stats = statistics.of_rows(train_x, train_y, config.task, validation_rows=len(val_x),
                               validation_class_counts=validation_classes, bad_records=tuple(bad),
                               seconds=time.perf_counter() - started)
    image_shape = tuple(config.image_shape) if config.image_shape else train.image_shape
    spec = _spec(config, stats, input_shape, None if vocab_size is not None else image_shape, vocab_size,
                 categorical, (), None, train.name)
    return Datasets(spec, stats, arrays.ArraySource(train_x, train_y, config.cache), arrays.ArraySource(val_x, val_y, config.cache))


def _check_in_memory(part: arrays.Rows, rules: checks.Rules, config: DataConfig, bad: list[dict]) -> np.ndarray:
    """The rows of part that pass the checks; the others are added to bad (and the policy decides)."""
    y = part.y.reshape(len(part.y), -1) if part.y.ndim > 1 else part.y
    if y.ndim != 1 or y.dtype.kind not in "iuf" or len(y) != len(part.x):
        raise DataError(f"{part.name}: expected one numeric label per row, got {part.y.dtype} values "
                        f"({len(part.y)} labels for {len(part.x)} rows)")
    kept = np.ones(len(part.x), bool)
    for start in range(0, len(part.x), shards.SCAN_BATCH):
        x = part.x[start:start + shards.SCAN_BATCH]
        for problem in checks.find_problems(x, y[start:start + shards.SCAN_BATCH], rules):
            i = start + problem.row
            kept[i] = False
            bad.append({"where": part.where(i, problem.column), "reason": problem.reason})
            if len(bad) > config.max_bad_records:
                _apply_policy(bad, config.max_bad_records)
    return kept


def _load_streamed(config: DataConfig, seed: int, recorded: Path | None) -> Datasets:
    fmt_class = {"csv": CsvFormat, "tfrecord": TFRecordFormat, "images": ImageFormat}[config.source]
    fmt, val_fmt = fmt_class(config), fmt_class(config)  # a validation file may order its csv columns its own way
    train_shards, class_names = _list_shards(config, config.path, "data.path")
    val_shards, val_classes = ((_list_shards(config, config.validation_path, "data.validation_path"))
                               if config.validation_path else ([], None))
    if val_classes is not None and val_classes != class_names:
        raise DataError(f"data.validation_path: {config.validation_path}: its class folders ({', '.join(val_classes)}) "
                        f"differ from data.path's ({', '.join(class_names)}); both need the same classes")
    _check_heads(fmt, config, train_shards, "data.path")
    _check_heads(val_fmt, config, val_shards, "data.validation_path")
    vocab_size = config.vocab_size
    width = None if fmt.tokens else math.prod(fmt.row_shape)
    input_shape = tuple(config.image_shape) if config.image_shape else fmt.row_shape
    if width is not None and math.prod(input_shape) != width:
        raise DataError(f"data.image_shape: {list(input_shape)} holds {math.prod(input_shape)} values but the rows "
                        f"({config.path}) have {width}")
    categorical = categorical_positions(config, fmt.feature_names, width or 0, f"data.path: {config.path}")
    rules = checks.Rules(config.task, config.num_classes, categorical, fmt.feature_names, config.label, vocab_size,
                         config.sequence_length)
    split = None if config.validation_path else shards.Split(config.validation_split, seed, validation=False)
    fingerprint = _fingerprint(config, seed, train_shards + val_shards)
    stats = statistics.load(recorded, fingerprint) if recorded is not None else None
    if stats is None:
        stats = _scan((fmt, val_fmt), config, train_shards, val_shards, rules, split, fingerprint, input_shape)
    else:
        log.info("data: statistics of %d training rows from %s (computed before; the files are unchanged)",
                 stats.rows, recorded)
    _check_counts(stats, config, split)
    sequence_length = (config.sequence_length or max(stats.longest_sequence, 1)) if fmt.tokens else None
    if fmt.tokens:
        input_shape = (sequence_length,)
    exclude = _excluded(stats, train_shards, val_shards, fmt)
    label_dtype = tf.int64 if config.task == "classification" else tf.float32

    def source(fmt, shard_list, split_rule, excluded, rows) -> shards.ShardSource:
        return shards.ShardSource(fmt, shard_list, key="data.path", input_shape=input_shape, label_dtype=label_dtype,
                                  split=split_rule, exclude=excluded, sequence_length=sequence_length,
                                  parallel_reads=config.parallel_reads, deterministic=config.deterministic, rows=rows)

    train = source(fmt, train_shards, split, exclude[0], stats.rows)
    val = (source(val_fmt, val_shards, None, exclude[1], stats.validation_rows) if val_shards else
           source(fmt, train_shards, dataclasses.replace(split, validation=True), exclude[0], stats.validation_rows))
    spec = _spec(config, stats, input_shape, None if fmt.tokens else fmt.image_shape, vocab_size, categorical,
                 fmt.feature_names, class_names, f"data.path: {config.path}")
    files = (sum(len(s.items) for s in train_shards + val_shards) if config.source == "images" else
             len(train_shards) + len(val_shards))
    per_file = (f" ({', '.join(f'{Path(name).name}: {count}' for name, count in stats.rows_per_file.items())})"
                if 1 < len(stats.rows_per_file) <= 8 else "")
    log.info("data: %s: %d training / %d validation rows in %d file%s%s%s", config.source, stats.rows,
             stats.validation_rows, files, "s" if files > 1 else "", per_file,
             f"; {len(stats.bad_records)} bad record(s) left out (data.max_bad_records {config.max_bad_records})"
             if stats.bad_records else "")
    return Datasets(spec, stats, train, val)


def _list_shards(config: DataConfig, pattern: str, key: str) -> tuple[list[shards.Shard], list[str] | None]:
    if config.source == "images":
        files, labels, classes = images.list_images(pattern, key)
        return ([shards.Shard(paths[0], (tuple(paths), tuple(group_labels)), tuple(paths))
                 for paths, group_labels in images.shard_files(files, labels)], classes)
    files = sorted(tf.io.gfile.glob(pattern))
    files = [file for file in files if not tf.io.gfile.isdir(file)]
    if not files:
        raise DataError(f"{key}: {pattern} not found (no file matches); this pipeline never downloads data")
    return [shards.Shard(file, file) for file in files], None


def _check_heads(fmt, config: DataConfig, shard_list: list[shards.Shard], key: str) -> None:
    """Every file's header and first record (CSV, TFRecord); the first image of every class folder. An image is a
    record of its own: with data.max_bad_records a bad one is counted by the pass instead."""
    if config.source == "images" and config.max_bad_records:
        return
    if config.source == "images":
        firsts: dict[str, str] = {}
        for shard in shard_list:
            for path in shard.items:
                firsts.setdefault(os.path.dirname(path), path)
        paths = [firsts[folder] for folder in sorted(firsts)]
    else:
        paths = [shard.name for shard in shard_list]
    for path in paths:
        fmt.check_head(path, key)


def _scan(formats: tuple, config: DataConfig, train_shards, val_shards, rules, split, fingerprint: str,
          input_shape: tuple) -> Statistics:
    """The one streaming pass: training shards (and their validation records, split by the rule), then the
    validation files."""
    started = time.perf_counter()
    fmt, val_fmt = formats
    row_shape = (None,) if fmt.tokens else input_shape
    total = Accumulator(row_shape, config.task)
    new = lambda: Accumulator(row_shape, config.task, sample=total.sampled < total.sample_limit)  # noqa: E731
    threads = max(1, min(config.parallel_reads, os.cpu_count() or 1))
    sampled = len(train_shards)
    counted = []  # data.statistics_rows: the shards beyond the sample, only counted
    if config.statistics_rows is not None:
        counted = shards.count(fmt, train_shards, split=split, train=True, threads=threads)
        sampled = min(len(train_shards),
                      1 + int(np.searchsorted(np.cumsum([part.rows for part in counted]), config.statistics_rows)))
        counted = counted[sampled:]
    found = []
    for part in shards.scan(fmt, train_shards[:sampled], key="data.path", rules=rules, new_accumulator=new,
                            split=split, train=True, threads=threads):
        total.merge(part.train)
        found.append(dataclasses.replace(part, train=None, training_rows=part.train.rows))  # its rows, merged
    for part in counted:
        total.rows += part.training_rows
    found += counted
    found_val = ((list(shards.scan(val_fmt, val_shards, key="data.validation_path", rules=rules, new_accumulator=new,
                                   split=None, train=False, threads=threads)) if config.statistics_rows is None else
                  shards.count(val_fmt, val_shards, split=None, train=False, threads=threads)) if val_shards else [])
    bad = []
    for shard_list, parts, key in ((train_shards, found, "data.path"), (val_shards, found_val, "data.validation_path")):
        for shard, part in zip(shard_list, parts):
            for index, column, reason in part.problems:
                bad.append({"where": f"{key}: {shard.location(index, fmt.noun, getattr(fmt, 'first_index', 0))}",
                            "file": shard.items[index] if shard.items else shard.name, "shard": shard.name,
                            "record": index, "column": column, "reason": reason})
    _apply_policy(bad, config.max_bad_records, noun=fmt.column_noun)
    validation_classes = functools.reduce(statistics.add_counts, (part.validation_classes for part in found + found_val),
                                          np.zeros(0, np.int64))
    rows_per_file = ({} if config.source == "images" else
                     {shard.name: part.records for shard, part in zip(train_shards + val_shards, found + found_val)})
    stats = total.result(validation_rows=sum(part.validation_rows for part in found + found_val),
                         validation_class_counts=validation_classes, rows_per_file=rows_per_file,
                         bad_records=tuple(bad), longest_sequence=max((p.longest for p in found + found_val), default=0),
                         seconds=round(time.perf_counter() - started, 3), fingerprint=fingerprint)
    log.info("data: statistics pass: %d rows in %.1f s (%s rows/s)%s", stats.rows + stats.validation_rows,
             stats.seconds, f"{stats.rows_per_second:,.0f}" if stats.rows_per_second else "-",
             f"; values from the first {stats.value_rows:,} training rows ({sampled} of {len(train_shards)} files, "
             "data.statistics_rows), the other records counted" if config.statistics_rows is not None else "")
    return stats


def _apply_policy(bad: list[dict], limit: int, noun: str = "column") -> None:
    """data.max_bad_records: 0 stops at the first bad record, naming it; N skips up to N of them, and stops beyond."""
    if len(bad) <= limit:
        return
    first = bad[0]
    named = f"{first['where']}" + (f", {noun} {first['column']!r}" if first.get("column") else "") + f": {first['reason']}"
    if limit == 0:
        raise DataError(named)
    raise DataError(f"more than data.max_bad_records {limit} bad records ({len(bad)} found); the first: {named}")


def _excluded(stats: Statistics, train_shards, val_shards, fmt) -> tuple[tuple, tuple]:
    """The (shard, record) keys of the bad records, for the training files and the validation files."""
    found = ([], [])
    for side, shard_list, key in ((0, train_shards, "data.path"), (1, val_shards, "data.validation_path")):
        index = {shard.name: i for i, shard in enumerate(shard_list)}
        for record in stats.bad_records:
            if record["where"].startswith(key + ":") and record.get("shard") in index:
                found[side].append((index[record["shard"]], int(record["record"])))
    return tuple(found[0]), tuple(found[1])


def _check_counts(stats: Statistics, config: DataConfig, split) -> None:
    if stats.rows == 0:
        raise DataError(f"data.path: {config.path}: no training records" + (" (every record is bad)" if stats.bad_records else ""))
    if stats.validation_rows == 0:
        where = (f"data.validation_path: {config.validation_path}: no records" if config.validation_path else
                 f"data.path: {config.path}: no record falls into data.validation_split {config.validation_split:g} "
                 f"of {stats.rows} rows; raise it, or give data.validation_path")
        raise DataError(where)


def _fingerprint(config: DataConfig, seed: int, shard_list: list[shards.Shard]) -> str:
    """What the statistics depend on: the data settings, the seed (the split) and each file's size and time."""
    files = [path for shard in shard_list for path in (shard.items or (shard.name,))]
    stamps = []
    for path in files:
        try:
            info = os.stat(path)
            stamps.append((path, info.st_size, info.st_mtime_ns))
        except OSError:
            stamps.append((path, None, None))
    settings = {key: value for key, value in config.model_dump(mode="json").items()
                if key not in ("shuffle_buffer", "cache", "parallel_reads", "deterministic", "service")}
    digest = hashlib.sha1(json.dumps([settings, seed, stamps], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _vocab_size(config: DataConfig) -> int | None:
    if config.source == "pointer":
        return sequences.pointer_vocab_size(config.sequence_length)
    return config.vocab_size


def categorical_positions(config: DataConfig, feature_names: tuple[str, ...], width: int, name: str) -> tuple[int, ...]:
    """The flat-row positions data.categorical_columns names: csv columns and tfrecord features by name or
    pattern ('merchant_*'; a tfrecord feature with several values names all of them), else by position."""
    positions: list[int] = []
    for column in config.categorical_columns:
        if isinstance(column, int):
            if column >= width:
                raise DataError(f"data.categorical_columns: position {column} is outside the rows of {name}, "
                                f"which have {width} features (positions 0..{width - 1})")
            found = [column]
        else:
            found = [i for i, feature in enumerate(feature_names)
                     if fnmatch.fnmatchcase(feature, column) or fnmatch.fnmatchcase(feature.partition("[")[0], column)]
        if not found:
            known = list(dict.fromkeys(feature.partition("[")[0] for feature in feature_names))
            raise DataError(f"data.categorical_columns: {column!r} names no feature of {name}; its features are: "
                            f"{', '.join(known)}")
        positions += found
    return tuple(sorted(set(positions)))


def _spec(config: DataConfig, stats: Statistics, input_shape: tuple, image_shape, vocab_size, categorical,
          feature_names, class_names, name: str) -> DataSpec:
    if config.task == "classification":
        num_classes = config.num_classes or (len(class_names) if class_names else
                                             max(len(stats.class_counts), len(stats.validation_class_counts)))
        if num_classes < 2:
            raise DataError(f"{name}: every label is 0; classification needs at least 2 classes")
        if config.label_names is not None and len(config.label_names) != num_classes:
            raise DataError(f"data.label_names: {len(config.label_names)} names, but the labels have {num_classes} "
                            f"classes (0..{num_classes - 1}); set data.num_classes or give one name per class")
        label_names = tuple(config.label_names or class_names or (str(i) for i in range(num_classes)))
        targets = {}
    else:
        num_classes, label_names = 0, ()
        targets = {"target_mean": stats.target_mean, "target_std": stats.target_std}
    return DataSpec(input_name=config.input_name, input_shape=tuple(input_shape), num_classes=num_classes,
                    label_names=label_names, task=config.task, image_shape=image_shape, vocab_size=vocab_size,
                    categorical=categorical, feature_names=tuple(feature_names),
                    encoded_images=config.source == "images", **targets)


def record(datasets: Datasets, directory: Path) -> None:
    """Writes the statistics (statistics.json, sample.npz) into a run's data directory, for a resumed run and the
    commands after training; the bad records left out, with their reasons, go to bad_records.jsonl."""
    statistics.save(datasets.statistics, directory)
    if datasets.corpus is not None:
        from pipeline import artifacts

        artifacts.write_json_atomic(directory / TEXT_FILE, {"corpus": datasets.corpus.summary(),
                                                            "baselines": datasets.baselines.as_dict()})
        tokenizers.record(datasets.tokenizer, directory)
    bad = directory / BAD_RECORDS_FILE
    if datasets.statistics.bad_records:
        from pipeline import artifacts

        artifacts.write_text_atomic(bad, "".join(json.dumps(entry) + "\n" for entry in datasets.statistics.bad_records))
    else:
        bad.unlink(missing_ok=True)


BAD_RECORDS_FILE = "bad_records.jsonl"


def input_advice(config: DataConfig) -> str:
    """What to turn when training waits for its input (the epoch log's "input-bound" line)."""
    if config.source not in STREAMED:
        return "data.cache: true keeps the batches in memory after the first epoch"
    advice = [f"raise data.parallel_reads (now {config.parallel_reads})"]
    if config.deterministic:
        advice.append("set data.deterministic: false")
    advice.append("move the files to faster storage" if config.service else
                  "decode on more CPUs with a tf.data service (data.service)")
    return ", ".join(advice)


def explain_input_failure(datasets: Datasets, error: Exception) -> Exception:
    """A TensorFlow error raised while training read its batches, as a one-line DataError when the input pipeline
    raised it (a file changed or was cut after the statistics pass); any other error is returned as it is."""
    text = str(error)
    if "Iterator" not in text and "iterator" not in text:
        return error
    detail = shards.error_text(error)
    if not datasets.streamed:
        return DataError(f"reading the training rows failed: {detail}")
    return DataError(f"reading the training files failed mid-epoch: {detail}; the statistics pass had read them whole, "
                     "so a file changed since: start over with --fresh to check them again")


def in_memory(spec: DataSpec, train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, val_y: np.ndarray,
              cache: bool = False) -> Datasets:
    """Datasets over rows already in memory (a part of another source's rows, for tests and benchmarks), with
    the statistics of train_x."""
    stats = statistics.of_rows(train_x, train_y, spec.task, validation_rows=len(val_x))
    return Datasets(spec, stats, arrays.ArraySource(train_x, train_y, cache), arrays.ArraySource(val_x, val_y, cache))
