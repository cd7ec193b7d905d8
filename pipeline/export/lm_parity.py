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
    stepped          the SavedModel driven a token at a time through its decode protocol (prefill, decode_step), as
                     python -m serving streams it: the same greedy tokens as its own generate.
    frozen weights   the same steps in a child process under oneDNN's frozen weights, a server's option (frozen_check.py): each
                     row's log-probabilities up to and including its first differing token within
                     FROZEN_LOG_PROB_TOLERANCE of the serving compute dtype's. A near-tie may flip a token (the
                     top log-probability is continuous in the logits, the argmax is not); the text after a flip
                     is not compared.

Free-running text is never compared across precisions: one rounding flips a near-tie and the continuations part
for good, which says nothing about the model. The serving policy's greedy agreement with float32 over the first
AGREEMENT_STEPS steps is recorded for a person to read, not judged, measured two ways (record_agreement):
    same_prefix      at each step of float32's greedy continuation, the token the serving model chooses when fed
                     the same prefix (teacher forcing on float32's tokens): the serving policy's own greedy choice,
                     step by step, unaffected by an earlier step's flip;
    free_running     the serving model's own greedy continuation against float32's, token by token: after the first
                     flip the two continue from different text, so one near-tie counts for every step after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from pipeline.lm import causal_lm, generate, tokenizers
from pipeline.precision import Tolerance

CACHE_TOKENS = 64  # greedy tokens the cache is held to (fewer when the context is shorter)
CACHE_LOG_PROB_TOLERANCE = 1e-5
# The frozen-weights check's bound by the serving compute dtype (measured: docs/large-models.md#decode).
FROZEN_LOG_PROB_TOLERANCE = {"float32": 1e-5, "float16": 0.05, "bfloat16": 0.05}
PROMPT_BYTES = 8  # each prompt: the first bytes of a validation window
PROMPTS = 4
AGREEMENT_STEPS = 32  # the recorded (not judged) greedy agreement with float32
AGREEMENT_PROMPTS = 32  # its prompts: one per teacher-forced validation window
LOGIT_ROWS = 8  # windows (prompts) per teacher-forced call (chunked_logits) and recorded greedy call (chunked_greedy)


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

    def stepped(self, stepped: dict[str, np.ndarray], whole: dict[str, np.ndarray], tokens: int) -> None:
        """The SavedModel stepped through prefill and decode_step, a token at a time as a server does
        (docs/serving.md#generation), against its own generate signature: the same greedy tokens."""
        same = bool(np.array_equal(stepped["ids"], whole["ids"]))
        problems = [] if same else [differing_step(stepped["ids"], whole["ids"])]
        self._add("stepped", "saved_model prefill + decode_step", "saved_model generate",
                  f"{tokens} greedy tokens identical", problems,
                  {"tokens": tokens, "prompts": len(stepped["ids"]), "identical_tokens": same,
                   "max_log_prob_diff": max_diff(stepped["log_probs"], whole["log_probs"])})

    def frozen_weights(self, frozen: dict[str, np.ndarray], stepped: dict[str, np.ndarray], tokens: int,
                       compute_dtype: str) -> None:
        """The SavedModel stepped under TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 in a process of its own against the same
        steps here: log-probabilities within the compute dtype's bound up to and including each row's first
        differing token (the module docstring)."""
        bound = FROZEN_LOG_PROB_TOLERANCE[compute_dtype]
        differs = frozen["ids"] != stepped["ids"]
        first = np.where(differs.any(axis=1), differs.argmax(axis=1), differs.shape[1])
        compared = np.arange(differs.shape[1])[None, :] <= first[:, None]
        diff = max_diff(frozen["log_probs"][compared], stepped["log_probs"][compared])
        problems = [] if diff <= bound else [f"log-probabilities differ by {diff:.3g} > {bound:g} up to each "
                                             "prompt's first differing token"]
        self._add("frozen weights", "saved_model stepped, TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1",
                  "saved_model stepped", f"log-probabilities within {bound:g} up to each prompt's first differing "
                  f"token ({compute_dtype})", problems,
                  {"tokens": tokens, "prompts": len(frozen["ids"]),
                   "identical_tokens": bool(not differs.any()), "max_log_prob_diff": diff,
                   "first_difference_steps": sorted(int(step) for step in first if step < differs.shape[1])})

    def record_agreement(self, policy: str, prompts: list[list[int]], float32: dict[str, np.ndarray],
                         free_running: dict[str, np.ndarray], same_prefix_logits: np.ndarray,
                         float32_logits: np.ndarray, tokenizer=tokenizers.BYTES) -> None:
        """The share of float32's greedy tokens (the first AGREEMENT_STEPS of each prompt's, up to its EOS) the
        serving policy chooses too, both ways of the module docstring (recorded, not judged): free_running its own
        greedy continuation (ids like float32's); same_prefix its choice from its teacher-forced logits on
        float32's continuation (teacher_forced_ids). float32_logits, float32's on the same ids, give the margin
        by which float32 preferred its token wherever the serving policy chose another. prompts: their token ids
        (prompt_tokens)."""
        reference = float32["ids"][:, :AGREEMENT_STEPS]
        steps = reference.shape[1]
        counted = reference != tokenizer.pad  # a row's tokens up to its EOS; padding after it is no choice
        same_prefix = greedy_choices(same_prefix_logits, prompts, steps, tokenizer)
        flips = counted & (same_prefix != reference)
        margins = top2_margins(float32_logits, prompts, steps, tokenizer)[flips]
        own = free_running["ids"][:, :steps]
        parted = np.where(counted & (own != reference), np.arange(steps), steps).min(axis=1)
        self.recorded["greedy_agreement_vs_float32"] = {
            "policy": policy, "steps": steps, "prompts": len(prompts), "tokens": int(counted.sum()), "judged": False,
            "same_prefix": {"agreement": share(~flips, counted), "disagreements": int(flips.sum()),
                            "float32_top2_margin_where_disagreeing": {
                                "max": float(margins.max()) if margins.size else None,
                                "median": float(np.median(margins)) if margins.size else None}},
            "free_running": {"agreement": share(own == reference, counted),
                             "identical_prompts": int(np.sum(parted == steps)),
                             "first_difference_steps": sorted(int(step) for step in parted if step < steps)}}

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
                         f"{agreement['steps']} steps of {agreement['prompts']} prompts (not judged): same prefix "
                         f"{agreement['same_prefix']['agreement']:.4f}, free-running "
                         f"{agreement['free_running']['agreement']:.4f}")
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


