"""The one place that sets the Keras dtype policy and builds the (loss-scaled) optimizer.

Nothing else touches the global policy. `apply_policy` must run before any layer is built, because
Keras reads the global policy when a layer is constructed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Iterator, Mapping

import keras

from pipeline.accumulation import AccumulatingLossScaleOptimizer, UpdateSchedule
from pipeline.artifacts import METRICS_FILE
from pipeline.config import PolicyTolerance, PrecisionConfig, TrainConfig
from serving.servable.float16_cpu import unfuse_float16_on_cpu

log = logging.getLogger(__name__)

OPTIMIZERS = {"rmsprop": keras.optimizers.RMSprop, "adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    """What a run trained under: recorded in the run and in every export's pipeline.json."""

    name: str
    compute_dtype: str
    variable_dtype: str
    loss_scale: str  # "dynamic", "static", or "none"
    initial_scale: float | None = None
    dynamic_growth_steps: int | None = None
    requested: str | None = None  # "auto" when the policy was chosen from the hardware, else None
    reason: str | None = None  # why auto chose it, e.g. "CPU with native bfloat16 (avx512_bf16)"

    def to_dict(self) -> dict:
        info = dataclasses.asdict(self)
        if self.requested is None:  # an explicit policy records exactly what it always did
            del info["requested"], info["reason"]
        return info

    def describe(self) -> str:
        if self.loss_scale == "dynamic":
            scale = (f"dynamic loss scaling (initial {self.initial_scale:g}, "
                     f"doubles every {self.dynamic_growth_steps} finite steps)")
        elif self.loss_scale == "static":
            scale = f"static loss scale {self.initial_scale:g}"
        else:
            scale = "no loss scaling"
        chosen = f" (auto: {self.reason})" if self.requested == "auto" else ""
        return f"policy {self.name}{chosen}: compute {self.compute_dtype}, variables {self.variable_dtype}, {scale}"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What precision.policy 'auto' decides on: the accelerators and the CPU's instruction-set flags."""

    gpus: tuple[tuple[str, tuple[int, int] | None], ...] = ()  # (name, compute capability); None if unknown
    tpu: bool = False
    cpu_flags: frozenset[str] = frozenset()


def detect_hardware() -> Hardware:
    """Queries the local devices (the one function tests replace to play other machines)."""
    import tensorflow as tf

    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        gpus.append((details.get("device_name", device.name), details.get("compute_capability")))
    tpu = bool(tf.config.list_physical_devices("TPU"))
    return Hardware(gpus=tuple(gpus), tpu=tpu, cpu_flags=_cpu_flags())


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: no flags, so auto falls back to float32 on the CPU
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def choose_policy(hardware: Hardware) -> tuple[str, str]:
    """(policy, reason) for precision.policy 'auto': float16 where Tensor Cores run it, bfloat16 where it is native,
    else float32. AVX512_FP16 alone does not make float16 pay on a CPU: measured on a Xeon that has it, float16
    math ran no faster than float32 (docs/precision.md#choosing-a-serving-precision)."""
    if hardware.gpus:
        name, capability = hardware.gpus[0]
        if capability is not None and tuple(capability) >= (7, 0):
            major, minor = capability
            return "mixed_float16", f"NVIDIA GPU {name} with compute capability {major}.{minor} (Tensor Cores)"
        shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return "float32", f"GPU {name} with compute capability {shown} (< 7.0: no float16 Tensor Cores)"
    if hardware.tpu:
        return "mixed_bfloat16", "TPU (bfloat16 is its native matmul type)"
    native = [flag for flag in BF16_CPU_FLAGS if flag in hardware.cpu_flags]
    if native:
        return "mixed_bfloat16", f"CPU with native bfloat16 ({', '.join(native)})"
    if "avx512_fp16" in hardware.cpu_flags:
        return "float32", (f"CPU without native bfloat16 (no {' or '.join(BF16_CPU_FLAGS)}); its avx512_fp16 does "
                           "not make float16 faster than float32 in TensorFlow")
    return "float32", f"CPU without native bfloat16 (no {' or '.join(BF16_CPU_FLAGS)}) and no GPU or TPU"


