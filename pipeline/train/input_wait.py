"""How long each training step waited for its batch: the input pipeline's share of step time.

A batch is stamped (tf.timestamp) when the input pipeline has finished it and hands it to the last prefetch
buffer; when a step takes it out, the stamp goes into a host variable. A step that began (in Python) before its
batch was finished waited the difference; a batch finished earlier cost the step nothing. Summed over an epoch
and divided by the epoch's training time, that is the fraction of step time spent waiting for input, the number
TensorFlow's profiler calls "input-bound" (docs/data.md#input-bound). The stamp is taken on this machine, after
a tf.data service has delivered the batch, so clocks of other machines never enter it.
"""

from __future__ import annotations

import time

import tensorflow as tf

# Above this fraction of step time spent waiting, the epoch's log line says "input-bound" with the knobs to turn.
INPUT_BOUND_SHARE = 0.1


class InputClock:
    def __init__(self) -> None:
        with tf.device("/CPU:0"):
            self.finished = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="batch_finished_at")
        self.began = 0.0
        self.waited = 0.0
        self.steps = 0

    def stamp(self, batches: tf.data.Dataset) -> tf.data.Dataset:
        """batches, each stamped when finished and the stamp recorded when a step takes it."""
        finished = self.finished

        def record(x, y, stamp):
            with tf.control_dependencies([finished.assign(stamp)]):
                return tf.identity(x), tf.identity(y)

        stamped = batches.map(lambda x, y: (x, y, tf.timestamp())).prefetch(tf.data.AUTOTUNE)
        options = tf.data.Options()
        options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        return stamped.map(record).with_options(options)

    def step_began(self) -> None:
        self.began = time.time()  # tf.timestamp's clock

    def step_ended(self) -> None:
        self.steps += 1
        if self.steps > 1:  # the first step also builds the pipeline and traces the train step: start-up, not input
            self.waited += max(0.0, float(self.finished) - self.began)  # float(): ~12 µs a step, half of .numpy()

    def take(self) -> float:
        """The seconds waited since the last take."""
        waited, self.waited = self.waited, 0.0
        return waited
