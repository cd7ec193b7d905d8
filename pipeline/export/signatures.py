"""The export's SavedModel contract: its signatures, their dtype rules, and TF Serving's warmup file.

serving_default (Predict) takes and returns float32 only; classification (Classify) or regression
(Regress) parse serialized tf.Examples as TF Serving's contracts require; a model trained on an image folder
also takes the images' encoded bytes (predict_images, classify_images), decoded in the graph by the training
pipeline's own decode. signature_problems() is the one dtype rule, applied by export before publishing and by
`pipeline verify` afterwards.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pipeline import data
from pipeline.data import encoded_images
from pipeline.errors import ExportError
from serving.client import grpc_client
from serving.generation.decoder import CACHE_PREFIX, DECODE_PROTOCOL
from serving.servable.saved_model import DEFAULT_SIGNATURE, REDUCED_DTYPES

SIGNATURE = DEFAULT_SIGNATURE
CLASSIFY_SIGNATURE = "classification"
REGRESS_SIGNATURE = "regression"
STRING_SIGNATURES = (CLASSIFY_SIGNATURE, REGRESS_SIGNATURE)  # TF Serving's Classify/Regress contracts take tf.Examples
# Image-folder models (docs/serving.md, "Sending images"): the `_bytes` suffix makes TF Serving's REST API
# answer such tensors as {"b64": ...}; image/encoded is the tf.Example feature name of Model Garden's image data.
IMAGES_SIGNATURE = "predict_images"
IMAGES_INPUT = "image_bytes"
CLASSIFY_IMAGES_SIGNATURE = "classify_images"
IMAGE_FEATURE = "image/encoded"


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What predict_images and classify_images decode: each image's declared sides and pixels, from its header."""

    min_side: int
    max_pixels: int

    @classmethod
    def of(cls, min_image_side: int, max_image_pixels: int, image_shape: tuple[int, ...]) -> "ImageLimits":
        """export.min_image_side, at most the model's own shorter side; export.max_image_pixels."""
        return cls(min(min_image_side, *image_shape[:2]), max_image_pixels)


def signature_dtypes(signature_def: Any) -> dict[str, dict[str, str]]:
    """{"inputs": {name: dtype}, "outputs": {name: dtype}} of a SignatureDef."""
    return {kind: {key: tf.as_dtype(info.dtype).name for key, info in getattr(signature_def, kind).items()}
            for kind in ("inputs", "outputs")}


def signature_problems(name: str, signature_def: Any, token_ids: bool = False) -> list[str]:
    """What breaks the float32-boundary rule in one signature, e.g. ["output 'probabilities' is float16"].

    serving_default: float32 in and out (serving clients get float32); a language model's (token_ids) takes
    int32 token ids, which have no float32 form, and returns float32. Other signatures may carry DT_STRING
    (Classify/Regress parse tf.Examples and return label strings by design) and, outside those two, integer
    and bool tensors; no signature may return float16 or bfloat16, except a language model's key/value cache in
    its decode protocol (prefill, decode_step: the cache_* tensors, one dtype, the compute dtype: state a server
    hands back unchanged, half of float32's bytes under a mixed policy; docs/export.md#language-models).
    """
    tensors = signature_dtypes(signature_def)
    if token_ids and name in DECODE_PROTOCOL:
        caches = {dtype for items in tensors.values() for key, dtype in items.items() if key.startswith(CACHE_PREFIX)}
        problems = ([f"the cache_* tensors are {' and '.join(sorted(caches))}: one of float32, float16, bfloat16"]
                    if len(caches) > 1 or not caches <= {"float32", *REDUCED_DTYPES} else [])
        tensors = {kind: {key: dtype for key, dtype in items.items() if not key.startswith(CACHE_PREFIX)}
                   for kind, items in tensors.items()}
        return problems + [f"{kind[:-1]} '{key}' is {dtype}" for kind, items in tensors.items()
                           for key, dtype in items.items() if dtype not in ("float32", "string", "int32", "int64", "bool")]
    if name == SIGNATURE and token_ids:
        return [f"{kind[:-1]} '{key}' is {dtype}" for kind, items in tensors.items() for key, dtype in items.items()
                if dtype != ("int32" if kind == "inputs" else "float32")]
    if name == SIGNATURE:
        allowed: tuple[str, ...] = ("float32",)
    elif name in STRING_SIGNATURES:
        allowed = ("float32", "string")
    else:
        allowed = ("float32", "string", "int64", "int32", "bool")
    return [f"{kind[:-1]} '{key}' is {dtype}" for kind, items in tensors.items() for key, dtype in items.items()
            if dtype not in allowed or (kind == "outputs" and dtype in REDUCED_DTYPES)]


