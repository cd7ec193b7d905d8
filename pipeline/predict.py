"""`python -m pipeline predict CONFIG [--local] [--server HOST:PORT]`: validation rows through the exported
model, with its metrics.

Over gRPC to any TF Serving (serving.client) or in-process (serving.servable.runner.Runner): the same rows,
batches and report, so the two numbers can be compared directly. Classifiers report accuracy;
regressors MAE and RMSE. A model trained on an image folder is sent the validation images' files, JPEG or PNG
bytes as they are on disk (predict_images, docs/serving.md "Sending images"): what its clients send.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from pipeline.artifacts import DATA_DIR
from pipeline.config import Config
from pipeline.data import load_datasets
from pipeline.errors import ClientError
from pipeline.export.signatures import IMAGES_INPUT, IMAGES_SIGNATURE, SIGNATURE
from serving.client import grpc_client
from serving.servable.runner import Runner


def evaluate_locally(cfg: Config) -> dict[str, float]:
    """Runs validation rows through the latest exported version in-process; prints predictions and metrics."""
    datasets = load_datasets(cfg.data, seed=cfg.seed, recorded=cfg.run_dir / DATA_DIR)
    sent = ClientInputs.of(datasets, cfg)
    runner = Runner.load(cfg.model_base_path, model_name=cfg.export.model_name)
    batches = [runner.predict({sent.input_name: sent.values[i:i + cfg.serving.batch_size]}, sent.signature)
               for i in range(0, len(sent.values), cfg.serving.batch_size)]
    outputs = {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]} if batches else {}
    return report_predictions(outputs, sent.labels, datasets.spec, f"in-process ({runner.path}{sent.what})")


def evaluate_over_grpc(cfg: Config, address: str | None = None) -> dict[str, float]:
    """Sends the config's validation rows to a model server; prints a few predictions and the metrics:
    {"accuracy"} for a classifier, {"mae", "rmse"} for a regressor.

    Args:
        cfg: data, seed, export.model_name and the serving settings are used.
        address: "host:port"; defaults to serving.host:serving.port.

    Raises:
        ClientError: the server refused a batch or could not be reached (one line).
    """
    address = address or f"{cfg.serving.host}:{cfg.serving.port}"
    datasets = load_datasets(cfg.data, seed=cfg.seed, recorded=cfg.run_dir / DATA_DIR)
    sent = ClientInputs.of(datasets, cfg)
    try:
        outputs = grpc_client.predict_rows(address, cfg.export.model_name, sent.input_name, sent.values,
                                           cfg.serving.batch_size, timeout=cfg.serving.timeout_seconds,
                                           signature_name=sent.signature)
    except grpc.RpcError as error:
        hint = " (is a model server running there? start one with `make serve`)" \
            if error.code() == grpc.StatusCode.UNAVAILABLE else ""
        raise ClientError(f"{address}: {error.code().name}: {error.details()}{hint}") from None
    return report_predictions(outputs, sent.labels, datasets.spec, f"over gRPC ({address}{sent.what})")


@dataclasses.dataclass(frozen=True)
class ClientInputs:
    """What a client sends for the config's validation rows: the signature, its input and the values, and the
    rows' labels."""

    signature: str
    input_name: str
    values: np.ndarray
    labels: np.ndarray
    what: str = ""  # for the report: ", predict_images: 337 image files, 312 bytes each on average"

    @classmethod
    def of(cls, datasets: Any, cfg: Config) -> "ClientInputs":
        if not datasets.spec.encoded_images:
            x, y = validation_rows(datasets, cfg.serving.num_examples)
            return cls(SIGNATURE, cfg.data.input_name, x, y)
        files, _, y = datasets.val.encoded_rows(cfg.serving.num_examples or len(datasets.val))
        average = sum(map(len, files)) / max(len(files), 1)
        return cls(IMAGES_SIGNATURE, IMAGES_INPUT, np.array(files, dtype=object), y,
                   f", {IMAGES_SIGNATURE}: {len(files)} image files, {average:.0f} bytes each on average")


def validation_rows(datasets: Any, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """The first num_examples validation rows (0 means all of them)."""
    return datasets.validation_rows(num_examples or None)


def compute_metrics(scores: np.ndarray, labels: np.ndarray, task: str) -> dict[str, float]:
    """{"accuracy"} from class scores, or {"mae", "rmse"} from predictions [n] or [n, 1], in float64."""
    if task == "regression":
        errors = np.asarray(scores, np.float64).reshape(len(labels)) - np.asarray(labels, np.float64)
        return {"mae": float(np.mean(np.abs(errors))), "rmse": float(np.sqrt(np.mean(errors ** 2)))}
    return {"accuracy": float(np.mean(np.asarray(scores).argmax(axis=-1) == labels))}


def report_predictions(outputs: Mapping[str, np.ndarray], labels: np.ndarray, spec: Any,
                       source: str, show: int = 5) -> dict[str, float]:
    """Prints a few predictions and the metrics of spec.task; returns the metrics.

    Scores come from 'probabilities' (classification) or 'predictions' (regression) when the model has
    it, else from its only (or first) output.
    """
    wanted = "predictions" if spec.task == "regression" else "probabilities"
    name = wanted if wanted in outputs else sorted(outputs)[0]
    scores = np.asarray(outputs[name], dtype=np.float32)
    if len(labels) == 0:
        print(f"no validation rows to evaluate, {source}", flush=True)
        return {}
    metrics = compute_metrics(scores, labels, spec.task)
    if spec.task == "regression":
        predicted = scores.reshape(len(labels))
        for i in range(min(show, len(labels))):
            print(f"row {i}: predicted {predicted[i]:.4g} ({name}), true {labels[i]:.4g}")
        print(f"MAE {metrics['mae']:.4f}, RMSE {metrics['rmse']:.4f} over {len(labels)} validation rows, {source}",
              flush=True)
        return metrics
    predicted = scores.argmax(axis=-1)
    for i in range(min(show, len(labels))):
        print(f"row {i}: predicted {spec.label_names[predicted[i]]} ({name} {scores[i, predicted[i]]:.3f}), "
              f"true {spec.label_names[labels[i]]}")
    print(f"accuracy over {len(labels)} validation rows, {source}: {metrics['accuracy']:.4f}", flush=True)
    return metrics
