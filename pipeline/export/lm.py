"""`python -m pipeline export` for a language model (model.kind causal_lm): the version holds generate.save's
SavedModel (serving_default: int32 ids → float32 logits; generate: strings in, strings out, the key/value cache
inside), checked by the language-model parity gate (lm_parity.py) and published by the same atomic rename as every
other kind, so a server polling the base path never sees a half-written or unchecked version.

export.serving_policy applies as for the other kinds: the trained weights are rebuilt under the serving policy
(float16/bfloat16 store them in that dtype, embeddings included, except the norms pinned to float32), and the
key/value cache is kept in that policy's compute dtype.
"""

from __future__ import annotations

import gc
import logging
import platform
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from pipeline import artifacts, data, models, precision
from pipeline.lm import causal_lm, generate, tokenizers
from pipeline.artifacts import DATA_DIR, METRICS_FILE, MODEL_FILE, PARITY_JSON, PARITY_REJECTED_FILE
from pipeline.config import Config
from pipeline.errors import DataError, ExportError
from pipeline.export import frozen_check, lm_parity, metadata, signatures
from pipeline.export.signatures import SIGNATURE
from pipeline.train import memory, samples
from serving import frozen_weights
from serving.servable import saved_model
from serving.servable.warmup import WARMUP_FILE

log = logging.getLogger(__name__)

GENERATE_SIGNATURE = "generate"
SIGNATURES = (SIGNATURE, GENERATE_SIGNATURE) + signatures.DECODE_PROTOCOL  # docs/serving.md#generation
WINDOWS = 32  # validation windows the teacher-forced check runs (the first ones: the same for every export)


