"""What the language-model tests share: the tiny model's settings, the text it trains on, and a gRPC generate call.

tests/conftest.py puts tests/helpers/ on sys.path, so test files `from lm_helpers import ...`.
The trained and exported model itself is the session fixture `tiny_lm_export` (tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SENTENCES = ["The cat sat on the mat. ", "A dog ran to the park and back. ", "The sun is warm in the morning. ",
             "Birds sing when the rain stops. "]
# The tiny causal_lm: 1 block, width 16, context 32, over bytes, under mixed_float16; each test adds its training.
TINY_LM_MODEL = ["data.source=text", "model.kind=causal_lm", "data.sequence_length=32", "data.validation_split=0.25",
                 "model.num_layers=1", "model.width=16", "model.num_heads=2", "model.mlp_units=32",
                 "precision.policy=mixed_float16"]
# One short epoch: what the shared export (and the tests that export their own variants of it) train.
TINY_LM_TRAIN = ["train.epochs=1", "train.batch_size=16", "train.optimizer=adam", "train.learning_rate=0.01"]
TINY_LM = ["experiment=tiny_lm", *TINY_LM_MODEL, *TINY_LM_TRAIN]


def write_texts(folder: Path) -> Path:
    """Four files of repeated sentences, 1.5-2 KB each (doc0.txt ... doc3.txt): a split by document gives three for
    training and one for validation, about 12 batches of 16 windows an epoch. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        rng = np.random.default_rng(i)
        (folder / f"doc{i}.txt").write_text("".join(rng.choice(SENTENCES, 60)))
    return folder


def grpc_generate(address: str, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                  model_name: str = "lm", timeout: float = 60) -> dict[str, np.ndarray]:
    """A stock tensorflow-serving-api Predict on the generate signature; its outputs as numpy arrays."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = model_name, "generate"
    for name, value in {"prompts": np.array([p.encode() for p in prompts], object),
                        "max_new_tokens": np.array(max_new_tokens, np.int32),
                        "temperature": np.array(temperature, np.float32), "top_k": np.array(0, np.int32),
                        "seed": np.array(seed, np.int64)}.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    with grpc.insecure_channel(address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=timeout)
    return {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}