def allowed_dtypes_text(name: str, token_ids: bool = False) -> str:
    """Why signature_problems() refused something, for a report line."""
    if name == SIGNATURE and token_ids:
        return "a language model's takes int32 token ids and returns float32 logits"
    if name == SIGNATURE:
        return "serving clients get float32 in and out"
    return "allowed here: " + ("float32, string" if name in STRING_SIGNATURES else "float32, string, int64, int32, bool")


def tensor_specs(signature_def: Any) -> dict:
    """{"inputs": {name: {"dtype", "shape"}}, "outputs": ...} for pipeline.json; unknown dims are None."""
    def spec(info) -> dict:
        shape = None if info.tensor_shape.unknown_rank else [d.size if d.size >= 0 else None
                                                              for d in info.tensor_shape.dim]
        return {"dtype": tf.as_dtype(info.dtype).name, "shape": shape}

    return {kind: {key: spec(info) for key, info in getattr(signature_def, kind).items()}
            for kind in ("inputs", "outputs")}


def write_saved_model(served: keras.Model, spec: data.DataSpec, path: Path, image_limits: ImageLimits | None = None
                      ) -> None:
    """Two signatures over the same weights (four for an image-folder model), so every TF Serving RPC works on
    the export:

    serving_default (Predict): float32 features [batch, ...] → {probabilities, logits} float32
    (regression: {predictions} float32 [batch, 1]).
    classification (Classify, classifiers only): serialized tf.Example `inputs` [batch] → classes
    (label strings) and scores (float32), the contract TF Serving's classifier checks.
    regression (Regress, regressors only): serialized tf.Example `inputs` [batch] → outputs float32
    [batch], the contract TF Serving's regressor checks.
    predict_images (Predict, spec.encoded_images): JPEG/PNG bytes `image_bytes` [batch] → serving_default's
    outputs, each image checked against image_limits from its header, then decoded by images.decode_image.
    classify_images (Classify, image-folder classifiers): tf.Examples holding `image/encoded` → classes, scores.

    No archive.track(): tracking writes every weight twice (docs/keras3-mixed-precision.md §5).
    """
    archive = keras.export.ExportArchive()
    archive.add_endpoint(
        SIGNATURE,
        lambda features: served(features, training=False),
        input_signature=[tf.TensorSpec([None, *spec.input_shape], tf.float32, name=spec.input_name)],
    )
    feature_spec = {spec.input_name: tf.io.FixedLenFeature(spec.input_shape, tf.float32)}
    label_names = tf.constant(spec.label_names)

    def classify(inputs):
        features = tf.io.parse_example(inputs, feature_spec)[spec.input_name]
        scores = served(features, training=False)["probabilities"]
        return {"classes": tf.tile(label_names[tf.newaxis], [tf.shape(scores)[0], 1]), "scores": scores}

    def regress(inputs):
        features = tf.io.parse_example(inputs, feature_spec)[spec.input_name]
        return {"outputs": tf.reshape(served(features, training=False)["predictions"], [-1])}

    examples = [tf.TensorSpec([None], tf.string, name="inputs")]
    if spec.task == "regression":
        archive.add_endpoint(REGRESS_SIGNATURE, regress, input_signature=examples)
        method_names = {REGRESS_SIGNATURE: tf.saved_model.REGRESS_METHOD_NAME}
    else:
        archive.add_endpoint(CLASSIFY_SIGNATURE, classify, input_signature=examples)
        method_names = {CLASSIFY_SIGNATURE: tf.saved_model.CLASSIFY_METHOD_NAME}
    if spec.encoded_images:
        if image_limits is None:
            raise ValueError("an image-folder model's export needs image_limits (ImageLimits.of(...))")
        method_names.update(_add_image_endpoints(archive, served, spec, image_limits))
    archive.write_out(str(path), verbose=False)
    _set_method_names(path, method_names)


