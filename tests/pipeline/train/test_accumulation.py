"""Gradient accumulation under dynamic loss scaling (AccumulatingLossScaleOptimizer), the finite check of sparse
gradients, clipping of unscaled gradients, schedules counted in updates, and k batches of b against one of k*b."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline import data, precision
from pipeline.train.accumulation import AccumulatingLossScaleOptimizer, UpdateSchedule
from pipeline.config import load_config
from pipeline.train import build_compiled_model, checkpoints, loops
from pipeline.train.recorder import RunRecorder

INF = float("inf")


def _steps(optimizer, variable, gradients, traced: bool):
    """Applies each (unscaled) gradient as a train step would: multiplied by the scale in force, as its loss was."""
    def step(gradient):
        optimizer.apply([gradient * optimizer.dynamic_scale], [variable])

    step = tf.function(step) if traced else step
    for gradient in gradients:
        step(tf.constant(gradient, tf.float32))


@pytest.mark.parametrize("traced", [False, True])
def test_an_update_with_an_overflowing_batch_is_skipped_whole(traced):
    ours = AccumulatingLossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0, accumulation_steps=2)
    w = keras.Variable([0.0, 0.0])
    ours.build([w])
    _steps(ours, w, [[1.0, 1.0], [INF, 0.0]], traced)  # the group's second batch overflows
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])
    assert int(ours.iterations.numpy()) == 0 and float(ours.dynamic_scale.numpy()) == 2.0
    _steps(ours, w, [[2.0, 4.0], [4.0, 8.0]], traced)  # the next group: its own mean, nothing of the first
    np.testing.assert_array_equal(w.numpy(), [-3.0, -6.0])
    assert int(ours.iterations.numpy()) == 1

    # Keras' own accumulation inside its LossScaleOptimizer drops the overflowing batch and fills the group
    # with the next one: an update from [1, 1] and [2, 4], half of it from the spoilt group.
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2),
                                                    initial_scale=4.0)
    v = keras.Variable([0.0, 0.0])
    keras_lso.build([v])
    _steps(keras_lso, v, [[1.0, 1.0], [INF, 0.0], [2.0, 4.0]], traced)
    np.testing.assert_array_equal(v.numpy(), [-1.5, -2.5])


def test_a_group_checkpointed_half_way_resumes_to_the_same_update(tmp_path):
    def fresh():
        optimizer = AccumulatingLossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=8.0, accumulation_steps=3)
        variable = keras.Variable([1.0, -1.0])
        optimizer.build([variable])
        return optimizer, variable

    batches = [[0.5, 1.0], [1.5, -2.0], [0.25, 0.5], [1.0, 1.0], [-2.0, 0.5], [0.5, 0.5]]
    straight, w = fresh()
    _steps(straight, w, batches, traced=True)
    first, w1 = fresh()
    _steps(first, w1, batches[:4], traced=True)  # one update, then one batch into the second group
    path = tf.train.Checkpoint(optimizer=first, w=w1.value).write(str(tmp_path / "ckpt"))
    resumed, w2 = fresh()
    tf.train.Checkpoint(optimizer=resumed, w=w2.value).read(path).assert_existing_objects_matched()
    assert int(resumed.accumulated_batches.numpy()) == 1
    _steps(resumed, w2, batches[4:], traced=True)
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    assert int(resumed.iterations.numpy()) == int(straight.iterations.numpy()) == 2


def test_an_inf_in_a_repeated_embedding_row_is_caught():
    """An embedding's gradient holds one row per occurrence of a token; Keras densifies it for its finite check
    with a scatter in which the last row for a token wins (docs/keras3-mixed-precision.md §12)."""
    gradient = tf.IndexedSlices(tf.constant([[INF, 1.0], [2.0, 3.0]]), tf.constant([0, 0]), tf.constant([3, 2]))
    assert bool(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()).check_finite([gradient]))  # missed
    ours = AccumulatingLossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0)
    table = keras.Variable(np.zeros((3, 2), np.float32))
    ours.build([table])
    assert not bool(ours.check_finite([gradient]))
    ours.apply([gradient], [table])
    np.testing.assert_array_equal(table.numpy(), np.zeros((3, 2)))  # skipped, not applied as inf
    assert float(ours.dynamic_scale.numpy()) == 2.0


@pytest.mark.parametrize("accumulation", [1, 2])
def test_clipping_applies_to_the_unscaled_mean_gradient(accumulation):
    optimizer = AccumulatingLossScaleOptimizer(keras.optimizers.SGD(1.0, global_clipnorm=1.0), initial_scale=1024.0,
                                               accumulation_steps=accumulation)
    w = keras.Variable([0.0, 0.0])
    optimizer.build([w])
    _steps(optimizer, w, [[6.0, 8.0]] * accumulation, traced=True)  # norm 10 unscaled, 10240 as the loss scaled it
    np.testing.assert_allclose(w.numpy(), [-0.6, -0.8], rtol=1e-6)  # clipped to norm 1: not 1/1024, not 1024


def test_a_schedule_under_keras_accumulation_is_counted_in_updates():
    schedule = keras.optimizers.schedules.CosineDecay(0.0, 4, warmup_target=1.0, warmup_steps=2)
    optimizer = keras.optimizers.SGD(UpdateSchedule(schedule, 3), gradient_accumulation_steps=3)
    w = keras.Variable([0.0])
    optimizer.build([w])
    steps = []
    for _ in range(6):  # update u applies after batches 3u .. 3u+2, at the rate of schedule(u)
        before = float(w.numpy()[0])
        for _ in range(3):
            optimizer.apply([tf.constant([1.0])], [w])
        steps.append(before - float(w.numpy()[0]))
    np.testing.assert_allclose(steps, [float(schedule(u)) for u in range(6)], atol=1e-7)
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(UpdateSchedule(schedule, 3)))
    assert float(restored(7)) == float(schedule(2))


def _rows(n: int):
    cfg = load_config(None)
    rows = data.load_datasets(cfg.data, seed=cfg.seed)
    return data.in_memory(rows.spec, rows.train.x[:n], rows.train.y[:n], rows.val.x[:64], rows.val.y[:64])


def _train(datasets, tmp_path, *overrides):
    """Two epochs of train()'s model, optimizer, loop and recorder on the given rows (Adam, warm-up, cosine decay,
    clipping)."""
    cfg = load_config(None, ["model.hidden_units=[16]", "train.optimizer=adam", "train.learning_rate=0.01",
                             "train.epochs=2", "train.learning_rate_schedule=cosine", "train.warmup_steps=2",
                             "train.global_clipnorm=0.5", f"train.runs_dir={tmp_path}", *overrides])
    policy = precision.apply_policy(cfg.precision)
    keras.utils.set_random_seed(cfg.seed)
    model = build_compiled_model(cfg, datasets, policy)
    initial = model.get_weights()
    plan = loops.plan_for(cfg, datasets)
    recorder = RunRecorder(tmp_path, checkpoints.Checkpointer(tmp_path, model, 1), checkpoints.TrainingState(),
                           cfg.train, policy, plan.length)
    loops.run("fit", model, plan, [recorder], 0, 0, tf.distribute.get_strategy())
    recorder.close()
    return model, initial


@pytest.mark.parametrize("policy, tolerance", [("float32", 1e-6), ("mixed_float16", 1e-4)])
def test_k_batches_of_b_update_like_one_batch_of_k_times_b(policy, tolerance, tmp_path):
    """Four batches of 32 averaged, and one of 128 (the same 128 rows: one batch of 128 per epoch), with the
    same schedule; under float32 Keras' accumulation, under mixed_float16 AccumulatingLossScaleOptimizer."""
    rows = _rows(128)
    accumulated, _ = _train(rows, tmp_path / "accumulated", f"precision.policy={policy}", "train.batch_size=32",
                            "train.gradient_accumulation_steps=4")
    one_batch, initial = _train(rows, tmp_path / "one", f"precision.policy={policy}", "train.batch_size=128")
    assert int(accumulated.optimizer.iterations.numpy()) == int(one_batch.optimizer.iterations.numpy()) == 2
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(one_batch.get_weights(), initial))
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(accumulated.get_weights(), one_batch.get_weights()))
    assert moved > 1e-3 and difference <= tolerance, (difference, moved)