def export_lm(cfg: Config, run_cfg: Config, recorded_config: dict) -> Path:
    """Exports the finished causal_lm run; returns the published version directory."""
    trained_policy = precision.restore_trained_policy(run_cfg.precision, cfg.run_dir)
    model = models.load_trained_model(cfg.run_dir / MODEL_FILE, run_cfg.model, run_cfg.precision.float32_layers,
                                      run_cfg.precision.float16_layers)
    datasets = data.load_datasets(run_cfg.data, seed=run_cfg.seed, recorded=_recorded_tokenizer(cfg, run_cfg))
    tokenizer = datasets.tokenizer
    windows, targets = datasets.validation_rows(WINDOWS)
    policy = precision.resolve_serving_policy(cfg.export.serving_policy, trained_policy)
    context = causal_lm.context_length(model)
    float32 = rebuild(model, run_cfg, datasets, "float32")
    exported_from = "trained" if policy.name == trained_policy.name else "serving"

    # Each model is let go once its checks are made, so the gate holds at most two copies of the weights at a time
    # (docs/large-models.md#export): the trained model, then the serving rebuild, beside the float32 twin.
    gate = lm_parity.Gate(trained_policy=trained_policy.name, serving_policy=policy.name,
                          parity_tolerance=cfg.export.parity_tolerance, windows=len(windows))
    generators = {"trained": generate.Generator(model, tokenizer=tokenizer),
                  "float32": generate.Generator(float32, tokenizer=tokenizer)}
    tf_logits = {path: lm_parity.logits(generators[path], windows) for path in ("trained", "float32")}
    gate.teacher_forcing("trained", tf_logits["trained"], "float32", tf_logits["float32"], targets,
                         precision.tolerance(trained_policy.name, cfg.export.tolerances))
    if exported_from == "serving":
        # the float32 twin holds the trained weights exactly (the training policies keep float32 variables)
        del generators["trained"], model
        _let_go()
        served = rebuild(float32, run_cfg, datasets, policy.name)
        generators["serving"] = generate.Generator(served, tokenizer=tokenizer)
        tf_logits["serving"] = lm_parity.logits(generators["serving"], windows)
        gate.teacher_forcing("serving", tf_logits["serving"], "float32", tf_logits["float32"], targets,
                             precision.tolerance(policy.name, cfg.export.tolerances))
    else:
        served, generators["serving"] = model, generators.pop("trained")
        del model
    prompts = lm_parity.prompts_of(windows, tokenizer)
    tokens = lm_parity.new_tokens(context, prompts)
    float32_greedy = lm_parity.greedy(generators["float32"].generate, prompts, tokens)
    gate.cache(float32_greedy, lm_parity.greedy(generate.recompute_generate(float32, tokenizer), prompts, tokens),
               tokens)
    served_greedy = lm_parity.greedy(generators["serving"].generate, prompts, tokens)
    lm_parity.record_agreement(gate, generators["float32"], generators["serving"], windows, policy.name)
    facts = language_model_facts(served, tokenizer)
    del generators["float32"], float32
    _let_go()

    base = cfg.model_base_path
    version = metadata.version_to_publish(cfg)
    with artifacts.atomic_dir(base / str(version)) as tmp:
        generate.save(generators["serving"], tmp)
        del generators, served  # from here on the SavedModel is what is checked
        _let_go()
        _check_saved_model(tmp, policy, tokenizer)
        log.info("stepping the SavedModel under %s=1 (a server's switch) in a child process", frozen_weights.VARIABLE)
        started = time.monotonic()
        frozen = frozen_check.stepped(tmp, prompts, tokens, tokenizer)  # before this process loads it: one copy
        log.info("stepped in %.1f s; checking the SavedModel here", time.monotonic() - started)
        loaded = tf.saved_model.load(str(tmp))
        served_logits = lm_parity.chunked_logits(lambda ids: loaded.signatures[SIGNATURE](ids=ids)["logits"], windows)
        gate.teacher_forcing("saved_model", served_logits, exported_from, tf_logits[exported_from], targets)
        saved_greedy = lm_parity.greedy(loaded.signatures[GENERATE_SIGNATURE], prompts, tokens)
        gate.generate(saved_greedy, served_greedy, exported_from, tokens)
        stepped = lm_parity.stepped_greedy(loaded.signatures, prompts, tokens, tokenizer)
        gate.stepped(stepped, saved_greedy, tokens)
        gate.frozen_weights(frozen, stepped, tokens, policy.compute_dtype)
        log.info("language-model parity gate on %d validation windows and %d prompts:\n%s", len(windows),
                 len(prompts), gate.summary())
        if not gate.passed:
            rejected = cfg.run_dir / PARITY_REJECTED_FILE
            artifacts.write_json_atomic(rejected, gate.report())
            raise ExportError(f"parity gate failed: {'; '.join(gate.failures())}; nothing was published "
                              f"(report: {rejected})")
        sample = _sample(loaded, context, tokenizer)
        signatures.write_generate_warmup(tmp / WARMUP_FILE, cfg.export.model_name, sample["prompt"].encode(),
                                         min(4, sample["max_new_tokens"]))
        artifacts.write_json_atomic(tmp / saved_model.PIPELINE_JSON,
                                    _metadata(tmp, cfg, version, (trained_policy, policy), gate, facts, sample,
                                              tokenizer, recorded_config))
        artifacts.write_json_atomic(tmp / PARITY_JSON, gate.report())
    published = base / str(version)
    log.info("exported %s version %d (trained %s, serving %s, weights %s, key/value cache %s; parity report %s) → %s",
             cfg.export.model_name, version, trained_policy.name, policy.name,
             saved_model.describe_bytes(saved_model.weights_by_dtype(published)), facts["kv_cache"]["dtype"],
             PARITY_JSON, published)
    return published


def _let_go() -> None:
    """Frees the models just dropped now (their tf.functions hold them in reference cycles) and hands the memory back
    to the system: glibc keeps freed blocks of a size it has seen freed before in its heap (docs/large-models.md#export)."""
    gc.collect()
    memory.release_free_memory()


def _recorded_tokenizer(cfg: Config, run_cfg: Config) -> Path | None:
    """The run's data directory, where a sentencepiece or GPT-2 tokenizer was stored at training: the model's ids
    are its ids, so the export never trains or reads another (a DataError when it is missing)."""
    if run_cfg.data.tokenizer == "bytes":
        return None
    directory = cfg.run_dir / DATA_DIR
    found, path = tokenizers.read_recorded(run_cfg.data.tokenizer, directory)
    if found is None:
        raise DataError(f"{path}: not found; the run's {run_cfg.data.tokenizer} tokenizer is written "
                        "there when it trains (make train)")
    return directory


def rebuild(model: keras.Model, run_cfg: Config, datasets: data.Datasets, policy: str) -> keras.Model:
    """The trained weights in the same architecture built under policy (float16/bfloat16: rounded to it)."""
    with precision.policy_scope(policy):
        return models.rebuild(model, run_cfg.model, datasets.spec, datasets.statistics,
                              run_cfg.precision.float32_layers, run_cfg.precision.float16_layers)


