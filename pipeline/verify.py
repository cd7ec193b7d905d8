"""`python -m pipeline verify MODEL_DIR [--json]`: audits an exported version's graph and numbers.

One line per check, PASS, FAIL or SKIP, and a non-zero exit when any check fails:
  signatures   serving_default takes and returns float32 only; other signatures may carry DT_STRING
               (classification/regression parse tf.Examples and return label strings by design), but
               no signature may return float16 or bfloat16.
  compute ops  the serving graph's MatMul/Conv/BatchMatMul ops counted by dtype.
  policy       pipeline.json's serving policy (export.serving_policy; the training policy by default) agrees
               with the graph: its compute dtype is among those ops, and a float32 policy has no
               reduced-precision ones.
  weights      the stored variables by dtype agree with that policy's variable dtype: float16/bfloat16
               weights for export.serving_policy float16/bfloat16, and no reduced-precision weights under a
               policy with float32 variables.
  parity       the SavedModel against the training run's model.keras (pipeline.json's run_dir), loaded
               under the recorded policy (and rebuilt under the serving policy when that differs), on
               the export's golden held-out rows: max rel diff within export.parity_tolerance,
               and for classifiers argmax agreement 1.0. SKIP when the run directory is not there (a
               version copied to a serving host travels without its run).
  constants    that model (as served) has no epsilon or standardisation divisor below the smallest normal
               number of the dtype it is read in (pipeline/diagnose/constants.py: e.g. a 1e-7 variance floor
               read by a float16 layer), each FAIL naming the layer and the fix. SKIP without the run.
  input limits the SavedModel on rows with each feature at its limits in the training rows (pipeline.json's
               data config): each column's own min and max for tabular rows (an id column stays among its
               ids), the smallest and largest value of any feature for images; every output finite. SKIP when
               the data cannot be loaded here.
  far inputs   the same rows 100 training ranges beyond those limits (digits: -1600 and 1616; token ids:
               out of the vocabulary), what a broken client may send: every output finite, else WARN (no
               client should send them, so the version is not failed; the server counts such answers).
  images       (a model trained on an image folder: pipeline.json has predict_images) the first validation
               image files through predict_images answer exactly serving_default's outputs on the training
               pipeline's decode of the same files, bit for bit at the same batch size. SKIP when the data
               cannot be loaded here.
  hostile images  predict_images refuses, INVALID_ARGUMENT, bytes that are no image and a PNG and a JPEG
               header declaring more pixels than pipeline.json's max_image_pixels (the refusal must name
               the declared size: refused by the header check, not by a decode that was attempted).
A language model's export (pipeline.json task language_model) gets the checks that mean something for it:
  signatures   serving_default takes int32 token ids and returns float32 logits; generate returns no float16 or
               bfloat16; policy and weights as above.
  op set       every op type in the SavedModel is among generate.SERVING_OPS, the core ops stock
               tensorflow_model_server has (no XLA-only or tensorflow-text ops), and, where pipeline.json's
               tokenizer is sentencepiece, tokenizers.SENTENCEPIECE_OPS (TF Text's).
  runner       the version loads through serving's Runner (what python -m serving and its Predict run).
  generate     through that Runner, the greedy completion of pipeline.json's recorded sample prompt is the
               recorded one, token for token (the answer the parity gate passed).
A check that the model makes raise is that check's FAIL line: verify prints its report, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pipeline import data, models, precision
from pipeline.data import image_probes
from pipeline.config import WEIGHT_SECTIONS, ExportConfig, validate_config
from pipeline.artifacts import DATA_DIR, MODEL_FILE
from pipeline.diagnose.constants import constant_findings
from pipeline.diagnose.thresholds import FAR_BEYOND
from pipeline.export import parity, signatures
from pipeline.export.signatures import IMAGES_INPUT, IMAGES_SIGNATURE, SIGNATURE
from serving.servable import saved_model
from serving.servable.runner import Runner
from serving.errors import LoadError, SavedModelNotFound, op_error_text

PROBE_IMAGES = 8  # validation image files sent to predict_images


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, WARN (does not fail the version) or SKIP
    detail: str


@dataclasses.dataclass
class Report:
    path: str
    checks: list[Check] = dataclasses.field(default_factory=list)
    signatures: dict[str, Any] = dataclasses.field(default_factory=dict)
    compute_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    weights: dict[str, int] = dataclasses.field(default_factory=dict)
    policy: dict[str, Any] | None = None
    parity: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return all(check.status != "FAIL" for check in self.checks)

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, "SKIP" if ok is None else ("PASS" if ok else "FAIL"), detail))

    def warn(self, name: str, detail: str) -> None:
        """A finding that does not fail the version."""
        self.checks.append(Check(name, "WARN", detail))

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, **dataclasses.asdict(self)}

    def text(self) -> str:
        width = max(len(check.name) for check in self.checks)
        lines = [f"verify {self.path}"]
        lines += [f"{check.status:4}  {check.name:{width}}  {check.detail}" for check in self.checks]
        warnings = sum(check.status == "WARN" for check in self.checks)
        lines.append(f"FAILED: {sum(c.status == 'FAIL' for c in self.checks)} check(s) failed" if not self.ok else
                     f"OK: no check failed ({warnings} warning(s))" if warnings else "OK: every check passed")
        return "\n".join(lines)


def _files_text(version: Path) -> str:
    """The SavedModel's own files with their sizes, for a load failure: which one is short is then visible."""
    files = [version / "saved_model.pb", *sorted((version / "variables").glob("variables.*"))]
    return ", ".join(f"{path.relative_to(version)} {path.stat().st_size:,} bytes" for path in files if path.is_file())


