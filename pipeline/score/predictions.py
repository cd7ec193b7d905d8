"""A shard's predictions as a Parquet file: what pandas.read_parquet(DIR/predictions) or pyarrow.dataset reads.

Columns, in order:
    source        the input file (dictionary-encoded: one copy per file); for images from a folder, the image file
    row           the row's number in that file (csv: data rows after the header, blank lines skipped;
                  npz: the array index; tfrecord: the record index; an image file: 0), to join predictions
                  back to inputs
    <keep>        the --keep columns of a csv input, as text
    label         classifiers: the predicted class's name (pipeline.json label_names), dictionary-encoded
    <outputs>     each output of serving_default in its own dtype: a number for one value per row, a
                  fixed-size list for more (probabilities, logits)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa  # at import, not in a job's first shard (the batch extra: pipeline/score/engine.py checks for it)
import pyarrow.parquet as pq


def table(source: str | list[str], rows: np.ndarray, keep: tuple[str, ...], kept: dict[str, list[str]],
          outputs: dict[str, np.ndarray], label_names: tuple[str, ...] = ()) -> Any:
    """source: the input file, or each row's own (image files); keep: the --keep columns, in every part (null
    where the input is not csv), so the parts share one schema."""

    columns: dict[str, Any] = {
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(len(rows), np.int32)), pa.array([source]))
        if isinstance(source, str) else pa.array(source, pa.string()).dictionary_encode(),
        "row": pa.array(np.asarray(rows, np.int64)),
    }
    for name in keep:
        columns[name] = pa.array(kept.get(name) or [None] * len(rows), pa.string())
    if label_names and "probabilities" in outputs and outputs["probabilities"].ndim == 2:
        predicted = outputs["probabilities"].argmax(-1).astype(np.int32)
        columns["label"] = pa.DictionaryArray.from_arrays(pa.array(predicted), pa.array(list(label_names), pa.string()))
    for name in sorted(outputs):
        columns[name] = _column(np.asarray(outputs[name]))
    return pa.table(columns)


def _column(values: np.ndarray) -> Any:
    flat = values.reshape(len(values), -1)
    if flat.shape[1] == 1:
        return pa.array(flat[:, 0])
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


class Writer:
    """One Parquet file written a row group at a time on a thread of its own, so that the model runs the next
    rows meanwhile (pyarrow releases the GIL while it encodes and writes). put(make, *args) queues
    make(*args) -> table; leaving the block waits for every write and raises the first error.

    Dictionary pages and min/max statistics for the text and row columns only, no compression: parquet's
    default dictionary-encodes, compresses and keeps statistics for every column, which triples the write time
    of the float outputs (lists most of all) and saves next to nothing on them.
    """

    def __init__(self, path: Path) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.path = path
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="parquet")
        self._pending: list[Any] = []
        self._writer: Any = None

    def put(self, make: Any, *args: Any) -> None:
        self._pending.append(self._pool.submit(self._write, make, *args))
        while self._pending and self._pending[0].done():  # errors surface early; done futures are dropped
            self._pending.pop(0).result()

    def _write(self, make: Any, *args: Any) -> None:
        table = make(*args)
        if self._writer is None:
            text = [f.name for f in table.schema if pa.types.is_dictionary(f.type) or pa.types.is_string(f.type)]
            self._writer = pq.ParquetWriter(str(self.path), table.schema, compression="none", use_dictionary=text,
                                            write_statistics=[*text, "row"])
        self._writer.write_table(table)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            for future in self._pending:
                future.result()
        finally:
            self._pool.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()
