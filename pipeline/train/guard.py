"""Stops training that has gone non-finite, and warns while dynamic loss scaling struggles.

The run recorder reports every step to one TrainingGuard, which applies the stop rules (a run of
non-finite steps, a collapsed dynamic loss scale, non-finite weights) by raising TrainingError with one
line that says where training stopped, why, which checkpoint is kept and what to change; it warns once per
condition when many steps are skipped or the scale falls low while training goes on; and it summarizes the
loss scale's health for metrics.json.

Why a guard at all: under dynamic scaling LossScaleOptimizer skips a step with inf/NaN gradients and halves
the scale, with no lower bound, so a hopeless run silently halves its way to a scale of 0; under a static
scale or none, the inf/NaN update is applied (docs/keras3-mixed-precision.md §2).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

from pipeline import precision
from pipeline.config import TrainConfig
from pipeline.errors import TrainingError
from pipeline.train.checkpoints import TrainingState

log = logging.getLogger(__name__)

# The first steps normally skip while the dynamic scale settles down from its initial 32768.
HEALTH_WARMUP_STEPS = 50
# Far below the usual 2**10..2**20: gradients this small in float16 lose precision or underflow; < 1 is fatal.
LOW_LOSS_SCALE = 2.0 ** 5
DEFAULT_MAX_SKIPPED_SHARE = 0.05
# Non-finite weights with a finite loss (see _check) are caught within this many steps; a checkpoint,
# an epoch end and a non-finite loss always check first, so no checkpoint ever holds them.
WEIGHTS_CHECK_EVERY = 20


class TrainingGuard:
    """The stop rules and the loss-scale health of one training process, fed one step at a time.

    It reads the step position and the skipped-step count from the TrainingState that the recorder
    keeps, and never changes it.
    """

    def __init__(self, state: TrainingState, train: TrainConfig, policy: precision.PolicyInfo, steps_per_epoch: int,
                 published_checkpoint: Callable[[], Path | None]):
        """published_checkpoint is called only when training stops: it returns the newest checkpoint once
        its publishing has finished, so that the message names a checkpoint that is there."""
        self.state = state
        self.steps_per_epoch = steps_per_epoch
        self.max_nonfinite_steps = train.max_nonfinite_steps
        self._published_checkpoint = published_checkpoint
        self.dynamic = policy.loss_scale == "dynamic"
        # Below 1 the loss is scaled down: float16 overflows even without scaling, and Keras would keep
        # halving towards 0, where every update becomes NaN (docs/keras3-mixed-precision.md §2).
        self.min_loss_scale = min(1.0, policy.initial_scale or 1.0)
        self.nonfinite_streak = 0
        self.last_finite: tuple[int, float] | None = None  # (step, running loss)
        self._weights_checked_at = state.global_step  # the last step whose weights were found finite
        precision_cfg = state.config.get("precision", {})  # train() sets it before the recorder exists
        self.max_skipped_share = precision_cfg.get("max_skipped_share", DEFAULT_MAX_SKIPPED_SHARE)
        self.low_loss_scale = min(LOW_LOSS_SCALE, policy.initial_scale or LOW_LOSS_SCALE)
        self.min_scale: float | None = None
        self.health_warnings: list[str] = []
        self._warned: set[str] = set()
        self._steps_after_warmup = 0
        self._skipped_after_warmup = 0

    def after_step(self, scale: float | None, skipped: bool, loss: float, weights_finite: Callable[[], bool],
                   check_weights: bool) -> None:
        """Takes in the step the state has just counted: the loss scale after it, whether the optimizer
        skipped its update, and the running loss. Raises TrainingError when a stop rule is met.

        weights_finite is a ~0.3 ms call, so the weights are checked when check_weights (the recorder is
        about to checkpoint or end the epoch), every WEIGHTS_CHECK_EVERY steps, and after a non-finite loss
        without dynamic scaling; the rest is Python bookkeeping.
        """
        self._watch_health(scale, skipped)
        # A non-finite loss gives non-finite gradients, which dynamic scaling skips (and counts). Without it
        # the running loss is all there is to go by; _check also stops once an update poisoned the weights.
        nonfinite = skipped if self.dynamic else not math.isfinite(loss)
        self.nonfinite_streak = self.nonfinite_streak + 1 if nonfinite else 0
        if not nonfinite and math.isfinite(loss):
            self.last_finite = (self.state.global_step, loss)
        check_weights = (check_weights or self.state.global_step % WEIGHTS_CHECK_EVERY == 0
                         or (nonfinite and not self.dynamic))
        self._check(scale, loss, weights_finite if check_weights else None)

    def may_checkpoint(self) -> bool:
        """Whether the weights as they are now may be checkpointed.

        _check has stopped training before any step that left non-finite weights; and under dynamic
        scaling skipped updates leave the weights untouched. Without it, a non-finite loss is not
        saved either, in case its update has not shown in the weights yet.
        """
        return self.dynamic or not self.nonfinite_streak

    def loss_scale_health(self, final_scale: float | None) -> dict:
        """The run's loss-scale summary for metrics.json (this process's steps for min and warnings)."""
        state = self.state
        return {
            "final": final_scale,
            "min": self.min_scale if self.min_scale is not None else final_scale,
            "skipped_steps": state.skipped_steps,
            "skipped_share": round(state.skipped_steps / state.global_step, 4) if state.global_step else 0.0,
            "warnings": list(self.health_warnings),
        }

    def _check(self, scale: float | None, loss: float, weights_finite: Callable[[], bool] | None) -> None:
        # Without dynamic scaling an inf/NaN gradient is applied (docs/keras3-mixed-precision.md §2). Keras'
        # cross-entropy clips its input and ReLU maps NaN to 0 on CPU, so the loss can stay finite while the
        # weights are already NaN. The weights are checked when asked, the rest on every step.
        if weights_finite is not None:
            if not bool(weights_finite()):
                raise TrainingError(self._stopped(
                    scale, "the weights became non-finite (an update with inf/NaN gradients was applied at step "
                    f"{self._weights_checked_at + 1} or later; the running loss is {loss:.4g})"))
            self._weights_checked_at = self.state.global_step
        if self.nonfinite_streak >= self.max_nonfinite_steps:
            raise TrainingError(self._stopped(
                scale, f"{self.nonfinite_streak} consecutive steps with a non-finite loss or gradients "
                f"(train.max_nonfinite_steps is {self.max_nonfinite_steps})"))
        if self.dynamic and scale < self.min_loss_scale:
            raise TrainingError(self._stopped(
                scale, f"the dynamic loss scale collapsed to {scale:g} (below {self.min_loss_scale:g}) after "
                f"{self.state.skipped_steps} skipped steps, {self.nonfinite_streak} of them in a row"))

    def _stopped(self, scale: float | None, reason: str) -> str:
        """The one-line TrainingError message; scale is the loss scale now (read after the step)."""
        state = self.state
        checkpoint = self._published_checkpoint()
        last = (f"last finite loss {self.last_finite[1]:.4g} at step {self.last_finite[0]}" if self.last_finite
                else "no finite loss yet")
        kept = (f"the last good checkpoint is kept: {checkpoint} (re-running resumes from it)"
                if checkpoint else "no checkpoint was written yet")
        return (f"training stopped at step {state.global_step} (epoch {state.epoch + 1}, batch {state.step_in_epoch} "
                f"of {self.steps_per_epoch}): {reason}; {last}; loss scale now "
                f"{'none' if scale is None else f'{scale:g}'}; {kept}. Check the data for NaN/inf values, lower "
                "train.learning_rate, or train under precision.policy mixed_bfloat16 or float32")

    def _watch_health(self, scale: float | None, skipped: bool) -> None:
        """Warns, once per condition, when dynamic loss scaling is struggling but training goes on."""
        if not self.dynamic or scale is None:
            return
        self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)
        if self.state.global_step > HEALTH_WARMUP_STEPS:
            self._steps_after_warmup += 1
            self._skipped_after_warmup += skipped
        share = self._skipped_after_warmup / max(self._steps_after_warmup, 1)
        if self._steps_after_warmup >= HEALTH_WARMUP_STEPS and share > self.max_skipped_share:
            self._warn("skipped_share", (
                f"{share:.0%} of the steps after the first {HEALTH_WARMUP_STEPS} were skipped for inf/NaN gradients "
                f"({self._skipped_after_warmup} of {self._steps_after_warmup}; precision.max_skipped_share is "
                f"{self.max_skipped_share:g}), so those batches do not train the model. Likely cause: values that "
                "overflow float16 (max 65504): unnormalized inputs or large activations. Fix: set model.normalize "
                "true, add the overflowing layers to precision.float32_layers, lower train.learning_rate, or train "
                "under precision.policy mixed_bfloat16"))
        if scale < self.low_loss_scale:
            self._warn("low_scale", (
                f"the dynamic loss scale fell to {scale:g} (below {self.low_loss_scale:g}) at step "
                f"{self.state.global_step}: small gradients now underflow in float16, and below 1 training stops. "
                "Likely cause: activations or gradients that overflow float16 even unscaled. Fix: set "
                "model.normalize true, add the overflowing layers to precision.float32_layers, or train under "
                "precision.policy mixed_bfloat16"))

    def _warn(self, condition: str, message: str) -> None:
        if condition not in self._warned:
            self._warned.add(condition)
            self.health_warnings.append(message)
            log.warning("loss scale: %s", message)
