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


def tensor_shapes(num_layers: int, width: int, n_positions: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    d = width
    shapes = {"wte.weight": (vocab_size, d), "wpe.weight": (n_positions, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for n in range(num_layers):
        shapes.update({f"h.{n}.ln_1.weight": (d,), f"h.{n}.ln_1.bias": (d,), f"h.{n}.attn.c_attn.weight": (d, 3 * d),
                       f"h.{n}.attn.c_attn.bias": (3 * d,), f"h.{n}.attn.c_proj.weight": (d, d),
                       f"h.{n}.attn.c_proj.bias": (d,), f"h.{n}.ln_2.weight": (d,), f"h.{n}.ln_2.bias": (d,),
                       f"h.{n}.mlp.c_fc.weight": (d, 4 * d), f"h.{n}.mlp.c_fc.bias": (4 * d,),
                       f"h.{n}.mlp.c_proj.weight": (4 * d, d), f"h.{n}.mlp.c_proj.bias": (d,)})
    return shapes


def weights(name: str) -> dict[str, np.ndarray]:
    """Unprefixed GPT-2 tensor name → float32 array: LayerNorm weights 1 ± 0.2, biases ± 0.05, matrices
    ± 0.04·sqrt(3) (GPT-2's initialiser's spread, std 0.04), positions and embeddings likewise."""
    num_layers, width, _, n_positions, vocab_size = SHAPES[name]
    out = {}
    for stream, (tensor, shape) in enumerate(sorted(tensor_shapes(num_layers, width, n_positions, vocab_size).items())):
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