def verify(path: str | Path) -> Report:
    """Audits a version directory (or the latest version under a model base path); never raises for a
    bad model, every problem becomes a FAIL line."""
    try:
        version = saved_model.version_path(Path(path))
    except SavedModelNotFound as error:
        report = Report(str(path))
        report.add("load", False, str(error))
        return report
    report = Report(str(version))
    metadata = saved_model.read_pipeline_json(version)  # a damaged one: the one-line error verify's caller prints
    try:
        saved_model.load_op_libraries(metadata, version)  # TF Text's, where the graph needs them
    except LoadError as error:
        report.add("load", False, str(error))
        return report
    try:
        meta_graph = saved_model.serving_meta_graph(version)
        loaded = None if saved_model.is_tf1(meta_graph) else tf.saved_model.load(str(version))
    except Exception as error:  # noqa: BLE001 - whatever TF raises is the finding
        report.add("load", False, f"{version} cannot be loaded ({type(error).__name__}: "
                   f"{str(error).splitlines()[0] if str(error) else 'no message'}): a file under it is damaged or "
                   f"truncated ({_files_text(version)}); export it again")
        return report
    report.add("load", True, "TF1 SavedModel" if loaded is None else "TF2 SavedModel")
    if (metadata or {}).get("task") == "language_model":
        _verify_language_model(report, version, meta_graph, metadata, loaded)
        return report
    _check_signatures(report, meta_graph)
    if loaded is not None and SIGNATURE in loaded.signatures:
        report.compute_ops = saved_model.count_compute_ops(loaded.signatures[SIGNATURE])
    else:
        report.compute_ops = saved_model.count_ops(meta_graph.graph_def)
    report.add("compute ops", bool(report.compute_ops) or None,
               f"{SIGNATURE} MatMul/Conv/BatchMatMul ops: {saved_model.describe_ops(report.compute_ops)}")
    if metadata is None:
        report.add("policy", None, f"no {saved_model.PIPELINE_JSON}: not exported by this pipeline")
        report.add("parity", None, "no pipeline.json, so no training run to compare with")
        return report
    report.policy = saved_model.serving_policy(metadata)
    _check_policy(report)
    _check_weights(report, version)
    if loaded is not None and SIGNATURE in loaded.signatures:
        served = _checked(report, "parity", _check_parity, report, metadata, loaded.signatures[SIGNATURE])
        if served is None:
            report.add("constants", None, "needs the training run's model (see parity)")
        else:
            _checked(report, "constants", _check_constants, report, served)
        datasets, missing = _training_data(metadata)
        _checked(report, "input limits", _check_input_limits, report, datasets, missing, loaded.signatures[SIGNATURE])
        if IMAGES_SIGNATURE in (metadata.get("signatures") or {}):
            _checked(report, "images", _check_images, report, loaded, datasets, missing)
            _checked(report, "hostile images", _check_hostile_images, report, loaded, metadata)
    else:
        report.add("parity", None, f"no TF2 {SIGNATURE} signature to run")
    return report


