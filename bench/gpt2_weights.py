"""Figure 14's GPT-2 weights, the same bits in any environment: a counter hashed to uniform numbers (SplitMix64), not
a random generator whose stream could change between numpy versions. bench/make_gpt2_reference.py feeds them to
Hugging Face's GPT2LMHeadModel in a throwaway environment; bench/pretrained.py writes them as a checkpoint and imports
it. numpy only, so both can import it.
"""

from __future__ import annotations

import numpy as np

# (name, num_layers, width, num_heads, n_positions, vocab_size): the bench's GPT-2 small body over the pipeline's
# 457-id vocabulary, and the smoke run's
SHAPES = {"12x768": (12, 768, 12, 1024, 457), "2x32": (2, 32, 4, 128, 457)}
TOKENS = (4, 128)  # the teacher-forced ids: rows x positions
KEPT_POSITIONS = slice(None, None, 4)  # the reference keeps every 4th position's logits (a small fixture)


def uniform(count: int, stream: int) -> np.ndarray:
    """count numbers in [-1, 1), a function of (stream, index) only."""
    with np.errstate(over="ignore"):
        x = np.arange(count, dtype=np.uint64) + np.uint64(stream) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) / 2.0**53 * 2 - 1).astype(np.float32)


def weights(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Unprefixed GPT-2 tensor name → float32 array of the shapes given (gpt2.expected_shapes here, the reference
    model's own parameters there: the same names, so the same bits): LayerNorm weights 1 ± 0.2, biases ± 0.05,
    matrices, positions and embeddings ± 0.04·sqrt(3) (GPT-2's initialiser's spread, std 0.04)."""
    out = {}
    for stream, (tensor, shape) in enumerate(sorted(shapes.items())):
        u = uniform(int(np.prod(shape)), stream + 1).reshape(shape)
        if tensor.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            out[tensor] = 1 + 0.2 * u
        elif tensor.endswith(".bias"):
            out[tensor] = 0.05 * u
        else:
            out[tensor] = 0.04 * np.sqrt(3, dtype=np.float32) * u
    return out


def token_ids(name: str) -> np.ndarray:
    vocab_size = SHAPES[name][4]
    return (np.abs(uniform(TOKENS[0] * TOKENS[1], 999)) * vocab_size).astype(np.int32).reshape(TOKENS) % vocab_size