def choose_serving_policy(hardware: Hardware) -> tuple[str, str]:
    """(policy, reason) for export.serving_policy 'auto': the dtype choose_policy computes in, with the weights
    stored in it too (float16 for Tensor Cores, bfloat16 for a TPU or a CPU with AVX512_BF16/AMX), else float32.

    Serving trains nothing, so nothing needs float32 master weights: half-precision weights halve the
    variables and drop the per-call cast of every weight that a mixed policy does (bench: serving precision).
    """
    name, reason = choose_policy(hardware)
    return name.removeprefix("mixed_"), reason


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What the parity gate lets a path computing under `policy` cost against float32 (export.tolerances)."""

    policy: str
    max_rel_diff: float  # golden rows: largest |path - float32| / the output's largest float32 magnitude
    min_argmax_agreement: float  # golden rows: share of predicted classes kept (classifiers)
    max_metric_drop: float  # validation rows: accuracy points lost, or MAE gained in % of float32's (regressors)
    max_abs_diff: float | None = None  # golden rows: largest |path - float32| in the output's units; None: not judged

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The defaults per policy. float16 keeps 11 mantissa bits, bfloat16 8: on the digits MLP the trained model's
# probabilities moved by 0.0008 (float16) and 0.006 (bfloat16) against float32; the relative limits leave room
# for less confident models while still catching a broken layer (an overflow, a float16 softmax). Storing the
# weights in the reduced dtype rounds them once more (bfloat16: 2**-9 relative), so the same limits hold.
TOLERANCES = {
    "float32": {"max_rel_diff": 1e-5, "min_argmax_agreement": 1.0, "max_metric_drop": 0.0},
    "mixed_float16": {"max_rel_diff": 0.05, "min_argmax_agreement": 0.98, "max_metric_drop": 0.5},
    "float16": {"max_rel_diff": 0.05, "min_argmax_agreement": 0.98, "max_metric_drop": 0.5},
    "mixed_bfloat16": {"max_rel_diff": 0.15, "min_argmax_agreement": 0.98, "max_metric_drop": 0.5},
    "bfloat16": {"max_rel_diff": 0.15, "min_argmax_agreement": 0.98, "max_metric_drop": 0.5},
}


def tolerance(policy: str, configured: Mapping[str, PolicyTolerance] | None = None) -> Tolerance:
    """The tolerance of one policy: export.tolerances.<policy>'s values where set, else TOLERANCES'."""
    chosen = (configured or {}).get(policy)
    overrides = {key: value for key, value in chosen.model_dump().items() if value is not None} if chosen else {}
    return Tolerance(policy=policy, **{**TOLERANCES[policy], **overrides})


def apply_policy(config: PrecisionConfig, recorded: dict | None = None) -> PolicyInfo:
    """Sets the global Keras dtype policy and returns what it means, loss scaling included.

    With policy 'auto' the hardware decides (choose_policy), unless `recorded` (a PolicyInfo.to_dict()
    of the run) says what the run already chose: a model is exported and verified under the policy
    it was trained under, whatever machine does the exporting.
    """
    name, requested, reason = config.policy, None, None
    if config.policy == "auto":
        requested = "auto"
        if recorded and recorded.get("name"):
            name, reason = recorded["name"], recorded.get("reason") or "recorded by the training run"
        else:
            name, reason = choose_policy(detect_hardware())
            log.info("precision.policy auto: %s, because this machine has a %s", name, reason)
    keras.config.set_dtype_policy(name)
    policy = keras.config.dtype_policy()
    if policy.compute_dtype == "float16":
        unfuse_float16_on_cpu(f"policy {policy.name}")
    return PolicyInfo(
        name=policy.name,
        compute_dtype=policy.compute_dtype,
        variable_dtype=policy.variable_dtype,
        **_loss_scale(config, policy.name),
        requested=requested,
        reason=reason,
    )


def restore_trained_policy(config: PrecisionConfig, run_dir: Path, recorded: dict | None = None) -> PolicyInfo:
    """Sets the policy a run trained under, whatever this machine would choose: the one place export,
    verify and diagnose restore it.

    `recorded` is the run's PolicyInfo.to_dict() (pipeline.json keeps a copy); by default it is read from
    the run's metrics.json. Before the run has finished there is none, and the config decides.
    """
    if recorded is None:
        metrics = Path(run_dir) / METRICS_FILE
        recorded = json.loads(metrics.read_text()).get("policy") if metrics.is_file() else None
    return apply_policy(config, recorded=recorded)


def _loss_scale(config: PrecisionConfig, policy: str) -> dict:
    # Only float16 compute needs loss scaling: bfloat16 has float32's exponent range.
    if policy != "mixed_float16" or config.loss_scale == "none":
        return {"loss_scale": "none"}
    if config.loss_scale == "dynamic":
        return {"loss_scale": "dynamic", "initial_scale": config.initial_scale,
                "dynamic_growth_steps": config.dynamic_growth_steps}
    return {"loss_scale": "static", "initial_scale": float(config.loss_scale)}


def build_optimizer(train: TrainConfig, policy: PolicyInfo, steps_per_epoch: int | None = None
                    ) -> keras.optimizers.Optimizer:
    """The configured optimizer: its learning-rate schedule and global-norm clipping, gradient accumulation, and
    loss scaling as the policy needs it.

    Dynamic loss scaling wraps it in AccumulatingLossScaleOptimizer, which also accumulates batches (an update
    with an overflowing batch is skipped whole: pipeline/accumulation.py). Keras 3 has no static
    LossScaleOptimizer; a static scale is the inner optimizer's loss_scale_factor
    (docs/keras3-mixed-precision.md §2), and without dynamic scaling accumulation is the inner optimizer's. Either
    way the gradients are unscaled before they are added up, clipped (train.global_clipnorm) and applied, and
    `iterations` counts updates. Compile with auto_scale_loss=False so Keras never wraps a second time.

    steps_per_epoch (batches) is needed by a schedule (train.learning_rate_schedule cosine, train.warmup_steps):
    it decays over the run's updates.
    """
    accumulation = train.gradient_accumulation_steps
    dynamic = policy.loss_scale == "dynamic"
    kwargs = {"learning_rate": learning_rate(train, steps_per_epoch, inner_accumulation=not dynamic)}
    if train.global_clipnorm is not None:
        kwargs["global_clipnorm"] = train.global_clipnorm
    if policy.loss_scale == "static":
        kwargs["loss_scale_factor"] = policy.initial_scale
    if accumulation > 1 and not dynamic:
        kwargs["gradient_accumulation_steps"] = accumulation
    optimizer = OPTIMIZERS[train.optimizer](**kwargs)
    if dynamic:
        optimizer = AccumulatingLossScaleOptimizer(optimizer, initial_scale=policy.initial_scale,
                                                   dynamic_growth_steps=policy.dynamic_growth_steps,
                                                   accumulation_steps=accumulation)
    return optimizer


def total_updates(train: TrainConfig, steps_per_epoch: int) -> int:
    """The run's optimizer updates: every gradient_accumulation_steps batches, over all epochs (a last group that
    the batches do not fill is not applied)."""
    return train.epochs * steps_per_epoch // train.gradient_accumulation_steps


def learning_rate(train: TrainConfig, steps_per_epoch: int | None, inner_accumulation: bool = False):
    """train.learning_rate, or a schedule over updates: a linear warm-up from 0 over train.warmup_steps, then
    constant or a cosine decay to 0 over the remaining updates (keras CosineDecay; alpha 1 keeps it constant).

    With inner_accumulation the optimizer calls the schedule with its batch count (Keras' own accumulation), so
    it is wrapped to read updates (UpdateSchedule)."""
    if train.learning_rate_schedule == "constant" and not train.warmup_steps:
        return train.learning_rate
    if steps_per_epoch is None:
        raise ValueError("a learning-rate schedule needs steps_per_epoch (the run's length)")
    updates = total_updates(train, steps_per_epoch)
    alpha = 1.0 if train.learning_rate_schedule == "constant" else 0.0
    if train.warmup_steps:
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0, max(updates - train.warmup_steps, 1), alpha=alpha, warmup_target=train.learning_rate,
            warmup_steps=train.warmup_steps)
    else:
        schedule = keras.optimizers.schedules.CosineDecay(train.learning_rate, max(updates, 1), alpha=alpha)
    if inner_accumulation and train.gradient_accumulation_steps > 1:
        return UpdateSchedule(schedule, train.gradient_accumulation_steps)
    return schedule


def current_loss_scale(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The loss scale in force: the dynamic scale, a static loss_scale_factor, or None (no scaling)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if not optimizer.built:  # the scale variable exists only once the optimizer is built
            return float(optimizer.initial_scale)
        return float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    return optimizer.loss_scale_factor


def describe_policy(name: str, requested: str | None = None, reason: str | None = None) -> PolicyInfo:
    """A PolicyInfo for a serving graph: the policy's dtypes, no loss scaling (nothing is trained)."""
    policy = keras.DTypePolicy(name)
    return PolicyInfo(name=policy.name, compute_dtype=policy.compute_dtype, variable_dtype=policy.variable_dtype,
                      loss_scale="none", requested=requested, reason=reason)


def resolve_serving_policy(setting: str, trained: PolicyInfo) -> PolicyInfo:
    """The policy the export's serving graph computes under (export.serving_policy).

    'trained' keeps the training policy (training and serving share weights and precision); a mixed or
    float32 policy rebuilds the same float32 master weights under it; float16 and bfloat16 store the
    weights in that dtype too (half the variables, no per-call cast); 'auto' lets this machine's hardware
    choose among float16, bfloat16 and float32 (choose_serving_policy).
    """
    if setting == "trained":
        return trained
    if setting == "auto":
        name, reason = choose_serving_policy(detect_hardware())
        log.info("export.serving_policy auto: %s, because this machine has a %s", name, reason)
        return describe_policy(name, requested="auto", reason=reason)
    return describe_policy(setting)


@contextlib.contextmanager
def check_numerics(enabled: bool) -> Iterator[None]:
    """precision.check_numerics: every op checks its outputs for inf/NaN during the block.

    tf.debugging.enable_check_numerics is process-global and must be on before the train step is
    traced, so that every op in it is instrumented; it is switched off again when the block ends.
    """
    if not enabled:
        yield
        return
    import tensorflow as tf

    tf.debugging.enable_check_numerics()
    try:
        yield
    finally:
        tf.debugging.disable_check_numerics()


@contextlib.contextmanager
def policy_scope(name: str) -> Iterator[None]:
    """Builds layers under another policy (a float32 twin, a serving rebuild), then restores the global one."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    if keras.config.dtype_policy().compute_dtype == "float16":
        unfuse_float16_on_cpu(f"policy {name}")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
