"""Input proto -> the DT_STRING batch of serialized tf.Examples that Classify, Regress and MultiInference feed.

As TF Serving's InputToSerializedExampleTensor (servables/tensorflow/util.cc) does it:
`example_list` rows are fed as they are; with `example_list_with_context`, each row is the serialized
context followed by the serialized example. Parsing concatenated protos merges them, so every row
carries the context's features, and where both set a feature the example's value wins.

The number of rows counts against --max_request_elements (serving/limits.py), and the copies of a
context against MAX_CONTEXT_COPY_BYTES, both checked before any row is built: a request cannot make
the server hold much more than it sent (a 1 MB context and 1,000 empty examples would be 1 GB of rows).
"""

from __future__ import annotations

import numpy as np
from tensorflow_serving.apis import input_pb2

from serving import limits
from serving.errors import InvalidArgument


def serialized_examples(input: input_pb2.Input, max_rows: int | None = None) -> np.ndarray:
    """The request's rows as a 1-D object array of bytes, one serialized tf.Example per row.

    max_rows: the most rows allowed (0: no limit); None takes the server's --max_request_elements.

    Raises:
        InvalidArgument: no rows (TF Serving's "Input is empty."), or more than max_rows.
    """
    kind = input.WhichOneof("kind")
    examples = getattr(input, kind).examples if kind else ()
    limit = limits.max_request_elements() if max_rows is None else max_rows
    if limit and len(examples) > limit:
        raise InvalidArgument(f"Input has {len(examples)} examples; the server allows at most {limit} per request "
                              "(--max_request_elements)")
    if kind == "example_list_with_context":
        copies = input.example_list_with_context.context.ByteSize() * max(len(examples) - 1, 0)
        if copies > limits.MAX_CONTEXT_COPY_BYTES:
            raise InvalidArgument(f"Input's context of {input.example_list_with_context.context.ByteSize()} bytes "
                                  f"would be copied into {len(examples)} examples ({copies} bytes); at most "
                                  f"{limits.MAX_CONTEXT_COPY_BYTES} bytes of copies are allowed per request")
    if kind == "example_list":
        rows = [example.SerializeToString() for example in input.example_list.examples]
    elif kind == "example_list_with_context":
        context = input.example_list_with_context.context.SerializeToString()
        rows = [context + example.SerializeToString() for example in input.example_list_with_context.examples]
    else:
        rows = []
    if not rows:
        raise InvalidArgument("Input is empty. Put serialized tf.Example rows in input.example_list.examples "
                              "or input.example_list_with_context.examples")
    batch = np.empty(len(rows), dtype=object)
    batch[:] = rows
    return batch
