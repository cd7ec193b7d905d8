"""A user's own model and data, as issue 23 tried them: transactions of 16 events, each a merchant category id
(0-49) and an amount (lognormal, median ~13k, 16% above float16's maximum 65504), labelled 1 when a merchant of
categories 0-4 took more than 13k; and builders that embed the ids, rescale the amounts and run attention with
layer normalization. Small enough to train in seconds."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

EVENTS = 16
BUILDERS = '''
import keras
from keras import layers


def _events(inputs, events, width, scale, slice_with_lambda=False):
    if slice_with_lambda:
        ids = layers.Lambda(lambda t: t[:, :events], name="ids")(inputs)
        amounts = layers.Lambda(lambda t: t[:, events:], name="amounts")(inputs)
    else:
        ids, amounts = inputs[:, :events], inputs[:, events:]
    e = layers.Embedding(50, width, name="merchant_embedding")(ids)
    a = layers.Rescaling(scale, name="amount_scale")(amounts)
    a = layers.Dense(width, name="amount_proj")(layers.Reshape((events, 1), name="amount_column")(a))
    return layers.Dense(width, activation="relu", name="event_mlp")(layers.Add(name="event")([e, a]))


def _head(x, num_classes):
    logits = layers.Dense(num_classes, name="logits")(layers.GlobalMaxPooling1D(name="pool")(x))
    return layers.Activation("softmax", dtype="float32", name="probs")(logits)


def build(input_shape, num_classes, events=16, width=32, heads=2, scale=1e-4):
    """Pre-norm: LayerNormalization, then MultiHeadAttention, added back to the events."""
    inputs = keras.Input(input_shape)
    x = _events(inputs, events, width, scale)
    h = layers.LayerNormalization(name="norm")(x)
    x = layers.Add(name="residual")([x, layers.MultiHeadAttention(heads, width // heads, name="attention")(h, h)])
    return keras.Model(inputs, _head(x, num_classes), name="transactions")


def build_lambda(input_shape, num_classes, events=16, width=32, heads=2, scale=1e-4):
    """The pre-norm model with its slices written as Lambda layers of Python lambdas."""
    inputs = keras.Input(input_shape)
    x = _events(inputs, events, width, scale, slice_with_lambda=True)
    h = layers.LayerNormalization(name="norm")(x)
    x = layers.Add(name="residual")([x, layers.MultiHeadAttention(heads, width // heads, name="attention")(h, h)])
    return keras.Model(inputs, _head(x, num_classes), name="transactions")
'''


def transaction_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(merchant ids [n, 16], amounts [n, 16], labels [n])."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, (n, EVENTS))
    amounts = np.round(rng.lognormal(np.log(13000), 1.63, (n, EVENTS)), 2)
    labels = ((ids < 5) & (amounts > 13000)).any(axis=1).astype(int)
    return ids, amounts, labels


def write_transactions_csv(path: Path, n: int, seed: int) -> Path:
    ids, amounts, labels = transaction_rows(n, seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([f"merchant_{i}" for i in range(EVENTS)] + [f"amount_{i}" for i in range(EVENTS)] + ["label"])
        writer.writerows([*map(int, i), *a, y] for i, a, y in zip(ids, amounts, labels))
    return path


@dataclasses.dataclass(frozen=True)
class Transactions:
    train_csv: Path
    val_csv: Path

    def overrides(self, tmp_path: Path, builder: str = "build", *more: str) -> list[str]:
        """The user's experiment: their csv files and builder, model.normalize off (the builder rescales the
        amounts itself), Adam, runs and models under tmp_path."""
        return ["experiment=transactions", "data.source=csv", f"data.path={self.train_csv}",
                f"data.validation_path={self.val_csv}", "model.kind=custom",
                f"model.builder=tests_transactions:{builder}", "model.normalize=false", "train.optimizer=adam",
                "train.epochs=1", f"train.runs_dir={tmp_path / 'runs'}", f"export.base_path={tmp_path / 'models'}",
                *more]

    def config(self, tmp_path: Path, builder: str = "build", *more: str):
        from pipeline.config import load_config

        return load_config(None, self.overrides(tmp_path, builder, *more))


@pytest.fixture(scope="session")
def transactions(tmp_path_factory, builder_module) -> Transactions:
    """The transactions csv files (4,000 training rows, 1,000 validation rows) and builders, importable as
    model.builder 'tests_transactions:<build|build_lambda>'."""
    builder_module("tests_transactions", BUILDERS)
    directory = tmp_path_factory.mktemp("transactions")
    return Transactions(write_transactions_csv(directory / "train.csv", 4000, seed=1),
                        write_transactions_csv(directory / "val.csv", 1000, seed=2))


@pytest.fixture(scope="session")
def photographs() -> dict[str, bytes]:
    """Real photographs that ship with scikit-learn (no download): china.jpg and flower.jpg, 640 x 427 JPEGs."""
    import sklearn

    folder = Path(sklearn.__file__).parent / "datasets" / "images"
    return {name: (folder / name).read_bytes() for name in ("china.jpg", "flower.jpg")}


@pytest.fixture(scope="session")
def image_model(image_export):
    """The session's image-folder model (tests/conftest.py image_export), as the batch tools' tests name it."""
    return image_export


def write_generate_log(version_dir: Path, model_name: str, calls: list[dict], path: Path) -> Path:
    """A request log of generate calls as the server writes them (a Predict on `generate` pinned to the version),
    each answered by the version's own generate signature: calls are its inputs (prompts, max_new_tokens,
    temperature, top_k, seed)."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    loaded = tf.saved_model.load(str(version_dir))
    dtypes = {"prompts": tf.string, "max_new_tokens": tf.int32, "temperature": tf.float32, "top_k": tf.int32,
              "seed": tf.int64}
    with tf.io.TFRecordWriter(str(path)) as writer:
        for call in calls:
            inputs = {name: tf.constant(value, dtypes[name]) for name, value in call.items()}
            record = prediction_log_pb2.PredictionLog()
            record.log_metadata.model_spec.name = model_name
            record.log_metadata.model_spec.version.value = int(version_dir.name)
            request, response = record.predict_log.request, record.predict_log.response
            request.model_spec.name, request.model_spec.signature_name = model_name, "generate"
            for name, value in inputs.items():
                request.inputs[name].CopyFrom(tf.make_tensor_proto(value.numpy()))
            for name, value in loaded.signatures["generate"](**inputs).items():
                response.outputs[name].CopyFrom(tf.make_tensor_proto(value.numpy()))
            writer.write(record.SerializeToString())
    return path


@pytest.fixture(scope="session")
def generate_log():
    """write_generate_log(version_dir, model_name, calls, path), for the language-model audit tests."""
    return write_generate_log