def _checked(report: Report, name: str, check, *args):
    """Runs one check; whatever the model or its files make it raise is that check's FAIL line, so verify never
    ends in a traceback (issue 23)."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - a model that breaks the check is the finding
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        report.add(name, False, f"{type(error).__name__}: {text[:300]}")
        return None


def _verify_language_model(report: Report, version: Path, meta_graph, metadata: dict, loaded) -> None:
    """The language model's checks (module docstring), each failure its own FAIL line."""
    _check_signatures(report, meta_graph, token_ids=True)
    if loaded is not None and SIGNATURE in loaded.signatures:
        report.compute_ops = saved_model.count_compute_ops(loaded.signatures[SIGNATURE])
    report.add("compute ops", bool(report.compute_ops) or None,
               f"{SIGNATURE} MatMul/Conv/BatchMatMul ops: {saved_model.describe_ops(report.compute_ops)}")
    report.policy = saved_model.serving_policy(metadata)
    _check_policy(report)
    _check_weights(report, version)
    _checked(report, "op set", _check_op_set, report, version, metadata)
    runner = _checked(report, "runner", Runner.load, version)
    if runner is None:
        report.add("generate", None, "needs the version loaded by serving's Runner (see runner)")
        return
    try:
        report.add("runner", True, f"loads through serving's Runner: {', '.join(runner.signature_names)}")
        _checked(report, "generate", _check_recorded_sample, report, runner, metadata)
    finally:
        runner.close()


def _check_op_set(report: Report, version: Path, metadata: dict) -> None:
    from pipeline.lm import generate, tokenizers

    kind = ((metadata.get("language_model") or {}).get("tokenizer") or {}).get("kind")
    tokenizer_ops, whose = {"sentencepiece": (tokenizers.SENTENCEPIECE_OPS, " and the sentencepiece tokenizer's (TF "
                                              "Text's, which stock tensorflow_model_server links in)"),
                            "gpt2": (tokenizers.GPT2_OPS, " and the GPT-2 tokenizer's (core ops too)")}.get(kind,
                                                                                                (frozenset(), ""))
    extra = sorted(generate.saved_model_op_types(version) - generate.SERVING_OPS - tokenizer_ops)
    report.add("op set", not extra, f"ops outside the core set tensorflow_model_server runs: {', '.join(extra)}"
               if extra else f"every op among the {len(generate.SERVING_OPS)} core ops of generate.SERVING_OPS"
               + whose)


def _check_recorded_sample(report: Report, runner: Runner, metadata: dict) -> None:
    sample = (metadata.get("language_model") or {}).get("sample")
    if not sample:
        report.add("generate", None, "pipeline.json records no sample completion")
        return
    outputs = runner.predict({"prompts": np.array([sample["prompt"].encode()], object),
                              "max_new_tokens": np.array(sample["max_new_tokens"], np.int32),
                              "temperature": np.array(0.0, np.float32), "top_k": np.array(0, np.int32),
                              "seed": np.array(0, np.int64)}, "generate")
    ids = outputs["ids"][0, :outputs["lengths"][0]].tolist()
    text = outputs["completions"][0].decode("utf-8", errors="replace")
    same = ids == sample["ids"]
    report.add("generate", same, f"greedy completion of {sample['prompt']!r} ({sample['max_new_tokens']} tokens) "
               + (f"is the recorded one: {text[:60]!r}" if same else
                  f"is {text[:60]!r}, pipeline.json records {sample['completion'][:60]!r}"))


