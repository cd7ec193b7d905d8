"""Rows streamed from sharded files (TFRecord, CSV, image folders), read as TF Model Garden's input reader reads
them: shuffle the shard list, shard it among workers, read several shards at once (parallel interleave), shuffle
a buffer of records, decode in parallel, batch, prefetch. Nothing holds the data set in memory.

Every graph piece is a TensorFlow op (no py_function, no from_generator), so the same pipeline runs on a tf.data
service (data.service). The statistics pass (scan) reads every record once before training, in the files' own
order: it counts records per file and per class, accumulates the statistics, and finds every record that does
not decode or does not pass the checks (checks.py). Those records are named, counted under data.max_bad_records
and left out of every epoch by their (file, record) key; the epochs can then decode a batch at a time. With
data.statistics_rows, the files beyond the sample are only counted (count), and checked as training reads them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from pipeline.data import checks
from pipeline.data.statistics import Accumulator, add_counts
from serving.errors import op_error_text

SCAN_BATCH = 4096  # records per decode in the statistics pass
SPLIT_BLOCK, SPLIT_STEP = 1000, 619  # the split rule (Split); 619 is prime, so the steps visit every position
KEEP_BLOCK = 1024  # records whose keys are checked at once (ShardSource._records_of)


@dataclasses.dataclass(frozen=True)
class Shard:
    """One unit of reading: a file (TFRecord, CSV) or a group of image files."""

    name: str  # the file, or the group's first image (logs)
    payload: Any  # what the format's records() reads: the path, or (paths, labels) of a group of images
    items: tuple[str, ...] = ()  # image groups: the file of each record

    def location(self, index: int, noun: str, first_index: int = 0) -> str:
        """Where record `index` of this shard is: 'train-0.tfrecord record 7', 'a.csv line 9', 'daisy/3.jpg'."""
        if self.items:
            return self.items[index]
        return f"{self.name} {noun} {index + first_index}"

    def split_names(self, indices: np.ndarray) -> list[str]:
        """The names the split rule hashes: the image's path below its class folder, else the file's base name."""
        if self.items:
            return ["/".join(self.items[i].split("/")[-2:]) for i in indices]
        return [self.name.rsplit("/", 1)[-1]] * len(indices)


@dataclasses.dataclass(frozen=True)
class Split:
    """data.validation_split by a rule on each record, the same answer for every command and every machine.

    A file's records are taken in blocks of SPLIT_BLOCK; within a block, record i is validation when
    (i * SPLIT_STEP + offset) mod SPLIT_BLOCK < share * SPLIT_BLOCK, the offset a hash of (seed, file name, block).
    SPLIT_STEP / SPLIT_BLOCK is close to the golden ratio, so the validation records are spread evenly through
    the block and every full block holds exactly the share; a small file holds it within a record or two."""

    share: float
    seed: int
    validation: bool  # which side this source keeps

    def is_validation(self, names, indices) -> tf.Tensor:
        indices = tf.cast(indices, tf.int64)
        blocks = tf.strings.as_string(indices // SPLIT_BLOCK)
        offset = tf.strings.to_hash_bucket_fast(tf.strings.join([str(self.seed), ":", names, ":", blocks]), SPLIT_BLOCK)
        position = (indices % SPLIT_BLOCK * SPLIT_STEP + offset) % SPLIT_BLOCK
        return tf.cast(position, tf.float64) < self.share * SPLIT_BLOCK

    def keeps(self, names, indices) -> tf.Tensor:
        validation = self.is_validation(names, indices)
        return validation if self.validation else tf.logical_not(validation)


class ShardSource:
    """One split's rows from shards: tf.data pipelines over them, and the first rows in memory."""

    def __init__(self, fmt, shards: list[Shard], *, key: str, input_shape: tuple[int, ...], label_dtype: tf.DType,
                 split: Split | None = None, exclude: tuple[tuple[int, int], ...] = (), sequence_length: int | None = None,
                 parallel_reads: int = 4, deterministic: bool = True, rows: int = 0) -> None:
        self.format, self.shards, self.key = fmt, shards, key
        self.input_shape, self.label_dtype = input_shape, label_dtype
        self.split, self.exclude, self.sequence_length = split, exclude, sequence_length
        self.parallel_reads, self.deterministic = parallel_reads, deterministic
        self.count = rows

    def __len__(self) -> int:
        return self.count

    def dataset(self, batch_size: int, shuffle_buffer: int | None = None, seed=None, *,
                input_context: tf.distribute.InputContext | None = None, skip: int = 0,
                drop_remainder: bool = False) -> tf.data.Dataset:
        """Batches of (features float32 [n, *input_shape], labels). With a seed (training) the shard order and a
        buffer of shuffle_buffer records are shuffled from it; without, the records come in the files' order.
        input_context: this worker's part (whole shards when there are enough, else every n-th record); skip:
        records to leave out at the start (a resumed epoch)."""
        records = self._records(shuffle_buffer, seed, input_context, skip)
        if self.format.per_record:
            decoded = records.map(self.format.decode, num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=self.deterministic or seed is None)
            batches = decoded.batch(batch_size, drop_remainder=drop_remainder)
        else:
            batches = records.batch(batch_size, drop_remainder=drop_remainder).map(
                self.format.decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=self.deterministic or seed is None)
        return batches.map(self._finish).prefetch(tf.data.AUTOTUNE)

    def _records(self, shuffle_buffer, seed, input_context, skip) -> tf.data.Dataset:
        """The records before decoding, in dataset()'s order."""
        shard_ids = tf.data.Dataset.range(len(self.shards))
        if seed is not None:
            shard_ids = shard_ids.shuffle(len(self.shards), seed=seed)
        workers, worker = ((input_context.num_input_pipelines, input_context.input_pipeline_id)
                           if input_context else (1, 0))
        by_shard = workers > 1 and len(self.shards) >= workers
        if by_shard:
            shard_ids = shard_ids.shard(workers, worker)
        records = shard_ids.interleave(self._records_of, cycle_length=max(1, min(self.parallel_reads, len(self.shards))),
                                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=self.deterministic or seed is None)
        if workers > 1 and not by_shard:  # fewer shards than workers: every worker reads all, keeps its share
            records = records.shard(workers, worker)
        if seed is not None:
            records = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=False)
        if skip:
            records = records.skip(skip)
        return records

    def encoded_rows(self, limit: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """The first `limit` records as stored (an image file's bytes), with the rows this source decodes them to
        (dataset()'s own decode): what a bytes signature must turn them into."""
        records = self._records(None, None, None, 0).take(limit)
        pairs = records.map(lambda contents, label: (contents, *self.format.decode(contents, label)))
        stored, xs, ys = [], [], []
        for contents, x, y in pairs.batch(max(1, limit)):
            stored += [bytes(item) for item in contents.numpy()]
            x, y = self._finish(x, y)
            xs.append(x.numpy())
            ys.append(y.numpy())
        if not stored:
            return [], np.zeros((0, *self.input_shape), np.float32), np.zeros(0, self.label_dtype.as_numpy_dtype)
        return stored, np.concatenate(xs), np.concatenate(ys)

    def _payloads(self):
        payloads = [shard.payload for shard in self.shards]
        if isinstance(payloads[0], tuple):  # image groups: (paths, labels) of any length
            return tuple(tf.ragged.constant([list(part) for part in column]) for column in zip(*payloads))
        return tf.constant(payloads)

    def _records_of(self, shard: tf.Tensor) -> tf.data.Dataset:
        """One shard's records that this split keeps, in their order. The keys (shard, position) are looked at a
        block of KEEP_BLOCK records at a time: one op per block, not per record (per record, the split rule's
        string hashing held the whole pipeline to ~20,000 rows/s on 2 cores)."""
        payloads = self._payloads()
        payload = tuple(column[shard] for column in payloads) if isinstance(payloads, tuple) else payloads[shard]
        records = self.format.records(payload)
        keep = self._keep(shard, payload)
        if keep is None:
            return records

        def kept(indices, block):
            mask = keep(indices, block)
            return tuple(tf.boolean_mask(part, mask) for part in block) if isinstance(block, tuple) else \
                tf.boolean_mask(block, mask)

        return records.enumerate().batch(KEEP_BLOCK).map(kept).unbatch()

    def _keep(self, shard, payload) -> Callable | None:
        """keep(indices, records) → which of a block of records this split reads; None when it reads them all."""
        skips = hasattr(self.format, "skip")
        excluded = tf.constant([s * 2 ** 32 + i for s, i in self.exclude], tf.int64) if self.exclude else None
        if not skips and excluded is None and self.split is None:
            return None
        names = tf.constant([s.split_names([0])[0] for s in self.shards])[shard]
        if self.shards[0].items:  # image groups: the split rule reads each image's own name
            names = tf.strings.reduce_join(tf.strings.split(payload[0], "/")[:, -2:], axis=-1, separator="/")

        def keep(indices, records):
            ok = tf.ones_like(indices, tf.bool)
            if skips:
                ok &= tf.logical_not(self.format.skip(records))
            if excluded is not None:
                keys = shard * 2 ** 32 + indices
                ok &= tf.logical_not(tf.reduce_any(tf.equal(keys[:, None], excluded[None, :]), axis=1))
            if self.split is not None:
                ok &= self.split.keeps(tf.gather(names, indices) if self.shards[0].items else names, indices)
            return ok

        return keep

    def _finish(self, x, y):
        """The model's input: token ids padded to the sequence length, rows in data.image_shape, labels typed."""
        if isinstance(x, tf.RaggedTensor):
            x = x.to_tensor(0.0, shape=[None, self.sequence_length])
        x = tf.reshape(tf.cast(x, tf.float32), [-1, *self.input_shape])
        return x, tf.cast(y, self.label_dtype)

    def rows(self, limit: int | None = None, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """The first `limit` rows (None: all) in the files' order, in memory: for the parity gate, verify, predict."""
        xs, ys, held = [], [], 0
        for x, y in self.dataset(batch_size if limit is None else max(1, min(batch_size, limit))):
            xs.append(x.numpy())
            ys.append(y.numpy())
            held += len(xs[-1])
            if limit is not None and held >= limit:
                break
        if not xs:
            return np.zeros((0, *self.input_shape), np.float32), np.zeros(0, self.label_dtype.as_numpy_dtype)
        x, y = np.concatenate(xs), np.concatenate(ys)
        return (x, y) if limit is None else (x[:limit], y[:limit])


@dataclasses.dataclass
class ShardScan:
    """What the statistics pass found in one shard."""

    records: int = 0  # every record of the file (bad and skipped ones included)
    train: Accumulator | None = None
    validation_rows: int = 0
    validation_classes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    problems: list[tuple[int, str | None, str]] = dataclasses.field(default_factory=list)  # (record, column, reason)
    longest: int = 0
    training_rows: int = 0  # its training rows once its accumulator is merged and dropped, or only counted

    @property
    def rows(self) -> int:
        """The shard's training rows: accumulated, or only counted."""
        return self.train.rows if self.train is not None else self.training_rows


def scan(fmt, shards: list[Shard], *, key: str, rules: checks.Rules, new_accumulator: Callable[[], Accumulator],
         split: Split | None, train: bool, threads: int) -> Iterator[ShardScan]:
    """The statistics pass over shards: every record decoded once, checked, counted and (training rows)
    accumulated, a shard per thread; results in the shards' order, so the numbers do not depend on timing, and
    as they come (merge and drop each one: memory stays that of a few shards, whatever their number)."""
    def one(shard: Shard) -> ShardScan:
        return _scan_shard(fmt, shard, key=key, rules=rules, accumulator=new_accumulator() if train or split else None,
                           split=split, train=train)

    return _in_order(one, shards, threads)


def _in_order(function: Callable, items: list, threads: int) -> Iterator:
    """function(item) for each item, on `threads` threads, yielded in the items' order; at most threads + 1
    results are computed ahead of the one being consumed."""
    if threads <= 1 or len(items) <= 1:
        yield from (function(item) for item in items)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        pending = collections.deque()
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) > threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def count(fmt, shards: list[Shard], *, split: Split | None, train: bool, threads: int) -> list[ShardScan]:
    """Each shard's records and its training and validation rows, read but not decoded (an image folder: not
    even read): the shards beyond data.statistics_rows' sample. Their records are checked as training reads
    them."""
    def one(shard: Shard) -> ShardScan:
        if shard.items:
            records = len(shard.items)
            indices = np.arange(records)
            validation = (split.is_validation(shard.split_names(indices), indices).numpy() if split is not None
                          else np.full(records, not train))
            return ShardScan(records=records, validation_rows=int(validation.sum()),
                             training_rows=int(records - validation.sum()))
        counted = np.zeros(3, np.int64)  # records, kept (not blank), validation among the kept
        for indices, block in fmt.records(shard.payload).enumerate().batch(SCAN_BATCH * 4):
            indices = indices.numpy()
            kept, validation = _records_kept(fmt, block, indices), _validation(shard, indices, split, train)
            counted += [len(indices), kept.sum(), (kept & validation).sum()]
        records, kept, validation = (int(c) for c in counted)
        return ShardScan(records=records, validation_rows=validation, training_rows=kept - validation)

    return list(_in_order(one, shards, threads))


def _scan_shard(fmt, shard: Shard, *, key: str, rules: checks.Rules, accumulator: Accumulator | None,
                split: Split | None, train: bool) -> ShardScan:
    found = ShardScan(train=accumulator)
    try:
        for indices, records in fmt.records(shard.payload).enumerate().batch(SCAN_BATCH):
            indices = indices.numpy()
            found.records = int(indices[-1]) + 1
            keep = _records_kept(fmt, records, indices)
            x, y, lengths, decoded = _decode(fmt, records, keep, indices, found.problems)
            if x is None:
                continue
            indices = indices[decoded]
            validation = _validation(shard, indices, split, train)
            problems = checks.find_problems(x, y, rules, lengths)
            bad = np.zeros(len(indices), bool)
            for problem in problems:
                bad[problem.row] = True
                found.problems.append((int(indices[problem.row]), problem.column, problem.reason))
            good_train, good_validation = ~bad & ~validation, ~bad & validation
            if found.train is not None and good_train.any():
                found.train.add(x[good_train], y[good_train])
            found.validation_rows += int(good_validation.sum())
            if rules.task == "classification" and good_validation.any():
                found.validation_classes = add_counts(found.validation_classes,
                                                      np.bincount(np.asarray(y[good_validation], np.int64)))
            if lengths is not None and (~bad).any():
                found.longest = max(found.longest, int(lengths[~bad].max()))
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError, tf.errors.NotFoundError) as error:
        raise fmt.damaged_file(shard.payload if isinstance(shard.payload, str) else shard.name, key) from error
    return found


