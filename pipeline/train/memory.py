"""What a training run will hold in memory at its peak, estimated before its first step (docs/large-models.md#memory).

The process already holds, once the model is compiled, TensorFlow itself, the data pipeline's buffers, the float32
variables (Keras' mixed policies keep float32 master weights) and the optimizer's state (Adam's two moments): that
is measured (RSS now). What the first step adds is counted: the gradients (float32, one per variable), the
compute-dtype copies of the weights a mixed policy casts per step, and the activations the backward pass keeps,
at train.batch_size examples. The estimate is an arithmetic one; metrics.json has it beside the measured peak.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from pipeline.config import Config
from serving import memory_return
from serving.memory_return import resident_bytes

GIB = 2 ** 30
MIB = 2 ** 20
REMAT_BLOCKS = 4  # model.remat: a recomputed block's backward pass holds ~4 × the block's forward activations


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    now_bytes: int  # RSS with the model, its optimizer state and the data loaded
    parameters: int
    variables_bytes: int  # the model's variables as stored (float32 under training policies)
    optimizer_bytes: int  # the optimizer's slots (Adam: two moments per weight)
    gradients_bytes: int
    weight_copies_bytes: int  # the compute-dtype casts of the weights, per step, under a mixed policy
    activations_bytes: int
    activations_basis: str

    @property
    def fits(self) -> bool:
        room = room_bytes()
        return room is None or self.peak_bytes <= room

    @property
    def peak_bytes(self) -> int:
        return (self.now_bytes + self.gradients_bytes + self.weight_copies_bytes + self.activations_bytes)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak_bytes": self.peak_bytes}

    def describe(self) -> str:
        return (f"memory: about {_size(self.peak_bytes)} at the peak: {_size(self.now_bytes)} now (TensorFlow, the "
                f"data, {self.parameters:,} parameters in {_size(self.variables_bytes)} of variables, "
                f"{_size(self.optimizer_bytes)} of optimizer state) + {_size(self.gradients_bytes)} of gradients"
                + (f" + {_size(self.weight_copies_bytes)} of compute-dtype weight copies"
                   if self.weight_copies_bytes else "")
                + f" + about {_size(self.activations_bytes)} of activations ({self.activations_basis})"
                + _available_text(self.peak_bytes))


def estimate(cfg: Config, model: keras.Model) -> MemoryEstimate:
    """The run's peak memory: what is resident now plus what a train step adds (the module's docstring)."""
    variables = sum(_bytes(v) for v in model.weights)
    trainable = sum(_bytes(v) for v in model.trainable_weights)
    optimizer = sum(_bytes(v) for v in model.optimizer.variables) if model.optimizer is not None else 0
    policy = keras.config.dtype_policy()
    compute_bytes = _itemsize(policy.compute_dtype)
    copies = sum(_count(v) * compute_bytes for v in model.trainable_weights) if policy.compute_dtype != "float32" else 0
    activations, basis = activation_bytes(cfg, model, compute_bytes)
    return MemoryEstimate(now_bytes=resident_bytes(), parameters=int(model.count_params()), variables_bytes=variables,
                          optimizer_bytes=optimizer, gradients_bytes=trainable, weight_copies_bytes=copies,
                          activations_bytes=activations, activations_basis=basis)


def activation_bytes(cfg: Config, model: keras.Model, compute_bytes: int) -> tuple[int, str]:
    """What the backward pass keeps per train step, at train.batch_size.

    A causal_lm counts its blocks (pipeline/lm/causal_lm.py): per token the float32 residual stream, LayerNorms,
    casts of q, k, v and the weighted sum (~9 × width × 4 bytes), the compute-dtype projections and MLP outputs
    (6 × width + 2 × mlp_units, compute dtype), and per head the float32 scores, masked scores and softmax weights
    (3 × context² × 4 bytes); and the float32 logits over the vocabulary. Other models: every layer's output at the
    batch, twice (the output and its gradient), which their small layers make a fair upper bound."""
    batch = cfg.train.batch_size
    m = cfg.model
    if m.kind == "causal_lm":
        context = cfg.data.sequence_length
        tokens = batch * context
        per_block = (tokens * m.width * (9 * 4 + 6 * compute_bytes) + tokens * m.mlp_units * 2 * compute_bytes
                     + batch * m.num_heads * context * context * 3 * 4)
        logits = tokens * int(model.outputs[0].shape[-1]) * 4 * 3  # the logits, their softmax and its gradient
        precision_text = "float32" if compute_bytes == 4 else "half-precision"
        if m.remat:
            # each block keeps its float32 input; the backward pass remakes one block at a time, whose activations,
            # their gradients and TensorFlow's buffers measured ~4 × its forward activations (85 M: 0.95-0.97 of the
            # measured peak with 4; docs/large-models.md#memory)
            return (m.num_layers * tokens * m.width * 4 + REMAT_BLOCKS * per_block + logits,
                    f"model.remat: {m.num_layers} blocks' inputs and one block recomputed at batch {batch} × "
                    f"{context} tokens, {precision_text} compute")
        return (m.num_layers * per_block + logits,
                f"{m.num_layers} blocks at batch {batch} × {context} tokens, {precision_text} compute")
    outputs = 0
    for layer in model.layers:
        for tensor in keras.tree.flatten(layer.output):
            shape = [batch if dim is None else dim for dim in tensor.shape]
            size = 1
            for dim in shape:
                size *= int(dim)
            outputs += size * _itemsize(tensor.dtype)
    return 2 * outputs, f"every layer's output and its gradient at batch {batch}"


def release_free_memory() -> None:
    """Hands the heap's free memory back to the system: once a large block has been freed, glibc serves blocks of that
    size from its heap and keeps them when freed, so letting a model go would not lower the process's RSS."""
    memory_return.trim_now()


def available_bytes() -> int | None:
    """Memory the kernel says a new allocation can have (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def room_bytes() -> int | None:
    """What this process may grow to: its resident memory and what the kernel has available."""
    available = available_bytes()
    return None if available is None else available + resident_bytes()


def _available_text(peak: int) -> str:
    room = room_bytes()
    if room is None:
        return ""
    verdict = "fits" if peak <= room else ("does not fit: lower train.batch_size (or data.sequence_length, "
                                           "model.width) (docs/large-models.md#memory)")
    return f"; {_size(room)} available to this process: {verdict}"


def _count(variable) -> int:
    return int(np.prod(variable.shape, dtype=np.int64))


def _bytes(variable) -> int:
    return _count(variable) * _itemsize(variable.dtype)


def _itemsize(dtype) -> int:
    name = keras.backend.standardize_dtype(dtype)
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def _size(count: int) -> str:
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count / MIB:,.0f} MiB"