def stepped_greedy(signatures, prompts: list[bytes], max_new_tokens: int,
                   tokenizer=tokenizers.BYTES) -> dict[str, np.ndarray]:
    """Greedy generation driven from outside the graph through the decode protocol, as python -m serving drives it:
    prefill, then decode_step calls of 1, 2, 3, ... tokens, every row to max_new_tokens (ids and log-probs after a row's EOS are
    left as generate leaves them: PAD and 0)."""
    rows = len(prompts)
    settings = {"temperature": tf.zeros([rows]), "top_k": tf.zeros([rows], tf.int32),
                "seed": tf.zeros([rows], tf.int64), "row": tf.range(rows)}
    out = signatures[generate.PREFILL](prompts=tf.constant(prompts), max_new_tokens=tf.fill([rows], max_new_tokens),
                                       **settings)
    position = out["position"]
    ids, log_probs = [out["token"].numpy()[:, None]], [out["log_prob"].numpy()[:, None]]
    step = 1
    while step < max_new_tokens:  # calls of 1, 2, 3, ... tokens: every count the server may ask for
        steps = min(len(ids), max_new_tokens - step)
        caches = {name: tensor for name, tensor in out.items() if name.startswith(generate.CACHE_PREFIX)}
        last = out["token"] if out["token"].shape.rank == 1 else out["token"][:, -1]
        out = signatures[generate.DECODE_STEP](token=last, position=position + step - 1, step=tf.fill([rows], step),
                                               steps=tf.constant(steps), **settings, **caches)
        ids.append(out["token"].numpy())
        log_probs.append(out["log_prob"].numpy())
        step += steps
    ids, log_probs = np.concatenate(ids, axis=1), np.concatenate(log_probs, axis=1)
    eos = ids == tokenizer.eos
    ended = np.cumsum(eos, axis=1) - eos > 0  # after a row's EOS
    return {"ids": np.where(ended, tokenizer.pad, ids), "log_probs": np.where(ended, 0.0, log_probs)}


def prompt_tokens(prompts: list[bytes], tokenizer=tokenizers.BYTES) -> list[list[int]]:
    """Each prompt's token ids, as generate encodes it (without BOS; the prompts here are short enough to keep whole;
    the bytes tokenizer's are the prompt's bytes)."""
    ids, lengths = tokenizer.encode_padded(prompts)
    return [row[:n].tolist() for row, n in zip(ids.numpy(), lengths.numpy())]


