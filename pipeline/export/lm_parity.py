"""The parity gate of a language model's export (model.kind causal_lm): what parity means when the output is the
next token's logits at every position and the answer is generated one token at a time.

Checks, each one entry of the report (assets.extra/parity.json) and each failing the export in one clause:
    teacher forcing  the first validation windows through the trained model, its float32 twin, the serving rebuild
                     (when export.serving_policy is not the trained one) and the SavedModel's serving_default: the
                     float32 logits at every position. A reduced-precision path against float32 by its policy's
                     tolerance (export.tolerances.<policy>, precision.TOLERANCES): max rel diff (and max abs diff if
                     set) of the logits, the next-token argmax agreement over every position, the drop in next-byte
                     accuracy in points. The SavedModel against the Keras model it was exported from: within
                     export.parity_tolerance.
    cache            under float32, generation with the key/value cache against recomputing the whole sequence per
                     token (generate.recompute_generate): the same greedy tokens, log-probabilities within 1e-5.
    generate         the SavedModel's greedy `generate` on prompts cut from validation windows: the same tokens as
                     the in-process Generator of the model it was exported from (the same policy).

Free-running text is never compared across precisions: one rounding flips a near-tie and the continuations part
for good, which says nothing about the model. The serving policy's greedy agreement with float32 over the first
steps is recorded for a person to read, not judged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from pipeline import generate, tokenizers
from pipeline.precision import Tolerance

CACHE_TOKENS = 64  # greedy tokens the cache is held to (fewer when the context is shorter)
CACHE_LOG_PROB_TOLERANCE = 1e-5
PROMPT_BYTES = 8  # each prompt: the first bytes of a validation window
PROMPTS = 4
AGREEMENT_STEPS = 32  # the recorded (not judged) greedy agreement with float32


def prompts_of(windows: np.ndarray, tokenizer=tokenizers.BYTES, count: int = PROMPTS,
               size: int = PROMPT_BYTES) -> list[bytes]:
    """Prompts from the first windows: the text of their first ids (special ids left out), its first `size` bytes."""
    return [text[:size] for text in tokenizer.decode(windows[:count, :size + 1]).numpy().tolist()]


def new_tokens(context_length: int, prompts: list[bytes]) -> int:
    """CACHE_TOKENS, or as many as fit after BOS and the longest prompt."""
    return max(1, min(CACHE_TOKENS, context_length - 1 - max(map(len, prompts))))


def greedy(generate_fn, prompts: list[bytes], max_new_tokens: int) -> dict[str, np.ndarray]:
    """A generate function (in-process or a SavedModel's signature) at temperature 0."""
    outputs = generate_fn(prompts=tf.constant(prompts), max_new_tokens=tf.constant(max_new_tokens, tf.int32),
                          temperature=tf.constant(0.0), top_k=tf.constant(0, tf.int32), seed=tf.constant(0, tf.int64))
    return {name: value.numpy() for name, value in outputs.items()}


class Gate:
    """Collects the checks as they are made; report() is parity.json, failures() the export's refusal."""

    def __init__(self, *, trained_policy: str, serving_policy: str, parity_tolerance: float, windows: int) -> None:
        self.policies = {"trained": trained_policy, "serving": serving_policy}
        self.parity_tolerance = parity_tolerance
        self.windows = windows
        self.checks: list[dict[str, Any]] = []
        self.recorded: dict[str, Any] = {}  # facts for a person, not judged

    def teacher_forcing(self, path: str, logits: np.ndarray, reference: str, reference_logits: np.ndarray,
                        targets: np.ndarray, tolerance: Tolerance | None = None) -> None:
        """path's logits against reference's on the same windows: by tolerance (a reduced-precision path against
        float32) or, without one, within export.parity_tolerance (the SavedModel against its Keras model)."""
        found = logit_differences(logits, reference_logits, targets)
        if tolerance is None:
            rule = f"max rel diff ≤ {self.parity_tolerance:g} (export.parity_tolerance)"
            problems = ([] if found["max_rel_diff"] <= self.parity_tolerance else
                        [f"max rel diff {found['max_rel_diff']:.3g} > {self.parity_tolerance:g} "
                         "(export.parity_tolerance)"])
        else:
            key = f"export.tolerances.{tolerance.policy}"
            rule = (f"max rel diff ≤ {tolerance.max_rel_diff:g}, next-token argmax agreement ≥ "
                    f"{tolerance.min_argmax_agreement:g}, next-byte accuracy drop ≤ {tolerance.max_metric_drop:g} pt "
                    f"({key})")
            problems = []
            if not found["max_rel_diff"] <= tolerance.max_rel_diff:  # `not <=`: NaN fails
                problems.append(f"max rel diff {found['max_rel_diff']:.3g} > {tolerance.max_rel_diff:g} "
                                f"({key}.max_rel_diff)")
            if tolerance.max_abs_diff is not None and not found["max_abs_diff"] <= tolerance.max_abs_diff:
                problems.append(f"max abs diff {found['max_abs_diff']:.3g} > {tolerance.max_abs_diff:g} "
                                f"({key}.max_abs_diff)")
            if not found["argmax_agreement"] >= tolerance.min_argmax_agreement:
                problems.append(f"next-token argmax agreement {found['argmax_agreement']:.4f} < "
                                f"{tolerance.min_argmax_agreement:g} ({key}.min_argmax_agreement)")
            if not found["accuracy_drop"] <= tolerance.max_metric_drop:
                problems.append(f"next-byte accuracy drop {found['accuracy_drop']:.3g} pt > "
                                f"{tolerance.max_metric_drop:g} ({key}.max_metric_drop)")
        self._add("teacher forcing", path, reference, rule, problems, found,
                  tolerance=None if tolerance is None else tolerance.to_dict())

    def cache(self, cached: dict[str, np.ndarray], recomputed: dict[str, np.ndarray], tokens: int) -> None:
        """Greedy generation with the cache against recomputing every step, both under float32."""
        same = bool(np.array_equal(cached["ids"], recomputed["ids"]))
        diff = max_diff(cached["log_probs"], recomputed["log_probs"])
        problems = [] if same else [differing_step(cached["ids"], recomputed["ids"])]
        if not diff <= CACHE_LOG_PROB_TOLERANCE:
            problems.append(f"log-probabilities differ by {diff:.3g} > {CACHE_LOG_PROB_TOLERANCE:g}")
        self._add("cache", "float32 cached", "float32 recomputed",
                  f"{tokens} greedy tokens identical, log-probabilities within {CACHE_LOG_PROB_TOLERANCE:g}",
                  problems, {"tokens": tokens, "prompts": len(cached["ids"]), "identical_tokens": same,
                             "max_log_prob_diff": diff})

    def generate(self, saved: dict[str, np.ndarray], in_process: dict[str, np.ndarray], exported_from: str,
                 tokens: int) -> None:
        """The SavedModel's greedy generate against the in-process Generator of the model it was exported from."""
        same = bool(np.array_equal(saved["ids"], in_process["ids"]))
        problems = [] if same else [differing_step(saved["ids"], in_process["ids"])]
        self._add("generate", "saved_model generate", exported_from, f"{tokens} greedy tokens identical", problems,
                  {"tokens": tokens, "prompts": len(saved["ids"]), "identical_tokens": same,
                   "max_log_prob_diff": max_diff(saved["log_probs"], in_process["log_probs"])})

    def record_agreement(self, served: dict[str, np.ndarray], float32: dict[str, np.ndarray], policy: str) -> None:
        """The share of the first AGREEMENT_STEPS greedy tokens the serving policy shares with float32 (recorded)."""
        steps = min(AGREEMENT_STEPS, served["ids"].shape[1])
        self.recorded["greedy_agreement_vs_float32"] = {
            "policy": policy, "steps": steps, "prompts": len(served["ids"]),
            "agreement": float(np.mean(served["ids"][:, :steps] == float32["ids"][:, :steps])),
            "judged": False}

    def _add(self, kind: str, path: str, reference: str, rule: str, problems: list[str], found: dict, **more) -> None:
        self.checks.append({"kind": kind, "path": path, "reference": reference, "rule": rule,
                            "passed": not problems, "problems": problems, **found, **more})

    @property
    def passed(self) -> bool:
        return all(check["passed"] for check in self.checks)

    def failures(self) -> list[str]:
        return [f"{c['path']} vs {c['reference']} ({c['kind']}): {'; '.join(c['problems'])}"
                for c in self.checks if not c["passed"]]

    def report(self) -> dict[str, Any]:
        return {"format": 1, "task": "language_model", "passed": self.passed, "policies": self.policies,
                "windows": self.windows, "parity_tolerance": self.parity_tolerance, "checks": self.checks,
                **self.recorded}

    def summary(self) -> str:
        """One line per check, for the export's log."""
        lines = []
        for c in self.checks:
            if c["kind"] == "teacher forcing":
                numbers = (f"max abs diff {c['max_abs_diff']:.3g}, max rel diff {c['max_rel_diff']:.3g}, argmax "
                           f"agreement {c['argmax_agreement']:.4f}, accuracy drop {c['accuracy_drop']:.3g} pt")
            else:
                numbers = (f"{c['prompts']} prompts x {c['tokens']} tokens identical {c['identical_tokens']}, max "
                           f"log-prob diff {c['max_log_prob_diff']:.3g}")
            lines.append(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['kind']:>15}  {c['path']} vs {c['reference']}: "
                         f"{numbers}")
        agreement = self.recorded.get("greedy_agreement_vs_float32")
        if agreement:
            lines.append(f"  INFO  {agreement['policy']} greedy tokens agreeing with float32 over the first "
                         f"{agreement['steps']} steps: {agreement['agreement']:.4f} (not judged)")
        return "\n".join(lines)