def _check_signatures(report: Report, meta_graph, token_ids: bool = False) -> None:
    defs = meta_graph.signature_def
    if SIGNATURE not in defs:
        names = ", ".join(sorted(defs)) or "none"
        report.add("signatures", False, f"no {SIGNATURE} signature; has {names}")
    for name in sorted(defs):
        if name.startswith("__"):  # TF2's __saved_model_init_op
            continue
        tensors = signatures.signature_dtypes(defs[name])
        report.signatures[name] = {**tensors, "method_name": defs[name].method_name}
        shown = f"{_show_tensors(tensors['inputs'])} -> {_show_tensors(tensors['outputs'])}"
        wrong = signatures.signature_problems(name, defs[name], token_ids)
        if wrong:
            report.add(f"signature {name}", False,
                       f"{shown}: {'; '.join(wrong)} ({signatures.allowed_dtypes_text(name, token_ids)})")
        else:
            report.add(f"signature {name}", True, shown)


def _check_policy(report: Report) -> None:
    policy = report.policy or {}
    name, compute_dtype = policy.get("name"), policy.get("compute_dtype")
    ops = report.compute_ops
    if not compute_dtype:
        report.add("policy", False, "pipeline.json records no policy compute_dtype")
        return
    if not ops:
        report.add("policy", None, f"{name}: the graph has no MatMul/Conv ops to compare with")
        return
    recorded = f"pipeline.json serving policy {name} (compute {compute_dtype}"
    if policy.get("requested") and policy.get("requested") != name:
        recorded += f", chosen by {policy['requested']}: {policy.get('reason', '')}"
    recorded += ")"
    problem = saved_model.policy_problem(policy, ops)  # the rule the runner refuses to load by
    if problem:
        report.add("policy", False, f"{recorded}: {problem}")
    else:
        report.add("policy", True, f"{recorded} agrees with the graph: {saved_model.describe_ops(ops)}")


def _check_weights(report: Report, version: Path) -> None:
    policy = report.policy or {}
    report.weights = saved_model.weights_by_dtype(version)
    if not report.weights:
        report.add("weights", None, "the version stores no floating-point variables")
        return
    found = saved_model.describe_bytes(report.weights)
    problem = saved_model.weights_problem(policy, report.weights)  # the rule the runner refuses to load by
    if problem:
        report.add("weights", False, problem)
    else:
        report.add("weights", True, f"pipeline.json serving policy {policy.get('name')} (variables "
                                    f"{policy.get('variable_dtype')}) agrees with the stored weights: {found}")


def _check_parity(report: Report, metadata: dict, signature) -> keras.Model | None:
    """The parity check; returns the training run's model as served (None when it could not be loaded)."""
    run_dir = Path(metadata.get("run_dir") or "")
    if not metadata.get("run_dir") or not (run_dir / MODEL_FILE).is_file():
        report.add("parity", None, f"training run {run_dir or '(not recorded)'} with model.keras not found here")
        return None
    try:
        served, x = _trained_model(metadata, run_dir)
        expected = models.graph_outputs(served, x)
    except Exception as error:  # noqa: BLE001 - a run that cannot be reloaded is the finding
        report.add("parity", False, f"cannot reload the training run {run_dir}: {type(error).__name__}: {error}")
        return None
    actual = {name: t.numpy() for name, t in signature(**{_input_name(signature): tf.constant(x)}).items()}
    try:
        found = parity.differences(actual, expected)
    except parity.ParityError as error:
        report.add("parity", False, f"SavedModel vs trained model: {error}")
        return served
    recorded = (metadata.get("parity") or {}).get("tolerance")  # what export resolved and checked
    tolerance = recorded if recorded is not None else ExportConfig().parity_tolerance
    agreement = found["argmax_agreement"]
    report.parity = {"rows": len(x), "max_abs_diff": found["max_abs_diff"], "max_rel_diff": found["max_rel_diff"],
                     "max_abs_diff_per_output": found["max_abs_diff_per_output"], "argmax_agreement": agreement,
                     "tolerance": tolerance, "run_dir": str(run_dir)}
    ok = found["max_rel_diff"] <= tolerance  # `<=` is False for NaN
    detail = (f"{len(x)} held-out rows vs {run_dir}/model.keras: max abs diff {found['max_abs_diff']:.3g}, "
              f"max rel diff {found['max_rel_diff']:.3g} (tolerance {tolerance:g})")
    if agreement is not None:
        detail += f", argmax agreement {agreement:.4f}"
    report.add("parity", ok, detail)
    return served


