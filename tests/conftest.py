"""Shared fixtures: one tiny real training run and its export, reused by the whole session."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

TINY_CONFIG = """\
# Tiny digits run for tests: seconds on 2 cores.
experiment: tiny_digits
model:
  hidden_units: [32, 16]
train:
  epochs: 3
  batch_size: 128
  learning_rate: 0.003
"""


IMAGE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_images.yaml"

# Helper modules in tests/helpers/ import by name (tests/ is not a package, and on sys.path its pipeline/ and
# serving/ folders would shadow the packages they test).
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from built_once import built_once  # noqa: E402
from lm_helpers import TINY_LM, write_texts  # noqa: E402

# Fixtures that start a model server in a child process; a test using one (even indirectly) is in the
# `subprocess` tier that `make test-fast` leaves out (docs/testing.md). Others carry the mark by hand.
SUBPROCESS_FIXTURES = ("start_server",)


def pytest_collection_modifyitems(items):
    has_gpu = None
    for item in items:
        if any(name in item.fixturenames for name in SUBPROCESS_FIXTURES):
            item.add_marker(pytest.mark.subprocess)
        if item.get_closest_marker("gpu"):
            if has_gpu is None:
                import tensorflow as tf

                has_gpu = bool(tf.config.list_physical_devices("GPU"))
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a GPU"))


@pytest.fixture(autouse=True)
def _restore_dtype_policy():
    """Training sets the global Keras policy; keep tests independent of each other's order."""
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="session")
def tiny_config_path(workdir) -> Path:
    path = workdir / "tiny.yaml"
    path.write_text(TINY_CONFIG.replace("  learning_rate: 0.003\n", f"  learning_rate: 0.003\n  runs_dir: {workdir / 'runs'}\n")
                    + f"export:\n  base_path: {workdir / 'models'}\n")
    return path


@pytest.fixture(scope="session")
def tiny_config(tiny_config_path):
    from pipeline.config import load_config

    return load_config(tiny_config_path)


@pytest.fixture(scope="session")
def trained_run(tiny_config):
    from pipeline.train import train

    run = train(tiny_config)
    keras.config.set_dtype_policy("float32")
    return run


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    version_dir: Path
    base_path: Path  # the model's base path: <export.base_path>/<model_name>
    model_name: str
    input_name: str
    val_x: np.ndarray
    val_y: np.ndarray
    keras_probabilities: np.ndarray  # the trained Keras model's output on val_x, run as a graph (as exported)


@pytest.fixture(scope="session")
def exported_model(trained_run, tiny_config) -> ExportedModel:
    import tensorflow as tf

    from pipeline.export import export

    version_dir = export(tiny_config)
    keras.config.set_dtype_policy("float32")
    val_x = trained_run.datasets.val.x
    return ExportedModel(
        version_dir=version_dir,
        base_path=tiny_config.model_base_path,
        model_name=tiny_config.export.model_name,
        input_name=tiny_config.data.input_name,
        val_x=val_x,
        val_y=trained_run.datasets.val.y,
        # As a graph: an eager call differs in the last bit where oneDNN fuses ops (docs/keras3-mixed-precision.md §10).
        keras_probabilities=keras.ops.convert_to_numpy(
            tf.function(lambda x: trained_run.model(x, training=False))(tf.constant(val_x))),
    )


@dataclasses.dataclass(frozen=True)
class LanguageModelExport:
    """The tiny language model (lm_helpers.TINY_LM) trained one epoch on lm_helpers' texts and exported once, by
    `python -m pipeline export`, for the session. Read-only: a test that exports a variant sets its own
    export.base_path; one that changes the run copies it."""

    root: Path  # doc0.txt ... doc3.txt, lm.yaml, runs/tiny_lm/, models/tiny_lm/1/
    config: Path  # lm.yaml: the whole config, data.path and the runs and models folders included
    base_path: Path  # models/tiny_lm

    @property
    def version_dir(self) -> Path:
        return self.base_path / "1"


@pytest.fixture(scope="session")
def tiny_lm_export(tmp_path_factory) -> LanguageModelExport:
    def build(root: Path) -> None:
        from pipeline import cli
        from pipeline.config import load_config
        from pipeline.train import train

        write_texts(root)
        config = root / "lm.yaml"
        config.write_text(load_config(None, [*TINY_LM, f"data.path={root}/*.txt", f"train.runs_dir={root / 'runs'}",
                                             f"export.base_path={root / 'models'}"]).to_yaml())
        train(load_config(str(config)))
        keras.config.set_dtype_policy("float32")
        assert cli.main(["export", str(config)]) == 0

    root = built_once(tmp_path_factory, "tiny_lm", build)
    return LanguageModelExport(root, root / "lm.yaml", root / "models" / "tiny_lm")


