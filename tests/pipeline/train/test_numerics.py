"""precision.check_numerics: the first inf/NaN op stops training, naming the op and its Keras layer."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline import data, precision
from pipeline.train import checkpoints, loops
from pipeline.config import load_config
from pipeline.errors import TrainingError
from pipeline.train.numerics import layer_of_op
from pipeline.train.recorder import RunRecorder


def _boom_model(spec: data.DataSpec, classes: int) -> keras.Model:
    inputs = keras.Input(spec.input_shape, name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    # 1e30 does not fit float16 (max 65504): this layer's output is inf.
    boom = keras.layers.Lambda(lambda t: t * 1e30, name="boom")(hidden)
    logits = keras.layers.Dense(classes, name="logits")(boom)
    return keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32", name="probabilities")(logits))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_check_numerics_names_the_layer_that_made_inf(loop, tmp_path):
    cfg = load_config(None, ["precision.check_numerics=true", "train.epochs=1", "train.batch_size=32",
                             f"train.loop={loop}", f"train.runs_dir={tmp_path}"])
    policy = precision.apply_policy(cfg.precision)
    rows = data.load_datasets(cfg.data, seed=cfg.seed)
    rows = data.in_memory(rows.spec, rows.train.x[:64], rows.train.y[:64], rows.val.x[:32], rows.val.y[:32])
    model = _boom_model(rows.spec, int(rows.train.y.max()) + 1)
    model.compile(optimizer=precision.build_optimizer(cfg.train, policy), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], auto_scale_loss=False)
    plan = loops.plan_for(cfg, rows)
    recorder = RunRecorder(tmp_path, checkpoints.Checkpointer(tmp_path, model, 1),
                           checkpoints.TrainingState(config=cfg.to_dict()), cfg.train, policy, plan.length)
    try:
        # As train() runs the loop: the switch is precision.check_numerics's, around the whole loop.
        with pytest.raises(TrainingError) as raised, precision.check_numerics(cfg.precision.check_numerics):
            loops.run(loop, model, plan, [recorder], 0, 0, tf.distribute.get_strategy())
    finally:
        recorder.close()
    message = str(raised.value)
    assert "\n" not in message
    assert "in layer 'boom'" in message and "boom" in message.split("from op '")[1]
    assert "precision.float32_layers" in message
    tf.constant(np.inf) * 2.0  # numeric checking is off again after the block: this would raise


def test_layer_of_op_strips_unique_scope_suffixes():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="dense_1")(keras.layers.Dense(3, name="dense")(inputs))
    model = keras.Model(inputs, outputs)
    assert layer_of_op("functional_3/dense_1/MatMul", model) == "dense_1"
    assert layer_of_op("functional_3/dense_2/MatMul", model) == "dense"  # scope dense_2 of layer dense
    assert layer_of_op("gradient_tape/functional_3/dense_1/MatMul/MatMul_1", model) == "dense_1"
    assert layer_of_op("Adam/mul", model) is None
