"""The sizes each figure runs at (full and --quick) and the pipeline configs the bench trains.

--quick keeps every loop but shrinks models, data and durations to seconds per figure, so it writes
the same JSON schema and the test suite can run it; its numbers mean nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Sizes:
    # Figure 1: pipeline train vs bare model.fit.
    train_rows: int
    train_features: int
    train_hidden: tuple[int, ...]
    train_batch: int
    train_epochs: int  # the first is warm-up; the rest are the steady state
    train_repeats: int
    # Figure 2: precision policies (one subprocess each).
    mlp_hidden: tuple[int, ...]
    cnn_filters: tuple[int, ...]
    cnn_hidden: tuple[int, ...]
    transformer_sizes: tuple[int, ...]  # (num_layers, width, num_heads, mlp_units, sequence_length), on the pointer task
    precision_batch: int
    precision_steps: int  # steps per timed epoch
    precision_epochs: int  # the first is warm-up
    predict_batch: int
    predict_budget_s: float
    # Figure 3: runner vs the bare signature.
    inference_batches: tuple[int, ...]
    inference_repeats: int
    inference_budget_s: float  # per side, per repeat, per batch size
    # Figure 4: serving.
    grpc_clients: tuple[int, ...]
    rest_clients: tuple[int, ...]
    load_seconds: float
    warmup_seconds: float
    limit_batch: int
    # Figure 6: server processes sharing one port.
    scaling_processes: tuple[int, ...]
    # Figure 7: pipeline score on the local engine vs a plain Runner loop.
    batch_rows: int
    batch_shards: int
    batch_repeats: int
    # Optional figure "peers" (bench/peers.py): the same load against MLflow, BentoML and ours.
    peer_clients: tuple[int, ...]
    # The exported model figures 3 and 5 load and serve (bench/exported_model.py).
    served_hidden: tuple[int, ...]
    served_epochs: int
    # The guide's MLP that figure 4 and the peers serve (784 features, under mixed_float16).
    guide_hidden: tuple[int, ...]
    # Figure "serving_precision": the guide's MLP trained once on digits at 28x28, served under four policies.
    serving_precision_epochs: int
    serving_precision_rounds: int  # interleaved rounds of the in-process measurements
    serving_precision_qps_rounds: int  # ... and of the gRPC load (figure 4's window each)
    serving_precision_budget_s: float  # per in-process measurement (one policy, one batch size, one round)
    # Figure "input_pipeline": MNIST-shaped rows streamed from TFRecord shards vs held in memory.
    input_rows: int  # the 1x training rows (the 10x run reads the same shards copied input_scale times)
    input_scale: int
    input_cnn_rows: int  # the CNN's training rows (a subset: the CNN trains ~10x slower per row)
    input_epochs: int  # the first is warm-up
    input_batch: int
    input_hidden: tuple[int, ...]
    # Figure "image_requests": a small CNN on 224x224 JPEG files, served JPEG bytes vs float32 pixels, and attacked.
    image_files_per_class: int  # training files per photograph (two classes)
    image_filters: tuple[int, ...]
    image_hidden: tuple[int, ...]
    image_window_seconds: float  # each load window (after figure 4's warm-up); longer on a slow CPU
    image_rounds: int  # alternating rounds of the two signatures
    image_attack_rounds: int  # attacks, each between two clean windows
    image_random_bodies: int  # random-byte hostile bodies (every hostile body is sent once per attack)
    # Figure "generation": the byte-level language model, cached generate vs recompute per token.
    generation_model: tuple[int, ...]  # (num_layers, num_heads, width, mlp_width, context_length)
    generation_new_tokens: int
    generation_rounds: int  # alternating rounds of the two sides
    # Figure "streaming": figure 11's model served; tokens per stream of the 8 concurrent ones.
    streaming_tokens: int
    # Figure 13 "large_model": overrides of configs/lm_85m.yaml (epochs of equal length: steps_per_epoch divides max_steps).
    large_model: tuple[str, ...]
    # Figure 14 "pretrained": a shape of bench/gpt2_weights.py, overrides of its fine-tuning run, the tokenizer's text
    pretrained_shape: str
    pretrained_train: tuple[str, ...]
    pretrained_text_bytes: int
    pretrained_rounds: int


FULL = Sizes(
    train_rows=12_000, train_features=784, train_hidden=(256, 256), train_batch=128, train_epochs=4,
    train_repeats=3,
    mlp_hidden=(4096, 4096), cnn_filters=(32, 64), cnn_hidden=(128,), transformer_sizes=(4, 256, 8, 1024, 64),
    precision_batch=128, precision_steps=6,
    precision_epochs=4, predict_batch=256, predict_budget_s=2.0,
    inference_batches=(1, 8, 64, 512), inference_repeats=9, inference_budget_s=0.3,
    grpc_clients=(1, 8, 32, 64), rest_clients=(1, 32), load_seconds=4.0, warmup_seconds=1.0, limit_batch=64,
    scaling_processes=(1, 2, 4, 8), batch_rows=100_000, batch_shards=10, batch_repeats=9,
    peer_clients=(1, 8, 32),
    served_hidden=(256, 256), served_epochs=2, guide_hidden=(1024, 1024),
    serving_precision_epochs=10, serving_precision_rounds=9, serving_precision_qps_rounds=5,
    serving_precision_budget_s=0.3,
    input_rows=60_000, input_scale=10, input_cnn_rows=12_000, input_epochs=3, input_batch=128, input_hidden=(256, 256),
    image_files_per_class=24, image_filters=(8, 16, 32), image_hidden=(32,), image_window_seconds=4.0,
    image_rounds=3, image_attack_rounds=1, image_random_bodies=10_000,
    generation_model=(4, 4, 128, 512, 512), generation_new_tokens=256, generation_rounds=3,
    streaming_tokens=128,
    large_model=("train.max_steps=6", "train.steps_per_epoch=3", "train.validation_steps=2", "train.warmup_steps=1"),
    pretrained_shape="12x768",
    pretrained_train=("data.sequence_length=128", "train.batch_size=4", "train.max_steps=16", "train.steps_per_epoch=4",
                      "train.validation_steps=4"),
    pretrained_text_bytes=2_000_000, pretrained_rounds=3,
)

QUICK = Sizes(
    train_rows=400, train_features=16, train_hidden=(16,), train_batch=64, train_epochs=2, train_repeats=1,
    mlp_hidden=(32, 32), cnn_filters=(4,), cnn_hidden=(8,), transformer_sizes=(1, 16, 2, 32, 8),
    precision_batch=16, precision_steps=2,
    precision_epochs=2, predict_batch=16, predict_budget_s=0.1,
    inference_batches=(1, 8, 64, 512), inference_repeats=1, inference_budget_s=0.02,
    grpc_clients=(1, 8), rest_clients=(1,), load_seconds=0.25, warmup_seconds=0.1, limit_batch=64,
    scaling_processes=(1, 2), batch_rows=2_000, batch_shards=4, batch_repeats=1,
    peer_clients=(1,),
    served_hidden=(16,), served_epochs=1, guide_hidden=(16,),
    serving_precision_epochs=1, serving_precision_rounds=1, serving_precision_qps_rounds=1,
    serving_precision_budget_s=0.02,
    input_rows=300, input_scale=2, input_cnn_rows=100, input_epochs=2, input_batch=32, input_hidden=(16,),
    image_files_per_class=6, image_filters=(4,), image_hidden=(8,), image_window_seconds=0.25,
    image_rounds=1, image_attack_rounds=1, image_random_bodies=30,
    generation_model=(1, 2, 16, 32, 64), generation_new_tokens=16, generation_rounds=1,
    streaming_tokens=8,
    large_model=("model.num_layers=1", "model.width=32", "model.num_heads=2", "model.mlp_units=64",
                 "data.sequence_length=64", "train.batch_size=4", "train.max_steps=2", "train.steps_per_epoch=1",
                 "train.validation_steps=1", "train.warmup_steps=1"),
    pretrained_shape="2x32",
    pretrained_train=("data.sequence_length=32", "train.batch_size=4", "train.max_steps=4", "train.steps_per_epoch=2",
                      "train.validation_steps=1"),
    pretrained_text_bytes=20_000, pretrained_rounds=1,
)


def _flow(values: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def training_overrides(sizes: Sizes, work_dir: Path) -> list[str]:
    """Figure 1's experiment: an MNIST-sized synthetic classification task under policy auto."""
    return [
        "experiment=bench_training", "precision.policy=auto",
        "data.source=synthetic", f"data.num_examples={sizes.train_rows}",
        f"data.feature_shape=[{sizes.train_features}]", "data.num_classes=10",
        f"model.hidden_units={_flow(sizes.train_hidden)}",
        f"train.batch_size={sizes.train_batch}", f"train.epochs={sizes.train_epochs}",
        f"train.runs_dir={work_dir / 'runs'}", f"export.base_path={work_dir / 'models'}",
    ]