def logit_differences(logits: np.ndarray, reference: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Max abs diff, max rel diff (to the reference's largest magnitude), next-token argmax agreement over every
    position, and the next-byte accuracy lost against the targets, in points."""
    a, b = logits.astype(np.float64), reference.astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits of shape {a.shape} vs {b.shape}")
    worst = float(np.max(np.abs(a - b)))
    accuracy = float(np.mean(a.argmax(-1) == targets))
    reference_accuracy = float(np.mean(b.argmax(-1) == targets))
    return {"positions": int(targets.size), "max_abs_diff": worst,
            "max_rel_diff": worst / max(float(np.max(np.abs(b))), np.finfo(np.float32).tiny),
            "argmax_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "accuracy": accuracy, "accuracy_drop": (reference_accuracy - accuracy) * 100}


def differing_step(a: np.ndarray, b: np.ndarray) -> str:
    """Where two generations' ids (same shape) part: the first step (column) that differs."""
    return f"greedy tokens differ from step {int(np.argmax(np.any(a != b, axis=0)))}"


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0


def logits(generator: generate.Generator, windows: np.ndarray) -> np.ndarray:
    """A Generator's teacher-forced logits (the graph serving_default computes) on the windows."""
    return generator.logits(tf.constant(windows, tf.int32))["logits"].numpy()