def _check_saved_model(path: Path, policy: precision.PolicyInfo, tokenizer) -> None:
    """Core ops only (stock tensorflow_model_server loads it), and a sentencepiece tokenizer's TF Text ops only in
    its export; no reduced-precision signature tensors, weights in the serving policy's variable dtype."""
    extra = sorted(generate.saved_model_op_types(path) - generate.SERVING_OPS - tokenizer.graph_ops)
    if extra:
        allowed = "the core set tensorflow_model_server runs" + (
            f" and the {tokenizer.kind} tokenizer's" if tokenizer.graph_ops else "")
        raise ExportError(f"the generate SavedModel holds ops outside {allowed}: {', '.join(extra)}; nothing was "
                          "published")
    defs = saved_model.read_signature_defs(path)
    wrong = [f"{name}: {problem}" for name in SIGNATURES
             for problem in signatures.signature_problems(name, defs[name], token_ids=True)]
    if wrong:
        raise ExportError(f"{'; '.join(wrong)}; nothing was published")
    problem = saved_model.weights_problem(policy.to_dict(), saved_model.weights_by_dtype(path))
    if problem:
        raise ExportError(f"{problem}; nothing was published")


def _sample(loaded, context_length: int, tokenizer) -> dict:
    """The SavedModel's greedy completion of the training samples' prompt (the tokenizer's sample_prompt): verify
    and the demo ask it again."""
    prompt = tokenizer.sample_prompt
    tokens = max(1, min(samples.NEW_TOKENS, context_length - 1 - len(prompt.encode())))
    out = lm_parity.greedy(loaded.signatures[GENERATE_SIGNATURE], [prompt.encode()], tokens)
    return {"prompt": prompt, "max_new_tokens": tokens, "temperature": 0.0,
            "completion": out["completions"][0].decode("utf-8", errors="replace"),
            "ids": out["ids"][0, :out["lengths"][0]].tolist()}


def language_model_facts(model: keras.Model, tokenizer=tokenizers.BYTES) -> dict:
    """What a client and a capacity plan need: the tokenizer, the context, the key/value cache's dtype and size."""
    blocks = causal_lm.blocks(model)
    dtype = causal_lm.cache_dtype(model)
    width = blocks[0].attention.num_heads * blocks[0].attention.head_dim
    bytes_per_token = 2 * len(blocks) * width * np.dtype(tf.as_dtype(dtype).as_numpy_dtype).itemsize  # keys, values
    context = causal_lm.context_length(model)
    return {"tokenizer": tokenizer.facts(),
            "context_length": context,
            "kv_cache": {"dtype": dtype, "layers": len(blocks), "width": width, "bytes_per_token": bytes_per_token,
                         "bytes_per_sequence": bytes_per_token * context}}


def _metadata(tmp: Path, cfg: Config, version: int, policies: tuple[precision.PolicyInfo, precision.PolicyInfo],
              gate: lm_parity.Gate, facts: dict, sample: dict, tokenizer, recorded_config: dict) -> dict:
    """assets.extra/pipeline.json of a language model's version (docs/export.md#language-models); op_libraries:
    the Python modules whose ops the graph needs beyond core TensorFlow, which `python -m serving` imports before it
    loads the version (serving/servable/saved_model.py)."""
    defs = saved_model.read_signature_defs(tmp)
    by_path = {check["path"]: check for check in gate.checks}
    same_graph, vs_float32 = by_path["saved_model"], by_path.get("serving", by_path["trained"])
    return {
        **metadata.version_header(cfg, version, policies, tmp),
        "signatures": {name: signatures.tensor_specs(defs[name]) for name in SIGNATURES},
        "task": "language_model",
        "label_names": [],
        "language_model": {**facts, "sample": sample},
        saved_model.OP_LIBRARIES: list(tokenizer.op_libraries),
        "config": recorded_config,
        "metrics": artifacts.read_json(cfg.run_dir / METRICS_FILE),
        "parity": {"windows": gate.windows,
                   "max_abs_diff": same_graph["max_abs_diff"], "max_rel_diff": same_graph["max_rel_diff"],
                   "tolerance": gate.parity_tolerance,
                   "vs_float32": {key: vs_float32[key] for key in ("path", "max_abs_diff", "max_rel_diff",
                                                                   "argmax_agreement", "accuracy_drop", "tolerance")},
                   "cache": {key: by_path["float32 cached"][key]
                             for key in ("tokens", "identical_tokens", "max_log_prob_diff")},
                   "generate": {key: by_path["saved_model generate"][key] for key in ("tokens", "identical_tokens")},
                   **gate.recorded, "report": str(PARITY_JSON)},
        "run_dir": str(cfg.run_dir),
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
    }
