"""A shard's predictions as a Parquet file: what pandas.read_parquet(DIR/predictions) or pyarrow.dataset reads.

Columns, in order:
    source        the input file (dictionary-encoded: one copy per file)
    row           the row's number in that file (csv: data rows after the header, blank lines skipped;
                  npz: the array index; tfrecord: the record index), to join predictions back to inputs
    <keep>        the --keep columns of a csv input, as text
    label         classifiers: the predicted class's name (pipeline.json label_names)
    <outputs>     each output of serving_default in its own dtype: a number for one value per row, a
                  fixed-size list for more (probabilities, logits)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def table(source: str, rows: np.ndarray, keep: tuple[str, ...], kept: dict[str, list[str]],
          outputs: dict[str, np.ndarray], label_names: tuple[str, ...] = ()) -> Any:
    """keep: the --keep columns, in every part (null where the input is not csv), so the parts share one schema."""
    import pyarrow as pa

    columns: dict[str, Any] = {
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(len(rows), np.int32)), pa.array([source])),
        "row": pa.array(np.asarray(rows, np.int64)),
    }
    for name in keep:
        columns[name] = pa.array(kept.get(name) or [None] * len(rows), pa.string())
    if label_names and "probabilities" in outputs and outputs["probabilities"].ndim == 2:
        columns["label"] = pa.array(np.asarray(label_names, object)[outputs["probabilities"].argmax(-1)], pa.string())
    for name in sorted(outputs):
        columns[name] = _column(np.asarray(outputs[name]))
    return pa.table(columns)


def _column(values: np.ndarray) -> Any:
    import pyarrow as pa

    flat = values.reshape(len(values), -1)
    if flat.shape[1] == 1:
        return pa.array(flat[:, 0])
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def write(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, str(path))
