"""The policy and the optimizer it implies: the one place precision is decided."""

import keras
import pytest

from pipeline.config import load_config
from pipeline.train.accumulation import AccumulatingLossScaleOptimizer
from pipeline.precision import apply_policy, build_optimizer, current_loss_scale


def test_mixed_float16_uses_a_dynamic_loss_scale_optimizer_with_the_configured_settings():
    cfg = load_config(None, ["precision.initial_scale=1024", "precision.dynamic_growth_steps=100"])
    policy = apply_policy(cfg.precision)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == ("mixed_float16", "float16", "float32")
    assert keras.config.dtype_policy().name == "mixed_float16"
    optimizer = build_optimizer(cfg.train, policy)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.RMSprop)
    assert optimizer.initial_scale == 1024
    assert optimizer.dynamic_growth_steps == 100


def test_static_loss_scale_is_the_inner_optimizers_factor():
    cfg = load_config(None, ["precision.loss_scale=128", "train.optimizer=adam"])
    policy = apply_policy(cfg.precision)
    optimizer = build_optimizer(cfg.train, policy)
    assert policy.loss_scale == "static"
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert optimizer.loss_scale_factor == 128


@pytest.mark.parametrize("name, compute", [("float32", "float32"), ("mixed_bfloat16", "bfloat16")])
def test_policies_without_float16_need_no_loss_scaling(name, compute):
    cfg = load_config(None, [f"precision.policy={name}"])
    policy = apply_policy(cfg.precision)
    assert (policy.compute_dtype, policy.variable_dtype, policy.loss_scale) == (compute, "float32", "none")
    assert not isinstance(build_optimizer(cfg.train, policy), keras.optimizers.LossScaleOptimizer)
    assert name in policy.describe()


def test_gradient_accumulation_is_the_loss_scale_optimizers_under_dynamic_scaling_else_keras():
    cfg = load_config(None, ["train.gradient_accumulation_steps=4", "train.optimizer=sgd"])
    optimizer = build_optimizer(cfg.train, apply_policy(cfg.precision))
    assert isinstance(optimizer, AccumulatingLossScaleOptimizer) and optimizer.accumulation_steps == 4
    assert optimizer.inner_optimizer.gradient_accumulation_steps is None  # the whole update is skipped on overflow
    off = build_optimizer(load_config(None).train, apply_policy(cfg.precision))
    assert off.accumulation_steps == 1 and off.inner_optimizer.gradient_accumulation_steps is None
    bf16 = load_config(None, ["train.gradient_accumulation_steps=4", "precision.policy=mixed_bfloat16"])
    plain = build_optimizer(bf16.train, apply_policy(bf16.precision))
    assert not isinstance(plain, keras.optimizers.LossScaleOptimizer) and plain.gradient_accumulation_steps == 4


@pytest.mark.parametrize("overrides, scale", [
    (["precision.initial_scale=512"], 512.0),  # dynamic: the scale variable, or initial_scale before build
    (["precision.loss_scale=128"], 128.0),  # static: the inner optimizer's loss_scale_factor
    (["precision.policy=float32"], None),
])
def test_current_loss_scale(overrides, scale):
    cfg = load_config(None, overrides)
    optimizer = build_optimizer(cfg.train, apply_policy(cfg.precision))
    assert current_loss_scale(optimizer) == scale
    optimizer.build([keras.Variable(1.0)])
    assert current_loss_scale(optimizer) == scale


@pytest.mark.subprocess  # grappler's options are process-wide: a fresh process shows what the policy did
@pytest.mark.parametrize("policy, remapping", [("mixed_float16", "False"), ("mixed_bfloat16", "True"),
                                               ("float32", "True")])
def test_a_float16_policy_on_a_cpu_turns_off_the_slow_float16_fusion(policy, remapping):
    """docs/keras3-mixed-precision.md §11: training under mixed_float16 ran 190x slower with the fusion."""
    import subprocess
    import sys
    from pathlib import Path

    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("with a GPU the fusion is kept")
    script = ("import sys, tensorflow as tf\n"
              "from pipeline import precision\n"
              "from pipeline.config import PrecisionConfig\n"
              "precision.apply_policy(PrecisionConfig(policy=sys.argv[1]))\n"
              "print(tf.config.optimizer.get_experimental_options().get('remapping', True))\n")
    result = subprocess.run([sys.executable, "-c", script, policy], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip().splitlines()[-1] == remapping, result.stderr[-2000:]
