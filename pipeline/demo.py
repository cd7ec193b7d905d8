"""`make demo`: the whole path once — train, export, start `python -m serving`, predict over gRPC, stop. A language
model (model.kind causal_lm) is asked for a greedy completion instead, over gRPC and streamed through OpenAI's
completions API, printed beside the in-process one."""

from __future__ import annotations

import http.client
import json
import logging

import grpc
import numpy as np
from tensorflow_serving.apis import prediction_service_pb2_grpc

from pipeline.lm import generate
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




def show_text(completion: bytes) -> str:
    """A completion's bytes as the completions API returns them (invalid UTF-8 replaced)."""
    return completion.decode("utf-8", errors="replace")


def _stream(address: str, model_name: str, prompt: str, tokens: int) -> str:
    """The greedy completion of prompt streamed as Server-Sent Events, each piece printed as it arrives."""
    connection = http.client.HTTPConnection(address, timeout=120)
    connection.request("POST", "/openai/v1/completions", json.dumps({
        "model": model_name, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}))
    response = connection.getresponse()
    if response.status != 200:
        raise ParityError(f"the completions API answered {response.status}: {response.read()[:300]!r}")
    text = ""
    while (line := response.readline()) and not line.startswith(b"data: [DONE]"):
        if line.startswith(b"data: "):
            piece = json.loads(line[6:])["choices"][0]["text"]
            print(piece, end="", flush=True)
            text += piece
    connection.close()
    return text


def _language_model_demo(cfg: Config, run, version_dir) -> dict[str, float]:
    """A greedy completion of the export's sample prompt (pipeline.json's language_model.sample) over gRPC Predict (signature generate, a stock tensorflow-serving-api request),
    streamed token by token through OpenAI's completions API (Server-Sent Events, printed as they come) and
    in-process (the trained weights under the export's serving policy): all three must be equal."""
    facts = saved_model.read_pipeline_json(version_dir)
    tokens, prompt = facts["language_model"]["sample"]["max_new_tokens"], facts["language_model"]["sample"]["prompt"]
    log_path = cfg.run_dir / SERVER_LOG
    with running_server([*serving_flags(cfg, port=0), "--rest_api_port=-1"], log_path, rest=True) as server:
        log.info("model server serving at %s (pid %d, log %s)", server.address, server.process.pid, log_path)
        request = grpc_client.predict_request(cfg.export.model_name, {
            "prompts": np.array([prompt.encode()], object), "max_new_tokens": np.array(tokens, np.int32),
            "temperature": np.array(0.0, np.float32), "top_k": np.array(0, np.int32), "seed": np.array(0, np.int64)},
            lm.GENERATE_SIGNATURE)
        with grpc.insecure_channel(server.address, options=grpc_client.CHANNEL_OPTIONS) as channel:
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=120)
        served = tensors.to_ndarray(response.outputs["completions"], "completions")[0]
        print(f"\ndemo: streamed from {server.rest_address}/openai/v1/completions: {prompt}", end="", flush=True)
        streamed = _stream(server.rest_address, cfg.export.model_name, prompt, tokens)
        print()
    policy = facts["serving_policy"]["name"]
    model = run.model if policy == run.policy.name else lm.rebuild(run.model, cfg, run.datasets, policy)
    generator = generate.Generator(model, tokenizer=run.datasets.tokenizer)
    in_process = lm_parity.greedy(generator.generate, [prompt.encode()], tokens)["completions"][0]
    nats = run.metrics.get("val_nats_per_byte")
    show = lambda completion: repr(prompt + completion.decode("utf-8", errors="replace"))  # noqa: E731
    print(f"\ndemo: {cfg.experiment} trained under {run.policy.name}, served under {policy} from {version_dir} "
          f"(server log: {log_path})\n  in-process: {show(in_process)}\n  over gRPC:  {show(served)}\n  "
          f"streamed:   {prompt + streamed!r}\n  "
          f"{'equal' if served == in_process and streamed == show_text(in_process) else 'DIFFERENT'} "
          f"({tokens} greedy tokens)")
    if served != in_process:
        raise ParityError(f"the served greedy completion differs from the in-process one: {served!r} vs {in_process!r}")
    if streamed != show_text(in_process):
        raise ParityError(f"the streamed greedy completion differs from the in-process one: {streamed!r} vs "
                          f"{show_text(in_process)!r}")
    return {"greedy_tokens": float(tokens), **({"val_nats_per_byte": nats} if nats is not None else {})}