@dataclasses.dataclass(frozen=True)
class ImageExport:
    """The digits written as PNG and JPEG files in class folders (make example-data), trained one epoch and exported:
    predict_images and classify_images over the image files."""

    config: object  # the pipeline Config: load_config(IMAGE_CONFIG, overrides)
    overrides: tuple
    version_dir: Path
    base_path: Path
    model_name: str
    files: tuple  # the first validation images' file bytes, in the validation order
    rows: np.ndarray  # what the training pipeline decodes them to
    labels: np.ndarray

    @property
    def folder(self) -> Path:
        """The image folder it was trained on."""
        return Path(self.config.data.path)


@pytest.fixture(scope="session")
def image_export(tmp_path_factory) -> ImageExport:
    from pipeline.config import load_config
    from pipeline.data import load_datasets
    from pipeline.data.examples import IMAGES_DIR

    def settings(root: Path) -> tuple:
        return ("experiment=tiny_images", f"data.path={root / 'example-data' / IMAGES_DIR}", "train.epochs=1",
                f"train.runs_dir={root / 'runs'}", f"export.base_path={root / 'models'}")

    def build(root: Path) -> None:
        from pipeline.data.examples import write_examples
        from pipeline.export import export
        from pipeline.train import train

        write_examples(root / "example-data")
        config = load_config(IMAGE_CONFIG, list(settings(root)))
        train(config)
        export(config)
        keras.config.set_dtype_policy("float32")

    overrides = settings(built_once(tmp_path_factory, "image_export", build))
    config = load_config(IMAGE_CONFIG, list(overrides))
    files, rows, labels = load_datasets(config.data, config.seed, config.run_dir / "data").val.encoded_rows(64)
    return ImageExport(config, overrides, config.model_base_path / "1", config.model_base_path,
                       config.export.model_name, tuple(files), rows, labels)


def _write_float16_model(version_dir: Path) -> Path:
    """A foreign (no pipeline.json) model whose output is float16: y = x / 2 as DT_HALF."""
    import tensorflow as tf

    class Halver(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.cast(x / 2, tf.float16)}

    module = Halver()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})
    return version_dir


def _write_gate_model(version_dir: Path, payload: bool = False) -> Path:
    """gate(dir): writes dir/started, then polls until dir/release exists: holds a request in flight
    for as long as a test wants, with no timing guesses. payload: it takes x (float32 [n]) as well, a request's
    bulk, and returns its sum."""
    import tensorflow as tf

    def hold(dir):
        started = tf.io.write_file(dir + "/started", "")
        with tf.control_dependencies([started]):  # poll only after 'started' is written
            first = tf.identity(tf.constant(0, tf.int64))
        [polls] = tf.while_loop(lambda i: tf.equal(tf.size(tf.io.matching_files(dir + "/release")), 0),
                                lambda i: [i + 1], [first], parallel_iterations=1)
        return polls

    class Gate(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([], tf.string, name="dir")])
        def serve(self, dir):
            return {"polls": hold(dir)}

        @tf.function(input_signature=[tf.TensorSpec([], tf.string, name="dir"), tf.TensorSpec([None], tf.float32, name="x")])
        def serve_payload(self, dir, x):
            return {"polls": hold(dir), "sum": tf.reduce_sum(x)}

    module = Gate()
    tf.saved_model.save(module, str(version_dir),
                        signatures={"serving_default": module.serve_payload if payload else module.serve})
    return version_dir


@pytest.fixture(scope="session")
def write_float16_model():
    """write_float16_model(version_dir) -> a foreign model whose output 'y' = x / 2 is float16."""
    return _write_float16_model


@pytest.fixture(scope="session")
def write_gate_model():
    """write_gate_model(version_dir, payload=False) -> a model whose call blocks until <dir>/release exists."""
    return _write_gate_model


@pytest.fixture(scope="session")
def builder_module(tmp_path_factory):
    """builder_module(name, source): writes a Python module that `model.builder: '<name>:<function>'` can
    import (model builders for tests), importable for the rest of the session."""
    directory = tmp_path_factory.mktemp("builders")
    sys.path.insert(0, str(directory))
    written: list[str] = []

    def write(name: str, source: str) -> None:
        (directory / f"{name}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(name, None)
        written.append(name)

    yield write
    sys.path.remove(str(directory))
    for name in written:
        sys.modules.pop(name, None)