def _add_image_endpoints(archive: keras.export.ExportArchive, served: keras.Model, spec: data.DataSpec,
                         limits: ImageLimits) -> dict[str, str]:
    """predict_images and (classifiers) classify_images; returns the method names to set."""
    def decoded(images: tf.Tensor, name: str) -> tf.Tensor:
        return encoded_images.decode_checked(images, spec.image_shape, limits.min_side, limits.max_pixels, name)

    archive.add_endpoint(IMAGES_SIGNATURE, lambda image_bytes: served(decoded(image_bytes, IMAGES_INPUT), training=False),
                         input_signature=[tf.TensorSpec([None], tf.string, name=IMAGES_INPUT)])
    if spec.task == "regression":
        return {}
    label_names = tf.constant(spec.label_names)
    feature_spec = {IMAGE_FEATURE: tf.io.FixedLenFeature([], tf.string)}

    def classify_images(inputs):
        images = tf.io.parse_example(inputs, feature_spec)[IMAGE_FEATURE]
        scores = served(decoded(images, f"inputs' {IMAGE_FEATURE}"), training=False)["probabilities"]
        return {"classes": tf.tile(label_names[tf.newaxis], [tf.shape(scores)[0], 1]), "scores": scores}

    archive.add_endpoint(CLASSIFY_IMAGES_SIGNATURE, classify_images,
                         input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    return {CLASSIFY_IMAGES_SIGNATURE: tf.saved_model.CLASSIFY_METHOD_NAME}


def images_spec(spec: data.DataSpec, limits: ImageLimits, outputs: dict) -> dict:
    """pipeline.json's entry for predict_images: what its one input holds and what it decodes to."""
    return {"inputs": {IMAGES_INPUT: {"dtype": "string", "shape": [None], **_image_content(spec, limits)}},
            "outputs": outputs, "method_name": "tensorflow/serving/predict"}


def classify_images_spec(spec: data.DataSpec, limits: ImageLimits) -> dict:
    """pipeline.json's entry for classify_images."""
    entry = classification_spec(spec)
    entry["inputs"]["inputs"] = {"dtype": "string", "shape": [None], "example_feature": IMAGE_FEATURE,
                                 **_image_content(spec, limits)}
    return entry


def _image_content(spec: data.DataSpec, limits: ImageLimits) -> dict:
    return {"content": f"encoded {encoded_images.SERVED_ENCODINGS} images, one per row",
            "decoded_to": list(spec.image_shape), "min_image_side": limits.min_side,
            "max_image_pixels": limits.max_pixels}


def _set_method_names(path: Path, method_names: dict[str, str]) -> None:
    """TF2's saver writes every signature as tensorflow/serving/predict; TF Serving's
    --enable_signature_method_name_check wants classify/regress names, so set them in saved_model.pb
    (docs/keras3-mixed-precision.md §5, route B) and rewrite the fingerprint that covers the file."""
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((path / "saved_model.pb").read_bytes())
    for meta_graph in saved_model.meta_graphs:
        for name, method_name in method_names.items():
            meta_graph.signature_def[name].method_name = method_name
    (path / "saved_model.pb").write_bytes(saved_model.SerializeToString())
    (path / "fingerprint.pb").write_bytes(fingerprinting.CreateFingerprintDef(str(path)))


def classification_spec(spec: data.DataSpec) -> dict:
    return {"inputs": {"inputs": {"dtype": "string", "shape": [None], "example_feature": spec.input_name,
                                  "example_feature_shape": list(spec.input_shape)}},
            "outputs": {"classes": {"dtype": "string", "shape": [None, spec.num_classes]},
                        "scores": {"dtype": "float32", "shape": [None, spec.num_classes]}},
            "method_name": "tensorflow/serving/classify"}


def check_classification(signature, spec: data.DataSpec, x: np.ndarray, expected: dict) -> None:
    """The classification signature scores exactly what serving_default returns as probabilities."""
    serialized = tf.constant([e.SerializeToString() for e in grpc_client.float_examples(x, spec.input_name)])
    result = signature(inputs=serialized)
    scores, classes = result["scores"].numpy(), result["classes"].numpy()
    if scores.dtype != np.float32 or not np.array_equal(scores, expected["probabilities"]):
        raise ExportError("classification signature: scores differ from serving_default's probabilities")
    if classes[0].tolist() != [name.encode() for name in spec.label_names]:
        raise ExportError(f"classification signature: classes {classes[0].tolist()} are not the label names")


def check_classify_images(signature, spec: data.DataSpec, files: tuple[bytes, ...], expected: dict) -> None:
    """classify_images scores the image files exactly as serving_default scores their training decode."""
    from tensorflow.core.example import example_pb2, feature_pb2

    examples = [example_pb2.Example(features=feature_pb2.Features(feature={
        IMAGE_FEATURE: feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[contents]))})).SerializeToString()
        for contents in files]
    scores = signature(inputs=tf.constant(examples))["scores"].numpy()
    if scores.dtype != np.float32 or not np.array_equal(scores, expected["probabilities"]):
        raise ExportError("classify_images signature: scores differ from serving_default's probabilities on the "
                          "same images decoded by the training pipeline")


