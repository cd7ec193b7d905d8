"""Figure 11: text generation with the key/value cache vs recomputing the whole sequence for every new token.

The same untrained byte-level language model (pipeline/lm/causal_lm.py) generates greedily from one prompt, batch 1,
in this process: pipeline/lm/generate.py's graph with the cache (prefill once, then one token per step) and the
same graph recomputing every position each step (generate.recompute_generate). Both sides are traced and run
twice before timing, then alternate over the rounds; the speed-up is the median over rounds. Greedy, the two
give the same tokens under float32 (checked); under a mixed policy they may drift apart after a while, as any
two orders of the same float16/bfloat16 sums may, so only float32's are compared.
"""

from __future__ import annotations

from pathlib import Path

from bench import result_files, timing
from bench.workloads import Sizes

TITLE = "Generation: key/value cache vs recomputing the sequence per token (batch 1, greedy)"
TARGET = "cached >= 5x the tokens/s of the recompute"
COLUMNS = ["policy", "new_tokens", "cached_tokens_per_second", "recompute_tokens_per_second", "speedup",
           "cache_mib", "target_met"]
POLICIES = ("float32", "mixed_bfloat16")
PROMPT = "The quick brown fox jumps over the lazy dog. "


def language_model(sizes: Sizes, policy: str):
    """The figure's untrained byte-level model (sizes.generation_model), built under policy with seed 0 (figure 12
    serves the same one)."""
    import keras

    from pipeline.lm import causal_lm

    num_layers, num_heads, width, mlp_width, context = sizes.generation_model
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        return causal_lm.build_causal_lm(context_length=context, num_layers=num_layers, num_heads=num_heads,
                                         width=width, mlp_width=mlp_width)
    finally:
        keras.config.set_dtype_policy("float32")


def run(sizes: Sizes, work_dir: Path) -> dict:
    import numpy as np
    import tensorflow as tf

    from pipeline.lm import causal_lm, generate

    num_layers, num_heads, width, mlp_width, context = sizes.generation_model
    new_tokens = sizes.generation_new_tokens
    arguments = (tf.constant([PROMPT]), tf.constant(new_tokens), tf.constant(0.0), tf.constant(0),
                 tf.constant(0, tf.int64))
    rows = []
    for policy in POLICIES:
        model = language_model(sizes, policy)
        sides = {"cached": generate.Generator(model).generate, "recompute": generate.recompute_generate(model)}
        outputs = {name: [function(*arguments) for _ in range(2)][-1] for name, function in sides.items()}
        if policy == "float32":
            np.testing.assert_array_equal(outputs["cached"]["ids"].numpy(), outputs["recompute"]["ids"].numpy())
        seconds = {name: [] for name in sides}
        for round_ in range(sizes.generation_rounds):
            for name, function in sides.items() if round_ % 2 == 0 else reversed(sides.items()):
                seconds[name].append(timing.seconds_per_call(lambda: function(*arguments), 1))
        ids = outputs["cached"]["ids"].numpy()[0]
        generated = int(outputs["cached"]["lengths"][0]) + int((ids == causal_lm.EOS).any())  # EOS is a step too
        rates = {name: generated / timing.median(values) for name, values in seconds.items()}
        head_dim = width // num_heads
        cache_bytes = 2 * num_layers * num_heads * context * head_dim * tf.as_dtype(causal_lm.cache_dtype(model)).size
        rows.append({"policy": policy, "new_tokens": generated, "cached_tokens_per_second": rates["cached"],
                     "recompute_tokens_per_second": rates["recompute"],
                     "speedup": rates["cached"] / rates["recompute"], "cache_mib": cache_bytes / 2**20,
                     "target_met": rates["cached"] >= 5 * rates["recompute"]})
        timing.progress(f"generation: {policy}: cached {rates['cached']:.0f} tokens/s, recompute "
                        f"{rates['recompute']:.0f} tokens/s ({rows[-1]['speedup']:.2f}x)")
    return {"rows": rows, "setup": {"model": dict(zip(("num_layers", "num_heads", "width", "mlp_width",
                                                       "context_length"), sizes.generation_model)),
                                    "prompt_bytes": len(PROMPT.encode()), "rounds": sizes.generation_rounds}}


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    result_files.grouped_bars(ax, rows, ("key/value cache", [row["cached_tokens_per_second"] for row in rows]),
                              ("recompute per token", [row["recompute_tokens_per_second"] for row in rows]))
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_title("11. generation: cache vs recompute", fontsize=9)
    ax.legend(fontsize=7)
