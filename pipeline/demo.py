"""`make demo`: the whole path once — train, export, start `python -m serving`, predict over gRPC, stop."""

from __future__ import annotations

import logging

from pipeline.artifacts import SERVER_LOG
from pipeline.config import Config
from pipeline.export import export
from pipeline.predict import compute_metrics, evaluate_over_grpc, validation_rows
from pipeline.serve import serving_flags
from pipeline.train import train
from serving.client.process import running_server

log = logging.getLogger(__name__)


def run_demo(cfg: Config) -> dict[str, float]:
    """Returns the metrics measured over gRPC: accuracy, or MAE and RMSE for regression."""
    run = train(cfg)
    version_dir = export(cfg)
    log_path = cfg.run_dir / SERVER_LOG
    with running_server(serving_flags(cfg, port=0), log_path) as server:
        log.info("model server serving at %s (pid %d, log %s)", server.address, server.process.pid, log_path)
        served = evaluate_over_grpc(cfg, server.address)
    # The trained Keras model on the same validation rows the client sent.
    x, y = validation_rows(run.datasets, cfg.serving.num_examples)
    trained = compute_metrics(run.model.predict(x, batch_size=256, verbose=0), y, run.datasets.spec.task)
    sent = " (the image files' JPEG/PNG bytes, decoded by the server)" if run.datasets.spec.encoded_images else ""
    summary = ", ".join(f"val_{name} {trained[name]:.4f} in-process, {served[name]:.4f} over gRPC{sent}"
                        for name in trained)
    print(f"\ndemo: {cfg.experiment} trained under {run.policy.name}: {summary} from {version_dir} "
          f"(server log: {log_path})")
    return served
