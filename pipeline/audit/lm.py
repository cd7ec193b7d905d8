"""The audit's task for a language model's request log: each logged `generate` call teacher-forced through the
served SavedModel's serving_default and through the reference, and compared at every generated step.

A logged generate call (serving/request_log.py; docs/serving.md#generation) holds the prompts, the settings and
what the server answered: ids [B, T], every token generated with the end-of-text id included, PAD after it.
Free-running text is never compared across precisions (pipeline/export/lm_parity.py: one near-tie flips and the
continuations part for good), so each row is rebuilt as the model saw it: BOS, the prompt's tokens kept as
generate keeps them (generate.prompt_ids: a prompt longer than the context keeps BOS and its last tokens), then
the generated ids. Fed whole to both models, every generated step is chosen from the same prefix in both. Per step:
    logits     max |served - reference| over the vocabulary, and the reference's largest magnitude (for the
               relative difference, as the export's teacher-forcing check measures it);
    agreement  the served model's argmax against the reference's (PAD and BOS masked, as generate masks them);
    replay     greedy calls only (temperature 0): how far the logged token's served logit is below the served
               model's best, as a share of that step's largest served logit. 0 when the log holds the served
               model's own choice; run.py holds it to the tolerance (a near-tie within it is rounding in the
               cached decode the server ran), so beyond it the log is not what the model says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.score import engine
from pipeline.audit import replay as rows_replay
from pipeline.audit.replay import Candidate, OutputRows, ReplayJob, ReplayResult

LOGITS = "logits"  # the per-step comparison's output name in the report
REPLAY = "replay"  # the greedy replay check's
GENERATE = "generate"  # the signature the server logs a generation as (pipeline/export/lm.py GENERATE_SIGNATURE)
INPUTS = ("prompts", "max_new_tokens", "temperature")


def tokenizer_of(metadata: dict[str, Any]):
    """The tokenizer a version's prompts were encoded with: the bytes one, or the sentencepiece or GPT-2 one its
    training run recorded (pipeline/lm/tokenizers.py). The one place the audit turns logged prompts into ids."""
    from pipeline.lm import tokenizers
    from pipeline.artifacts import DATA_DIR
    from pipeline.errors import DataError

    kind = ((metadata.get("language_model") or {}).get("tokenizer") or {}).get("kind", "bytes")
    if kind == "bytes":
        return tokenizers.BYTES
    run = Path((metadata.get("reference_of") or {}).get("run_dir") or "")
    found, path = tokenizers.read_recorded(kind, run / DATA_DIR)
    if found is None:
        raise DataError(f"{run / DATA_DIR}: no {path.name}; the audit encodes the logged prompts "
                        "with the tokenizer the run recorded (pass --run_dir where the run lies)")
    return found


def _load(path: str) -> Any:
    """A language model's SavedModel (served or reference) with the ops its pipeline.json names."""
    import tensorflow as tf

    from serving.servable import saved_model

    saved_model.load_op_libraries(saved_model.read_pipeline_json(Path(path)), path)
    return tf.saved_model.load(path)


def replay(job: ReplayJob) -> ReplayResult:
    """The task: every logged generate call of one log file, teacher-forced through the served version and its
    reference."""
    from serving.servable import saved_model

    result = ReplayResult(job.path)
    models = {version: (engine.cached(("lm", job.served[version]), lambda p=job.served[version]: _load(p)),
                        engine.cached(("lm", path), lambda p=path: _load(p)))
              for version, path in job.references.items()}
    facts = {version: saved_model.read_pipeline_json(Path(path)) or {} for version, path in job.references.items()}
    tokenizers = {version: tokenizer_of(metadata) for version, metadata in facts.items()}
    for index, raw in enumerate(rows_replay.records(job.path)):
        log = rows_replay.parse(job.path, index, raw)
        kind = log.WhichOneof("log_type")
        version = rows_replay.answered_by(log, kind)[1] or job.default_version
        if kind != "predict_log" or log.predict_log.request.model_spec.signature_name != GENERATE:
            result.skipped[f"{kind or 'empty'} (not a generate call)"] += 1
        elif version not in models:
            result.skipped[f"version {version} (not audited)"] += 1
        else:
            call = generate_call(log.predict_log, tokenizers[version],
                                 int(facts[version]["language_model"]["context_length"]))
            if isinstance(call, str):
                result.skipped[call] += 1
                continue
            served, reference = (_logits(model, call["ids"]) for model in models[version])
            _compare(job, result, index, raw, version, call, served, reference, tokenizers[version])
    return result


