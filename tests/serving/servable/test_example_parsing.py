"""serving/servable/example_parsing.py: a Classify/Regress request that the signature's ParseExample op would
refuse is answered before it runs, with the op's own error, word for word; nothing the op accepts is refused.

Every case is run both ways on the same Runner: through inference.prepare_classify (the check) and straight
into the model (Runner.run, the op), and the two answers are compared.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import classification_pb2, input_pb2

from serving import errors
from serving.servable import inference
from serving.servable.example_parsing import read_spec
from serving.servable.runner import Runner

pytestmark = pytest.mark.timeout(120)

SPEC = {
    "x": tf.io.FixedLenFeature([2], tf.float32),
    "n": tf.io.FixedLenFeature([], tf.int64),
    "tag": tf.io.FixedLenFeature([1], tf.string, default_value=["none"]),
    "pair": tf.io.FixedLenFeature([2], tf.string, default_value=["a", "b"]),
    "grid": tf.io.FixedLenFeature([2, 3], tf.float32, default_value=np.zeros((2, 3), np.float32)),
    "seq": tf.io.FixedLenSequenceFeature([2], tf.float32, allow_missing=True),
    "ids": tf.io.VarLenFeature(tf.int64),
}


class _Model(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify(self, inputs):
        parsed = tf.io.parse_example(inputs, SPEC)
        score = (parsed["x"][:, :1] + tf.cast(parsed["n"][:, None], tf.float32)
                 + tf.reduce_sum(parsed["grid"], axis=[1, 2])[:, None] + tf.reduce_sum(parsed["seq"], axis=1)[:, :1])
        return {"scores": tf.concat([score, -score], axis=1)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def two_parsers(self, inputs):
        first = tf.io.parse_example(inputs, {"x": SPEC["x"]})["x"]
        second = tf.io.parse_example(inputs, {"n": SPEC["n"]})["n"]
        return {"scores": first + tf.cast(second[:, None], tf.float32)}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Runner:
    module = _Model()
    path = tmp_path_factory.mktemp("parsing") / "1"
    tf.saved_model.save(module, str(path), signatures={"classify": module.classify, "two_parsers": module.two_parsers})
    return Runner.load(path, model_name="parsing")


@pytest.fixture(scope="module")
def half_plus_two(tmp_path_factory, copy_testdata) -> Runner:
    """TF Serving's TF1 fixture: classify_x_to_y parses x (float [1], required) and x2 (float [1], default)."""
    return Runner.load(copy_testdata("saved_model_half_plus_two_cpu", tmp_path_factory.mktemp("hp2") / "m"),
                       model_name="half_plus_two")


def floats(*values):
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def ints(*values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def strings(*values):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))


def example(**features) -> tf.train.Example:
    return tf.train.Example(features=tf.train.Features(feature=features))


GOOD = dict(x=floats(1, 2), n=ints(3))
# (case, examples, context, caught): caught says whether the check answers it before the op, or leaves it to the op.
CASES = [
    ("good", [GOOD], None, False),
    ("good with every feature", [dict(GOOD, tag=strings(b"a"), grid=floats(*range(6)), seq=floats(1, 2, 3, 4),
                                      ids=ints(1, 2, 3))], None, False),
    ("too many floats", [dict(GOOD, x=floats(1, 2, 3))], None, True),
    ("too few floats in a 2-d feature", [dict(GOOD, grid=floats(1, 2, 3, 4, 5))], None, True),
    ("int64 for float", [dict(GOOD, x=ints(1, 2))], None, True),
    ("float for string", [dict(GOOD, tag=floats(1.0))], None, True),
    ("two int64 for a scalar", [dict(GOOD, n=ints(1, 2))], None, True),
    ("two strings for one", [dict(GOOD, tag=strings(b"a", b"b"))], None, True),
    ("no strings for two", [dict(GOOD, pair=strings())], None, True),
    ("one string for two", [dict(GOOD, pair=strings(b"a"))], None, True),
    ("required feature missing", [dict(n=ints(3))], None, True),
    ("required scalar missing", [dict(x=floats(1, 2))], None, True),
    ("required feature present but empty", [dict(GOOD, x=tf.train.Feature())], None, True),
    ("an empty list where a default exists", [dict(GOOD, tag=tf.train.Feature(bytes_list=tf.train.BytesList()))],
     None, True),
    ("the third example of three", [GOOD, GOOD, dict(GOOD, x=floats(1))], None, True),
    ("context supplies a required feature", [dict(n=ints(3))], dict(x=floats(1, 2)), False),
    ("example overrides the context with the wrong type", [dict(n=ints(3), x=ints(1, 2))], dict(x=floats(1, 2)), True),
    ("context brings the wrong count", [dict(n=ints(3))], dict(x=floats(1)), True),
    # Left to the op: variable-length counts and sparse features.
    ("a sequence of the wrong stride", [dict(GOOD, seq=floats(1, 2, 3))], None, False),
    ("a sparse feature of the wrong type", [dict(GOOD, ids=floats(1.0))], None, False),
]


def request_input(examples, context) -> input_pb2.Input:
    value = input_pb2.Input()
    if context is None:
        value.example_list.examples.extend(example(**features) for features in examples)
    else:
        value.example_list_with_context.examples.extend(example(**features) for features in examples)
        value.example_list_with_context.context.CopyFrom(example(**context))
    return value


def checked(runner: Runner, signature: str, value: input_pb2.Input) -> str | None:
    """The check's answer: its error message, or None if the request goes on to the model."""
    request = classification_pb2.ClassificationRequest(input=value)
    request.model_spec.name, request.model_spec.signature_name = runner.model_name, signature
    try:
        inference.prepare_classify(runner, request)
    except errors.InputError as error:
        return str(error)
    return None


def op_answer(runner: Runner, signature: str, value: input_pb2.Input) -> str | None:
    """The op's answer for the same rows, run straight into the model: its error message, or None."""
    try:
        runner.run(runner.call({"inputs": inference.serialized_examples(value)}, signature))
    except errors.InputError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, examples, context, caught", CASES, ids=[case[0] for case in CASES])
def test_the_check_answers_as_the_op_would(model, case, examples, context, caught):
    value = request_input(examples, context)
    ours, theirs = checked(model, "classify", value), op_answer(model, "classify", value)
    if caught:
        assert ours is not None and ours == theirs
        assert errors.status_for(errors.InputError(ours))[0] == grpc.StatusCode.INVALID_ARGUMENT
    else:
        assert ours is None


@pytest.mark.parametrize("features, caught", [
    (dict(x=floats(1.0)), False),
    (dict(x=floats(1.0), x2=floats(2.0)), False),
    (dict(x=floats(1.0, 2.0)), True),
    (dict(x2=floats(2.0)), True),
    (dict(x=floats(1.0), x2=ints(2)), True),
], ids=["x", "x and x2", "two values of x", "x missing", "x2 of int64"])
def test_a_tf1_graphs_parser_is_found_through_the_signatures_input(half_plus_two, features, caught):
    value = request_input([features], None)
    ours, theirs = checked(half_plus_two, "classify_x_to_y", value), op_answer(half_plus_two, "classify_x_to_y", value)
    assert (ours == theirs) if caught else (ours is None and theirs is None)


def test_signatures_that_parse_twice_or_not_at_all_are_left_to_the_op(model):
    assert model.signature("classify").examples is not None
    assert model.signature("two_parsers").examples is None
    assert read_spec(tf.Graph().as_graph_def()) is None
