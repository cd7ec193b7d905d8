"""oneDNN's frozen-weights switch (serving/frozen_weights.py): on in a `python -m serving` process unless the user
chose otherwise, never set in a process where TensorFlow already loaded (a test or a notebook that also trains).
The server's own start-up line is checked with a real server in tests/serving/test_generate_served.py, and the
training side's refusal in tests/pipeline/train/test_run.py."""

from __future__ import annotations

import pytest

from serving import frozen_weights

VARIABLE = "TF_ONEDNN_ASSUME_FROZEN_WEIGHTS"


def test_a_fresh_serving_process_turns_it_on():
    environ: dict = {}
    assert frozen_weights.assume_frozen_weights(environ, modules={}) is True
    assert environ == {VARIABLE: "1"}
    assert "pre-packed" in frozen_weights.describe(environ)


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("1", True), ("True", True)])
def test_the_users_own_setting_is_kept(value, on):
    environ = {VARIABLE: value}
    assert frozen_weights.assume_frozen_weights(environ, modules={}) is on
    assert environ == {VARIABLE: value}
    assert ("pre-packed" in frozen_weights.describe(environ)) is on


def test_nothing_is_set_once_tensorflow_has_loaded():
    """TensorFlow read the variable when it loaded: setting it now would change nothing here and would reach the
    process's children (a training child among them)."""
    environ: dict = {}
    assert frozen_weights.assume_frozen_weights(environ, modules={"tensorflow": object()}) is False
    assert environ == {}
    assert "repacks weights on every call" in frozen_weights.describe(environ)