def generate_call(logged: Any, tokenizer, context: int) -> dict[str, Any] | str:
    """A logged generate call as the rows to teacher-force: {"ids": int32 [B, longest] (BOS + kept prompt tokens +
    generated ids, PAD after), "starts": where each row's first generated token's logits are (its prompt's length,
    BOS included, minus 1), "generated": each row's generated ids (up to and including its end), "greedy"}; or why
    it cannot be replayed."""
    import tensorflow as tf

    from pipeline.lm import generate
    from serving.servable import tensors

    missing = [name for name in INPUTS if name not in logged.request.inputs] + (
        [] if "ids" in logged.response.outputs else ["ids"])
    if missing:
        return f"a generate call without {missing[0]!r}"
    try:
        inputs = {name: tensors.to_ndarray(logged.request.inputs[name], name) for name in INPUTS}
        ids = tensors.to_ndarray(logged.response.outputs["ids"], "ids")
    except Exception as error:  # noqa: BLE001 - a tensor this audit cannot read is counted, as the rows replay does
        return f"unreadable generate tensors: {type(error).__name__}"
    if inputs["max_new_tokens"].size != 1 or inputs["temperature"].size != 1:
        return "max_new_tokens or temperature is not a scalar"
    prompts = inputs["prompts"].reshape(-1)
    if ids.ndim != 2 or len(ids) != len(prompts):
        return "response ids are not [prompts, tokens]"
    if ids.size and not (0 <= ids.min() and ids.max() < tokenizer.vocab_size):
        return f"response ids outside the vocabulary (0..{tokenizer.vocab_size - 1})"
    max_new = int(np.clip(int(inputs["max_new_tokens"]), 0, context - 1))
    kept, lengths = (t.numpy() for t in generate.prompt_ids(tf.constant(prompts, tf.string), context - max_new,
                                                            tokenizer))
    generated = [row[:int(np.argmax(row == tokenizer.pad))] if (row == tokenizer.pad).any() else row
                 for row in ids.astype(np.int32)]
    if any(int(n) + len(g) > context for n, g in zip(lengths, generated)):
        return "longer than the context (prompt + generated ids)"
    width = max(int(n) + len(g) for n, g in zip(lengths, generated))
    forced = np.full((len(prompts), max(width, 1)), tokenizer.pad, np.int32)
    for i, (n, g) in enumerate(zip(lengths, generated)):
        forced[i, :n] = kept[i, :n]
        forced[i, n:n + len(g)] = g
    return {"ids": forced, "starts": lengths - 1, "generated": generated,
            "greedy": float(inputs["temperature"]) <= 0}


def _logits(model: Any, ids: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    return model.signatures["serving_default"](ids=tf.constant(ids))["logits"].numpy()


def _compare(job: ReplayJob, result: ReplayResult, index: int, raw: bytes, version: int, call: dict[str, Any],
             served: np.ndarray, reference: np.ndarray, tokenizer) -> None:
    result.replayed += 1
    result.rows += len(call["generated"])
    rows = result.outputs.setdefault((version, LOGITS), OutputRows())
    never = list(tokenizer.never_generated)
    for row, (start, generated) in enumerate(zip(call["starts"], call["generated"])):
        if not len(generated):
            continue
        steps = start + np.arange(len(generated))
        a, b = served[row, steps].astype(np.float64), reference[row, steps].astype(np.float64)
        abs_diff = np.abs(a - b).max(axis=1)
        rows.abs_diff.append(abs_diff)
        rows.ref_max.append(np.abs(b).max(axis=1))
        rows.sum_abs += float(np.abs(a - b).sum())
        rows.values += a.size
        a[:, never], b[:, never] = -np.inf, -np.inf
        chosen, wanted = a.argmax(axis=1), b.argmax(axis=1)
        rows.agree.append(chosen == wanted)
        rows_replay.keep(result.candidates.setdefault((version, LOGITS), []), job.reproducers,
                          Candidate(float(abs_diff.max()), job.path, index, row, version, LOGITS, chosen.tolist(),
                                    wanted.tolist(), raw, int(abs_diff.argmax())))
        if call["greedy"]:
            gaps = (a.max(axis=1) - a[np.arange(len(generated)), generated]) / np.abs(served[row, steps]).max(axis=1)
            result.greedy.setdefault(version, []).append(gaps)
            if gaps.max() > 0:
                rows_replay.keep(result.candidates.setdefault((version, REPLAY), []), job.reproducers,
                                  Candidate(float(gaps.max()), job.path, index, row, version, REPLAY,
                                            [int(t) for t in generated], chosen.tolist(), raw,
                                            int(np.nan_to_num(gaps, nan=np.inf).argmax())))