def _trained_model(metadata: dict, run_dir: Path) -> tuple[keras.Model, np.ndarray]:
    """The training run's model as served (loaded under its recorded policy, rebuilt under the serving policy
    when that differs, with the export's named outputs) and the export's held-out rows."""
    run_cfg = validate_config({key: metadata["config"][key] for key in WEIGHT_SECTIONS})
    precision.restore_trained_policy(run_cfg.precision, run_dir, recorded=metadata.get("policy"))
    model = models.load_trained_model(run_dir / "model.keras", run_cfg.model, run_cfg.precision.float32_layers,
                                      run_cfg.precision.float16_layers)
    datasets = data.load_datasets(run_cfg.data, seed=run_cfg.seed, recorded=run_dir / DATA_DIR)
    rows = int((metadata.get("parity") or {}).get("rows") or metadata["config"]["export"]["parity_rows"])
    x, _ = datasets.validation_rows(rows)
    serving = saved_model.serving_policy(metadata).get("name")
    if serving and serving != (metadata.get("policy") or {}).get("name"):  # export.serving_policy rebuilt them
        with precision.policy_scope(serving):
            model = models.rebuild(model, run_cfg.model, datasets.spec, datasets.statistics,
                                   run_cfg.precision.float32_layers, run_cfg.precision.float16_layers)
    return models.serving_model(model, datasets.spec), x


def _check_constants(report: Report, model: keras.Model) -> None:
    findings = constant_findings(model)
    if not findings:
        report.add("constants", True, "no epsilon or standardisation divisor below the smallest normal number of "
                                      "the dtype it is read in")
        return
    for finding in findings:
        fix = " ".join(line.lstrip("# ").strip() for line in finding.fix.splitlines())
        report.add("constants", False, f"{finding.layer}: {finding.problem}; fix: {fix}")


def _training_data(metadata: dict) -> tuple[data.Datasets | None, str]:
    """The training run's data as pipeline.json's config reads it, or None and why it cannot be loaded here."""
    if not isinstance(metadata.get("config"), dict):
        return None, "pipeline.json records no data config to take the input range from"
    try:
        run_cfg = validate_config({key: metadata["config"][key] for key in WEIGHT_SECTIONS})
        recorded = Path(metadata["run_dir"]) / DATA_DIR if metadata.get("run_dir") else None
        return data.load_datasets(run_cfg.data, seed=run_cfg.seed, recorded=recorded), ""
    except Exception as error:  # noqa: BLE001 - data that is not on this host: the checks that need it cannot run
        return None, (f"the training data cannot be loaded here: {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}")


def _check_input_limits(report: Report, datasets: data.Datasets | None, missing: str, signature) -> None:
    """The SavedModel itself on rows at the input limits of the training data (probes.edge_rows)."""
    if datasets is None:
        for name in ("input limits", "far inputs"):
            report.add(name, None, missing)
        return
    per_column = datasets.spec.image_shape is None  # tabular columns: each its own range (issue 23)
    for name, beyond in (("input limits", 0.0), ("far inputs", FAR_BEYOND)):
        probe = parity.probe_input_limits(signature, _input_name(signature), datasets.statistics,
                                          datasets.spec.input_shape, beyond, per_column=per_column,
                                          ids=datasets.spec.categorical)
        ok = parity.input_limits_passed(probe)
        detail = parity.describe_input_limits(probe) + (
            "" if ok or probe.get("error") else " (see the constants check, or python -m pipeline diagnose)")
        if ok or not beyond:
            report.add(name, ok, detail)
        else:  # inputs no client should send: a warning, not a failure (docs/precision.md)
            report.warn(name, detail)


