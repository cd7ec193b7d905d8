"""oneDNN's frozen-weights switch (serving/frozen_weights.py): which spellings TensorFlow takes as on, and the
server's start-up line either way. A real server under it is tests/serving/test_generate_served.py's, training's
refusal tests/pipeline/train/test_run.py's, the export's check tests/pipeline/export/test_lm_export.py's."""

from __future__ import annotations

import pytest

from serving import frozen_weights


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("false", False), ("", False), ("1", True),
                                       ("True", True), (" true ", False)])
def test_the_spellings_tensorflow_takes(value, on):
    environ = {} if value is None else {"TF_ONEDNN_ASSUME_FROZEN_WEIGHTS": value}
    assert frozen_weights.is_on(environ) is on
    assert ("keeps weights pre-packed" in frozen_weights.describe(environ)) is on