def precision_overrides(sizes: Sizes, model: str, policy: str) -> list[str]:
    """Figure 2's three models: the guide's MLP (784 features) and the CIFAR-style CNN on synthetic rows, and a
    transformer on the pointer task's token ids (pipeline/data/sequences.py)."""
    rows = sizes.precision_batch * sizes.precision_steps
    common = [f"experiment=bench_{model}", f"precision.policy={policy}", "data.source=synthetic",
              f"data.num_examples={max(rows * 5 // 4 + 1, 10)}", "data.num_classes=10", "data.validation_split=0.2",
              f"train.batch_size={sizes.precision_batch}"]
    if model == "transformer":
        layers, width, heads, mlp_units, length = sizes.transformer_sizes
        return [option for option in common if not option.startswith("data.num_classes")] + [
            "data.source=pointer", f"data.sequence_length={length}", "model.kind=transformer", "train.optimizer=adam",
            f"model.num_layers={layers}", f"model.width={width}", f"model.num_heads={heads}",
            f"model.mlp_units={mlp_units}"]
    if model == "mlp":
        return common + ["data.feature_shape=[784]", "model.kind=mlp", f"model.hidden_units={_flow(sizes.mlp_hidden)}"]
    return common + ["data.feature_shape=[32, 32, 3]", "model.kind=cnn", f"model.filters={_flow(sizes.cnn_filters)}",
                     f"model.hidden_units={_flow(sizes.cnn_hidden)}"]