def _records_kept(fmt, records, indices: np.ndarray) -> np.ndarray:
    """Which records of a block are records at all (a csv file's blank lines are not)."""
    return ~fmt.skip(records).numpy() if hasattr(fmt, "skip") else np.ones(len(indices), bool)


def _validation(shard: Shard, indices: np.ndarray, split: Split | None, train: bool) -> np.ndarray:
    """Which records of a block are validation rows: by the split rule, else all of them or none (the shard is
    a training or a validation file)."""
    if split is not None:
        return split.is_validation(shard.split_names(indices), indices).numpy()
    return np.full(len(indices), not train)


def _decode(fmt, records, keep: np.ndarray, indices: np.ndarray, problems: list):
    """(x, y, lengths, decoded mask) of a batch's kept records: decoded together, or one at a time when the batch
    fails, each failure a problem named by the format. x: [n, width] (token ids padded to the batch's longest)."""
    batch = _select(records, keep)
    try:
        decoded = np.flatnonzero(keep)
        x, y = _decode_many(fmt, batch)
    except (tf.errors.InvalidArgumentError, ValueError):
        rows, good = [], []
        for i in np.flatnonzero(keep):
            record = _select(records, np.arange(len(keep)) == i)
            try:
                rows.append(_decode_many(fmt, record))
                good.append(i)
            except (tf.errors.InvalidArgumentError, ValueError) as error:
                raw = _raw(record)
                column, reason = fmt.diagnose(raw) or (None, error_text(error))
                problems.append((int(indices[i]), column, reason))
        if not rows:
            return None, None, None, None
        decoded = np.asarray(good)
        x = _concat([r[0] for r in rows])
        y = np.concatenate([r[1] for r in rows])
    lengths = None
    if isinstance(x, np.ndarray) and x.dtype == object:  # token ids: padded to the batch's longest
        lengths = np.asarray([len(row) for row in x])
        padded = np.zeros((len(x), max(1, lengths.max(initial=0))))
        for i, row in enumerate(x):
            padded[i, :len(row)] = row
        x = padded
    mask = np.zeros(len(keep), bool)
    mask[decoded] = True
    return x, y, lengths, mask