def _check_images(report: Report, loaded, datasets: data.Datasets | None, missing: str) -> None:
    """predict_images on real files answers what serving_default answers on their training decode, bit for bit."""
    if IMAGES_SIGNATURE not in loaded.signatures:
        report.add("images", False, f"pipeline.json lists {IMAGES_SIGNATURE}, but the SavedModel has no such signature")
        return
    if datasets is None:
        report.add("images", None, missing)
        return
    files, rows, _ = datasets.val.encoded_rows(PROBE_IMAGES)
    if not files:
        report.add("images", None, "the validation split holds no image file to send")
        return
    default = loaded.signatures[SIGNATURE]
    expected = {name: t.numpy() for name, t in default(**{_input_name(default): tf.constant(rows)}).items()}
    answered = {name: t.numpy() for name, t in
                loaded.signatures[IMAGES_SIGNATURE](**{IMAGES_INPUT: tf.constant(files)}).items()}
    if set(answered) != set(expected):
        report.add("images", False, f"{IMAGES_SIGNATURE} answers {sorted(answered)}, {SIGNATURE} {sorted(expected)}")
        return
    differ = {name: float(np.max(np.abs(answered[name].astype(np.float64) - expected[name])))
              for name in sorted(expected) if not np.array_equal(answered[name], expected[name])}
    what = (f"{len(files)} validation image files through {IMAGES_SIGNATURE} vs {SIGNATURE} on the training "
            "pipeline's decode of the same files (one batch each)")
    if differ:
        shown = ", ".join(f"{name} max abs diff {value:.3g}" for name, value in differ.items())
        report.add("images", False, f"{what}: {shown}; the graph's decode is not the training pipeline's")
    else:
        report.add("images", True, f"{what}: the same bits ({', '.join(sorted(expected))})")


def _check_hostile_images(report: Report, loaded, metadata: dict) -> None:
    """predict_images refuses what a hostile or broken client sends, INVALID_ARGUMENT, before decoding it."""
    if IMAGES_SIGNATURE not in loaded.signatures:
        report.add("hostile images", None, f"no {IMAGES_SIGNATURE} signature to send them to (see images)")
        return
    limits = metadata["signatures"][IMAGES_SIGNATURE]["inputs"][IMAGES_INPUT]
    max_pixels = int(limits["max_image_pixels"])
    signature = loaded.signatures[IMAGES_SIGNATURE]
    wrong = []
    for what, contents, names in _hostile_images(max_pixels):
        try:
            signature(**{IMAGES_INPUT: tf.constant([contents])})
            wrong.append(f"{what}: answered, not refused")
        except tf.errors.InvalidArgumentError as error:
            message = op_error_text(error.message, "InvalidArgumentError")
            if names and names not in message:
                wrong.append(f"{what}: refused, but not by its header ({message[:200]})")
    sent = ", ".join(what for what, _, _ in _hostile_images(max_pixels))
    if wrong:
        report.add("hostile images", False, "; ".join(wrong))
    else:
        report.add("hostile images", True, f"refused INVALID_ARGUMENT: {sent} (max_image_pixels {max_pixels:,})")


def _hostile_images(max_pixels: int) -> list[tuple[str, bytes, str]]:
    """(what, bytes, the size a refusal must name) of each probe: no image, then headers declaring a side past
    max_pixels (a few bytes that would decode to gigabytes; the JPEG's when its 16-bit sides can)."""
    side = math.isqrt(max_pixels) + 1
    png = image_probes.png_header(side, side, color_type=0) + image_probes.png_chunk(b"IEND", b"")
    probes = [("bytes that are no image", b"not an image: a client sent the wrong file\n", ""),
              (f"a PNG header declaring {side}x{side} pixels", png, f"{side}x{side}")]
    if side <= 0xFFFF:
        probes.append((f"a JPEG header declaring {side}x{side} pixels", image_probes.jpeg_header(side, side), f"{side}x{side}"))
    return probes


def _input_name(signature) -> str:
    _, inputs = signature.structured_input_signature
    return next(iter(inputs))


def _show_tensors(tensors: dict[str, str]) -> str:
    return "{" + ", ".join(f"{key}: {dtype}" for key, dtype in sorted(tensors.items())) + "}"


def print_report(report: Report, as_json: bool = False) -> int:
    """Prints the report (text or JSON) and returns the exit code: 0 if every check passed, else 1."""
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.text())
    return 0 if report.ok else 1
