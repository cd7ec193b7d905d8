"""Dynamic loss scaling with gradient accumulation that skips a whole update, and schedules counted in updates.

AccumulatingLossScaleOptimizer is Keras' LossScaleOptimizer (precision.build_optimizer uses it whenever the
loss scale is dynamic) with two differences:
- A sparse gradient (an embedding's IndexedSlices) is checked value by value. Keras' check densifies it with
  a scatter in which the last of several rows for the same token wins, so an inf in an earlier row passed,
  its update was applied and the weights went NaN (docs/keras3-mixed-precision.md §12).
- train.gradient_accumulation_steps = k: each batch's gradients are unscaled by the scale in force for that
  batch and summed into float32 accumulators; after the k-th batch their mean is applied by the inner
  optimizer (its global_clipnorm clips that mean, unscaled). A batch with non-finite gradients halves the
  scale as usual and marks its group: the group's update is skipped whole, never applied with k-1 batches or
  with a later batch in its place (what Keras' own accumulation inside a LossScaleOptimizer does). The
  accumulators, the batch count and the mark are optimizer variables, so a checkpoint taken mid-group resumes
  the group. The scale grows after dynamic_growth_steps finite batches; `iterations` counts applied updates.

Without dynamic loss scaling (float32, mixed_bfloat16, a static scale) accumulation is Keras' own
(the inner optimizer's gradient_accumulation_steps), whose learning-rate schedule is called with the batch
count: UpdateSchedule turns that into the update count, so warm-up and decay are counted in updates under
every policy.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops


@keras.saving.register_keras_serializable(package="pipeline")
class AccumulatingLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """LossScaleOptimizer with a value-by-value finite check and whole-update gradient accumulation (module doc)."""

    def __init__(self, inner_optimizer, initial_scale=2.0 ** 15, dynamic_growth_steps=2000, accumulation_steps=1,
                 name=None, **kwargs):
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                         name=name, **kwargs)
        self.accumulation_steps = accumulation_steps

    def build(self, var_list):
        super().build(var_list)
        if self.accumulation_steps > 1:
            self.accumulated_batches = self.add_variable((), initializer="zeros", dtype="int",
                                                         aggregation="none", name="accumulated_batches")
            self.group_overflowed = self.add_variable((), initializer="zeros", dtype="int",
                                                      aggregation="none", name="group_overflowed")
            self.accumulators = [self.add_variable_from_reference(variable, name="gradient_accumulator")
                                 for variable in var_list]

    def check_finite(self, grads):
        values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
        return ops.all(ops.convert_to_tensor([ops.all(ops.isfinite(v)) for v in values]))

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        if self.accumulation_steps == 1:
            return super()._stateful_handle_finite_grads(grads, trainable_variables)
        variables = trainable_variables or self._trainable_variables
        for accumulator, grad in zip(self._accumulators_for(variables), grads):
            if grad is not None:
                accumulator.assign_add(ops.divide(ops.convert_to_tensor(grad), self.dynamic_scale))
        self._count_finite_batch()
        self._end_batch(variables)

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()  # halves the scale, resets the growth count
        if self.accumulation_steps > 1:
            self.group_overflowed.assign(1)
            self._end_batch(None)

    def _count_finite_batch(self):
        """LossScaleOptimizer's growth rule: double the scale after dynamic_growth_steps finite batches."""
        def grow():
            self.step_counter.assign(0)
            self.dynamic_scale.assign(self.dynamic_scale * 2.0)

        def count():
            self.step_counter.assign_add(1)

        ops.cond(ops.equal(self.step_counter, self.dynamic_growth_steps - 1), grow, count)

    def _end_batch(self, variables):
        """After the group's last batch: apply the mean (unless a batch overflowed), then start a new group."""
        self.accumulated_batches.assign_add(1)

        def close_group():
            if variables is not None:  # the finite branch; after an overflow there is nothing to apply
                ops.cond(ops.equal(self.group_overflowed, 0), lambda: self._apply_mean(variables), lambda: None)
            for accumulator in self.accumulators:
                accumulator.assign(ops.zeros_like(accumulator))
            self.accumulated_batches.assign(0)
            self.group_overflowed.assign(0)

        ops.cond(ops.equal(self.accumulated_batches, self.accumulation_steps), close_group, lambda: None)

    def _apply_mean(self, variables):
        mean = [ops.divide(accumulator, float(self.accumulation_steps))
                for accumulator in self._accumulators_for(variables)]
        self.inner_optimizer.apply(mean, variables)

    def _accumulators_for(self, variables):
        return [self.accumulators[self._get_variable_index(variable)] for variable in variables]

    def get_config(self):
        return {**super().get_config(), "accumulation_steps": self.accumulation_steps}


@keras.saving.register_keras_serializable(package="pipeline")
class UpdateSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule over updates for an optimizer that accumulates: Keras calls it with the batch count, which is
    k * update + k - 1 when an update is applied."""

    def __init__(self, schedule, accumulation_steps: int):
        self.schedule = schedule
        self.accumulation_steps = accumulation_steps

    def __call__(self, step):
        return self.schedule(ops.floor_divide(step, self.accumulation_steps))

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule),
                "accumulation_steps": self.accumulation_steps}

    @classmethod
    def from_config(cls, config):
        return cls(keras.optimizers.schedules.deserialize(config["schedule"]), config["accumulation_steps"])