def _select(records, mask: np.ndarray):
    mask = tf.constant(mask)
    if isinstance(records, tuple):
        return tuple(tf.boolean_mask(part, mask) for part in records)
    return tf.boolean_mask(records, mask)


def _decode_many(fmt, records) -> tuple[np.ndarray, np.ndarray]:
    """A block of records decoded together; raises when any of them does not decode."""
    if fmt.per_record:  # one at a time, on tf.data's threads: an image a few ms, many per core
        count = int(tf.shape(records[0] if isinstance(records, tuple) else records)[0])
        if count == 1:  # the one-record retries after a block failed: no pipeline for one record
            x, y = fmt.decode(*(part[0] for part in records)) if isinstance(records, tuple) else fmt.decode(records[0])
            return np.asarray(x)[None], np.asarray(y)[None]
        decoded = tf.data.Dataset.from_tensor_slices(records).map(fmt.decode, num_parallel_calls=tf.data.AUTOTUNE)
        x, y = next(iter(decoded.batch(max(count, 1))), (np.zeros((0,)), np.zeros(0)))
        return np.asarray(x), np.asarray(y)
    x, y = fmt.decode(records)
    if isinstance(x, tf.RaggedTensor):
        rows = np.empty(x.shape[0], object)
        rows[:] = [np.asarray(row, np.float64) for row in x.numpy()]
        return rows, y.numpy()
    return x.numpy(), y.numpy()


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if parts[0].dtype == object:
        rows = np.empty(sum(len(p) for p in parts), object)
        rows[:] = [row for p in parts for row in p]
        return rows
    return np.concatenate(parts)


def _raw(record):
    if isinstance(record, tuple):
        return tuple(part.numpy()[0] for part in record)
    return record.numpy()[0]


def error_text(error: Exception) -> str:
    """A TensorFlow error's message in one line: without the node trace, the {{function_node ...}} prefix and the
    [Op:...] suffix."""
    return op_error_text(error.message if isinstance(error, tf.errors.OpError) else str(error),
                         type(error).__name__)