def teacher_forced_ids(prompts: list[list[int]], continuations: np.ndarray, tokenizer=tokenizers.BYTES) -> np.ndarray:
    """int32 [prompts, 1 + longest prompt + steps]: BOS, each prompt's tokens (prompt_tokens) and its continuation's
    ids (a greedy generation's), right-padded with PAD. Fed to a model, position len(prompt) + s holds the logits its
    greedy step s chose from (generate's prompt layout; causal, so the padding after a row changes nothing)."""
    rows = [[tokenizer.bos, *prompt, *ids] for prompt, ids in zip(prompts, continuations.tolist())]
    out = np.full((len(rows), max(map(len, rows))), tokenizer.pad, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def step_logits(logits: np.ndarray, prompts: list[list[int]], steps: int, tokenizer=tokenizers.BYTES) -> np.ndarray:
    """[prompts, steps, vocab]: the logits of teacher_forced_ids' rows at each continuation step, the ids that are
    never generated (PAD, BOS) masked out as generate.choose masks them."""
    positions = np.array([len(prompt) for prompt in prompts])[:, None] + np.arange(steps)[None, :]
    chosen = np.take_along_axis(logits, positions[..., None], axis=1).astype(np.float64)
    chosen[..., list(tokenizer.never_generated)] = -np.inf
    return chosen


def greedy_choices(logits: np.ndarray, prompts: list[list[int]], steps: int, tokenizer=tokenizers.BYTES) -> np.ndarray:
    """int [prompts, steps]: the greedy token at each continuation step of teacher-forced logits."""
    return step_logits(logits, prompts, steps, tokenizer).argmax(-1)


def top2_margins(logits: np.ndarray, prompts: list[list[int]], steps: int, tokenizer=tokenizers.BYTES) -> np.ndarray:
    """[prompts, steps]: how far the best logit is above the second best at each continuation step."""
    top2 = np.sort(step_logits(logits, prompts, steps, tokenizer), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def share(agreeing: np.ndarray, counted: np.ndarray) -> float:
    """The share of the counted entries that agree (1.0 when none are counted)."""
    return float(np.sum(agreeing & counted) / counted.sum()) if counted.any() else 1.0


def differing_step(a: np.ndarray, b: np.ndarray) -> str:
    """Where two generations' ids (same shape) part: the first step (column) that differs."""
    return f"greedy tokens differ from step {int(np.argmax(np.any(a != b, axis=0)))}"


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0


def record_agreement(gate: Gate, float32: generate.Generator, served: generate.Generator, windows: np.ndarray,
                     policy: str) -> None:
    """Gate.record_agreement on AGREEMENT_PROMPTS prompts cut from the windows: float32's greedy continuation
    (AGREEMENT_STEPS tokens, fewer if the context is shorter), the serving model's own, and both models'
    teacher-forced logits on float32's."""
    tokenizer = float32.tokenizer
    prompts = prompts_of(windows, tokenizer, AGREEMENT_PROMPTS)
    steps = min(AGREEMENT_STEPS, new_tokens(causal_lm.context_length(float32.model), prompts))
    reference = chunked_greedy(float32.generate, prompts, steps)
    tokens = prompt_tokens(prompts, tokenizer)
    forced = teacher_forced_ids(tokens, reference["ids"], tokenizer)
    gate.record_agreement(policy, tokens, reference, chunked_greedy(served.generate, prompts, steps),
                          logits(served, forced), logits(float32, forced), tokenizer)


def chunked_greedy(generate_fn, prompts: list[bytes], max_new_tokens: int) -> dict[str, np.ndarray]:
    """greedy, LOGIT_ROWS prompts a call: each call holds a key/value cache over the whole context per row (a large
    model's float32 cache for 32 rows is 600 MB)."""
    parts = [greedy(generate_fn, prompts[start:start + LOGIT_ROWS], max_new_tokens)
             for start in range(0, len(prompts), LOGIT_ROWS)]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def logits(generator: generate.Generator, windows: np.ndarray) -> np.ndarray:
    """A Generator's teacher-forced logits (the graph serving_default computes) on the windows."""
    return chunked_logits(lambda ids: generator.logits(ids)["logits"], windows)


def chunked_logits(serving_default, windows: np.ndarray) -> np.ndarray:
    """serving_default(ids) → logits, LOGIT_ROWS windows a call: the attention scores of a large model over all the
    windows at once would be the gate's largest allocation (32 × 12 heads × 256² float32: 100 MB per block). Every
    path is called in the same chunks, so the same graph gives the same bits."""
    return np.concatenate([serving_default(tf.constant(windows[start:start + LOGIT_ROWS], tf.int32)).numpy()
                           for start in range(0, len(windows), LOGIT_ROWS)])
