"""The memory estimate train prints before its first step and records beside the measured peak (train/memory.py)."""

import keras
import numpy as np

from pipeline import precision
from pipeline.config import load_config
from pipeline.train import memory
from lm_helpers import TINY_LM_MODEL


def test_metrics_hold_the_estimate_beside_the_measured_peak(trained_run):
    estimate = trained_run.metrics["memory_estimate"]
    parameters = trained_run.model.count_params()
    assert estimate["parameters"] == parameters
    assert estimate["variables_bytes"] >= 4 * parameters  # float32 master weights (and the normalisation's stats)
    assert estimate["gradients_bytes"] == 4 * sum(int(np.prod(w.shape)) for w in trained_run.model.trainable_weights)
    # mixed_float16: a float16 copy of every trainable weight per step; RMSprop: one float32 slot per weight
    assert estimate["weight_copies_bytes"] == estimate["gradients_bytes"] // 2
    assert estimate["optimizer_bytes"] >= estimate["gradients_bytes"]
    assert estimate["activations_bytes"] > 0
    assert estimate["peak_bytes"] == sum(estimate[key] for key in ("now_bytes", "gradients_bytes",
                                                                    "weight_copies_bytes", "activations_bytes"))
    # the peak the run measured holds what was resident when the estimate was made, and the estimate is not inflated
    assert estimate["now_bytes"] <= trained_run.metrics["peak_rss_bytes"]
    assert estimate["peak_bytes"] <= 1.5 * trained_run.metrics["peak_rss_bytes"]


def test_the_description_names_each_part_and_what_fits(trained_run):
    fields = {k: v for k, v in trained_run.metrics["memory_estimate"].items() if k != "peak_bytes"}
    text = memory.MemoryEstimate(**fields).describe()
    assert text.startswith("memory: about ")
    for part in ("now (TensorFlow, the data", "parameters in", "of optimizer state", "of gradients",
                 "of compute-dtype weight copies", "of activations", "available to this process: fits"):
        assert part in text, part
    assert "\n" not in text
    huge = memory.MemoryEstimate(**{**fields, "activations_bytes": 2 ** 50})
    assert not huge.fits and "does not fit: lower train.batch_size" in huge.describe()


def _lm_activations(overrides, policy="float32"):
    cfg = load_config(None, [*TINY_LM_MODEL, "data.source=text", *overrides])
    with precision.policy_scope(policy):
        from pipeline.lm.causal_lm import build_causal_lm

        m = cfg.model
        model = build_causal_lm(vocab_size=260, context_length=cfg.data.sequence_length, num_layers=m.num_layers,
                                num_heads=m.num_heads, width=m.width, mlp_width=m.mlp_units)
        return memory.activation_bytes(cfg, model, 4 if policy == "float32" else 2)


def test_a_language_models_activations_follow_batch_context_and_compute_dtype():
    single, basis = _lm_activations(["train.batch_size=4"])
    assert "blocks at batch 4 ×" in basis and "float32 compute" in basis
    assert _lm_activations(["train.batch_size=8"])[0] == 2 * single
    assert _lm_activations(["train.batch_size=4"], "mixed_bfloat16")[0] < single  # the projections in 2 bytes
    keras.config.set_dtype_policy("float32")


def test_remat_keeps_the_blocks_inputs_and_one_recomputed_block():
    plain, _ = _lm_activations(["train.batch_size=4", "model.num_layers=6"])
    recomputed, basis = _lm_activations(["train.batch_size=4", "model.num_layers=6", "model.remat=true"])
    assert basis.startswith("model.remat: 6 blocks' inputs and one block recomputed at batch 4 ×")
    assert recomputed < plain
    keras.config.set_dtype_policy("float32")