def exported_model_overrides(sizes: Sizes, work_dir: Path) -> list[str]:
    """The model of figures 3 to 5: the default digits MLP under policy auto, exported by the pipeline."""
    return [
        "experiment=bench_served", "precision.policy=auto",
        f"model.hidden_units={_flow(sizes.served_hidden)}", f"train.epochs={sizes.served_epochs}",
        f"train.runs_dir={work_dir / 'runs'}", f"export.base_path={work_dir / 'models'}",
    ]


def serving_model_overrides(sizes: Sizes, work_dir: Path) -> list[str]:
    """Figure 4's model: the mixed-precision guide's MLP (784 -> 1024 -> 1024 -> 10, float32 softmax head)
    under mixed_float16 on synthetic rows, one epoch (its speed, not its accuracy, is measured)."""
    return [
        "experiment=bench_guide_mlp", "precision.policy=mixed_float16", "data.source=synthetic",
        "data.num_examples=2000", "data.feature_shape=[784]", "data.num_classes=10",
        f"model.hidden_units={_flow(sizes.guide_hidden)}", "train.epochs=1",
        f"train.runs_dir={work_dir / 'runs'}", f"export.base_path={work_dir / 'models'}",
    ]



def serving_precision_overrides(sizes: Sizes, work_dir: Path, data_path: Path) -> list[str]:
    """The serving-precision figure's model: the guide's MLP (784 -> 1024 -> 1024 -> 10, float32 softmax head) under
    mixed_float16 (the project's default policy), on scikit-learn's digits enlarged to MNIST's 28x28 (data_path,
    written by the figure), so that its validation accuracy is a real one."""
    return [
        "experiment=bench_serving_precision", "precision.policy=mixed_float16", "data.source=npz",
        f"data.path={data_path}", f"model.hidden_units={_flow(sizes.guide_hidden)}",
        f"train.epochs={sizes.serving_precision_epochs}", f"train.runs_dir={work_dir / 'runs'}",
        f"export.base_path={work_dir / 'models'}",
    ]


def image_model_overrides(sizes: Sizes, work_dir: Path, folder: Path) -> list[str]:
    """The image-requests figure's model: a small CNN on an image folder of 224x224 JPEG files (data.source images,
    so its export has predict_images) under policy auto, one epoch (its serving, not its accuracy, is measured)."""
    return [
        "experiment=bench_images", "precision.policy=auto", "data.source=images", f"data.path={folder}",
        "data.image_shape=[224, 224, 3]", "model.kind=cnn", f"model.filters={_flow(sizes.image_filters)}",
        f"model.hidden_units={_flow(sizes.image_hidden)}", "train.epochs=1", "train.batch_size=8",
        f"train.runs_dir={work_dir / 'runs'}", f"export.base_path={work_dir / 'models'}",
    ]