def regression_spec(spec: data.DataSpec) -> dict:
    return {"inputs": {"inputs": {"dtype": "string", "shape": [None], "example_feature": spec.input_name,
                                  "example_feature_shape": list(spec.input_shape)}},
            "outputs": {"outputs": {"dtype": "float32", "shape": [None]}},
            "method_name": "tensorflow/serving/regress"}


def check_regression(signature, spec: data.DataSpec, x: np.ndarray, expected: dict) -> None:
    """The regression signature returns exactly serving_default's predictions, one float32 per example."""
    serialized = tf.constant([e.SerializeToString() for e in grpc_client.float_examples(x, spec.input_name)])
    outputs = signature(inputs=serialized)["outputs"].numpy()
    if outputs.dtype != np.float32 or not np.array_equal(outputs, expected["predictions"].reshape(-1)):
        raise ExportError("regression signature: outputs differ from serving_default's predictions")


def write_warmup_requests(path: Path, model_name: str, batch_size: int, spec: data.DataSpec, rows: np.ndarray,
                          files: tuple[bytes, ...] = ()) -> None:
    """TF Serving's warmup file: PredictionLog records (a TFRecord) built from real held-out rows,
    one Predict at batch size 1 and one at the client batch size, and one Classify (or Regress); and for an
    image-folder model one predict_images call with a held-out image file."""
    from tensorflow_serving.apis import prediction_log_pb2

    logs = []
    for size in sorted({1, min(batch_size, len(rows))}):
        request = grpc_client.predict_request(model_name, {spec.input_name: rows[:size]}, SIGNATURE)
        logs.append(prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request)))
    examples = grpc_client.float_examples(rows[:1], spec.input_name)
    if spec.task == "regression":
        regress = grpc_client.regress_request(model_name, examples, REGRESS_SIGNATURE)
        logs.append(prediction_log_pb2.PredictionLog(regress_log=prediction_log_pb2.RegressLog(request=regress)))
    else:
        classify = grpc_client.classify_request(model_name, examples, CLASSIFY_SIGNATURE)
        logs.append(prediction_log_pb2.PredictionLog(classify_log=prediction_log_pb2.ClassifyLog(request=classify)))
    if files:
        images = grpc_client.predict_request(model_name, {IMAGES_INPUT: np.array(files[:1], dtype=object)},
                                             IMAGES_SIGNATURE)
        logs.append(prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=images)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for log_record in logs:
            writer.write(log_record.SerializeToString())
