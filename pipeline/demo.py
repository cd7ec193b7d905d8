"""`make demo`: the whole path once — train, export, start `python -m serving`, predict over gRPC, stop. A language
model (model.kind causal_lm) is asked over gRPC for a greedy completion instead, printed beside the in-process one."""

from __future__ import annotations

import logging

import grpc
import numpy as np
from tensorflow_serving.apis import prediction_service_pb2_grpc

from pipeline import generate
from pipeline.artifacts import SERVER_LOG
from pipeline.config import Config
from pipeline.errors import ParityError
from pipeline.export import export, lm, lm_parity
from pipeline.predict import compute_metrics, evaluate_over_grpc, validation_rows
from pipeline.serve import serving_flags
from pipeline.train import train
from serving.client import grpc_client
from serving.client.process import running_server
from serving.servable import saved_model, tensors

log = logging.getLogger(__name__)


def run_demo(cfg: Config) -> dict[str, float]:
    """Returns the metrics measured over gRPC: accuracy, or MAE and RMSE for regression."""
    run = train(cfg)
    version_dir = export(cfg)
    if cfg.model.kind == "causal_lm":
        return _language_model_demo(cfg, run, version_dir)
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


PROMPT = "The "  # the prompt samples.txt follows while it trains


def _language_model_demo(cfg: Config, run, version_dir) -> dict[str, float]:
    """A greedy completion of PROMPT over gRPC Predict (signature generate, a stock tensorflow-serving-api request)
    and in-process (the trained weights under the export's serving policy): they must be equal."""
    facts = saved_model.read_pipeline_json(version_dir)
    tokens = facts["language_model"]["sample"]["max_new_tokens"]
    log_path = cfg.run_dir / SERVER_LOG
    with running_server(serving_flags(cfg, port=0), log_path) as server:
        log.info("model server serving at %s (pid %d, log %s)", server.address, server.process.pid, log_path)
        request = grpc_client.predict_request(cfg.export.model_name, {
            "prompts": np.array([PROMPT.encode()], object), "max_new_tokens": np.array(tokens, np.int32),
            "temperature": np.array(0.0, np.float32), "top_k": np.array(0, np.int32), "seed": np.array(0, np.int64)},
            lm.GENERATE_SIGNATURE)
        with grpc.insecure_channel(server.address, options=grpc_client.CHANNEL_OPTIONS) as channel:
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=120)
        served = tensors.to_ndarray(response.outputs["completions"], "completions")[0]
    policy = facts["serving_policy"]["name"]
    model = run.model if policy == run.policy.name else lm.rebuild(run.model, cfg, run.datasets, policy)
    generator = generate.Generator(model, tokenizer=run.datasets.tokenizer)
    in_process = lm_parity.greedy(generator.generate, [PROMPT.encode()], tokens)["completions"][0]
    nats = run.metrics.get("val_nats_per_byte")
    show = lambda completion: repr(PROMPT + completion.decode("utf-8", errors="replace"))  # noqa: E731
    print(f"\ndemo: {cfg.experiment} trained under {run.policy.name}, served under {policy} from {version_dir} "
          f"(server log: {log_path})\n  in-process: {show(in_process)}\n  over gRPC:  {show(served)}\n  "
          f"{'equal' if served == in_process else 'DIFFERENT'} ({tokens} greedy tokens)")
    if served != in_process:
        raise ParityError(f"the served greedy completion differs from the in-process one: {served!r} vs {in_process!r}")
    return {"greedy_tokens": float(tokens), **({"val_nats_per_byte": nats} if nats is not None else {})}
