"""The export's parity gate: one pinned golden batch of held-out rows through every path a prediction takes.

Paths (each a dict of named float32 outputs on the same rows):
    trained          the trained Keras model under its training policy
    float32          the same weights rebuilt under float32 (the numerical yardstick)
    serving          the same weights rebuilt under export.serving_policy (only when it is not the trained one;
                     under float16 or bfloat16 the weights themselves are rounded to that dtype)
    saved_model      the reloaded SavedModel's serving_default signature
    server_predict   the live server (serving's own gRPC stack, in-process) answering Predict
    server_classify  ... answering Classify (classifiers), or server_regress answering Regress (regressors)

Rules, each one comparison in the report:
    same graph       saved_model vs the Keras model it was exported from: within export.parity_tolerance
                     as a share of the output's largest magnitude (0 in practice: both run as graphs)
    same bits        every server path vs saved_model: identical (same graph, same inputs, same bits)
    precision        trained (and serving) vs float32, judged by the tolerance of the policy the path computes
                     under (export.tolerances.<policy>, precision.TOLERANCES): on the golden rows the max
                     rel diff (and, if set, max abs diff) of every output and the argmax agreement; on all
                     validation rows the drop in accuracy (or rise in MAE) against float32
    input limits     saved_model on rows with every feature, and each alone, at the training rows' smallest and
                     largest value (pipeline.diagnose.probes.edge_rows): no NaN or inf in any output

The report (assets.extra/parity.json) also carries each path's metric on the golden rows and on the
validation rows (accuracy, or MAE for regressors) and its delta against float32.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tensorflow_serving.apis import prediction_service_pb2_grpc

from pipeline import artifacts
from pipeline.artifacts import PARITY_JSON
from pipeline.data import Statistics
from pipeline.diagnose.probes import edge_rows
from pipeline.errors import ParityError
from pipeline.export.signatures import IMAGES_INPUT, IMAGES_SIGNATURE
from pipeline.precision import Tolerance
from serving.client import grpc_client
from serving.servable import tensors
from serving.errors import LoadError
from serving.app import serving_in_process


@dataclasses.dataclass(frozen=True)
class GoldenBatch:
    """Rows with their labels: the golden batch (the first validation rows: fixed by the data config and seed, so
    re-runnable) or all validation rows."""

    x: np.ndarray
    y: np.ndarray
    task: str  # classification | regression
    encoded: tuple[bytes, ...] = ()  # image-folder models: the image files the rows were decoded from, in order

    @property
    def sha1(self) -> str:
        return hashlib.sha1(np.ascontiguousarray(self.x).tobytes()).hexdigest()


def golden_batch(val_x: np.ndarray, val_y: np.ndarray, rows: int, task: str,
                 encoded: tuple[bytes, ...] = ()) -> GoldenBatch:
    return GoldenBatch(np.asarray(val_x[:rows], np.float32), np.asarray(val_y[:rows]), task, encoded[:rows])


class Gate:
    """Collects the paths' outputs and checks the rules as they arrive; report() is parity.json."""

    def __init__(self, golden: GoldenBatch, *, trained_policy: str, serving_policy: str, parity_tolerance: float,
                 validation: GoldenBatch | None = None) -> None:
        self.golden = golden
        self.validation = validation
        self.policies = {"trained": trained_policy, "serving": serving_policy}
        self.parity_tolerance = parity_tolerance
        self.tolerances: dict[str, Tolerance] = {}  # by policy, as the precision rules used them
        self.outputs: dict[str, dict[str, np.ndarray]] = {}
        self.paths: dict[str, dict[str, Any]] = {}
        self.comparisons: list[dict[str, Any]] = []
        self.input_limits: dict[str, Any] | None = None

    def add(self, path: str, outputs: dict[str, np.ndarray], description: str,
            validation_outputs: dict[str, np.ndarray] | None = None) -> None:
        """A path's outputs on the golden rows and, for the precision rule, on every validation row."""
        self.outputs[path] = {name: np.asarray(value) for name, value in outputs.items()}
        self.paths[path] = {"description": description, "outputs": sorted(outputs),
                            "metric": _metric(self.outputs[path], self.golden)}
        if validation_outputs is not None and self.validation is not None:
            self.paths[path]["validation_metric"] = _metric(validation_outputs, self.validation)

    def same_graph(self, path: str, reference: str) -> None:
        """path was exported from reference: within export.parity_tolerance."""
        self._compare(path, reference, "same graph", f"max rel diff ≤ {self.parity_tolerance:g} "
                      "(export.parity_tolerance)", lambda c: c["max_rel_diff"] <= self.parity_tolerance)

    def same_bits(self, path: str, reference: str) -> None:
        """path runs reference's graph on the same inputs: identical outputs, dtype included."""
        self._compare(path, reference, "same bits", "identical outputs", lambda c: c["identical"])

    def precision(self, path: str, tolerance: Tolerance, reference: str = "float32") -> None:
        """path computes under tolerance.policy: close to float32, the same classes, the same validation metric."""
        self.tolerances[tolerance.policy] = tolerance
        classifier = self.golden.task == "classification"
        key = f"export.tolerances.{tolerance.policy}"
        rules = [f"max rel diff ≤ {tolerance.max_rel_diff:g} ({key}.max_rel_diff)"]
        if tolerance.max_abs_diff is not None:
            rules.append(f"max abs diff ≤ {tolerance.max_abs_diff:g} ({key}.max_abs_diff)")
        if classifier:
            rules.append(f"argmax agreement ≥ {tolerance.min_argmax_agreement:g} ({key}.min_argmax_agreement)")
        rules.append(f"validation {'accuracy drop' if classifier else 'MAE rise'} ≤ {tolerance.max_metric_drop:g} "
                     f"{'pt' if classifier else '%'} ({key}.max_metric_drop)")
        comparison = self._compare(path, reference, "precision", ", ".join(rules), lambda c: True)
        comparison.update(policy=tolerance.policy, tolerance=tolerance.to_dict(),
                          metric_drop=_metric_drop(self.paths[path].get("validation_metric"),
                                                   self.paths[reference].get("validation_metric")))
        comparison["passed"] = not _violations(comparison)  # judged once the tolerance and the drop are attached

    def probe_input_limits(self, path: str, probe: dict[str, Any]) -> None:
        """The input-limits probe's result (probe_input_limits) for path: passes when no output is NaN or inf."""
        self.input_limits = {"path": path, **probe, "passed": input_limits_passed(probe)}

    def _compare(self, path: str, reference: str, kind: str, rule: str, ok) -> dict[str, Any]:
        comparison = {"path": path, "reference": reference, "kind": kind, "rule": rule,
                      **differences(self.outputs[path], self.outputs[reference])}
        metric, reference_metric = self.paths[path]["metric"], self.paths[reference]["metric"]
        comparison["metric_delta"] = {name: value - reference_metric[name] for name, value in metric.items()}
        comparison["passed"] = bool(ok(comparison))  # NaN compares False: a NaN output fails
        self.comparisons.append(comparison)
        return comparison

    @property
    def passed(self) -> bool:
        limits_ok = self.input_limits is None or self.input_limits["passed"]
        return limits_ok and all(c["passed"] for c in self.comparisons)

    def failures(self) -> list[str]:
        """One clause per failed rule, naming the worst output and the config key that bounds it."""
        failed = []
        for c in self.comparisons:
            if c["passed"]:
                continue
            what = "; ".join(_violations(c)) if c["kind"] == "precision" else f"{_summary(c)}; required {c['rule']}"
            failed.append(f"{c['path']} vs {c['reference']} ({c['kind']}): {what}")
        if self.input_limits and not self.input_limits["passed"]:
            failed.append(f"{self.input_limits['path']} at the input limits: {describe_input_limits(self.input_limits)}")
        return failed

    def report(self) -> dict[str, Any]:
        for info in self.paths.values():
            for metric in ("metric", "validation_metric"):
                if metric in info and metric in self.paths.get("float32", {}):
                    reference = self.paths["float32"][metric]
                    info[f"{metric}_delta_vs_float32"] = {name: value - reference[name]
                                                          for name, value in info[metric].items() if name in reference}
        return {"format": 1, "passed": self.passed, "rows": len(self.golden.x), "golden_rows_sha1": self.golden.sha1,
                "golden_rows": f"validation rows 0..{len(self.golden.x) - 1} (export.parity_rows)",
                "validation_rows": None if self.validation is None else len(self.validation.x),
                "task": self.golden.task, "policies": self.policies,
                "tolerances": {"parity_tolerance": self.parity_tolerance,
                               **{policy: t.to_dict() for policy, t in self.tolerances.items()}},
                "paths": self.paths, "comparisons": self.comparisons, "input_limits": self.input_limits}

    def summary(self) -> str:
        """One line per comparison, for the export's log."""
        lines = [f"  {'PASS' if c['passed'] else 'FAIL'}  {c['path']:>15} vs {c['reference']:<12} {_summary(c)}"
                 for c in self.comparisons]
        if self.input_limits:
            lines.append(f"  {'PASS' if self.input_limits['passed'] else 'FAIL'}  {self.input_limits['path']:>15} at "
                         f"input limits  {describe_input_limits(self.input_limits)}")
        return "\n".join(lines)


def differences(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per shared output: max abs diff, max diff relative to the reference's largest magnitude, argmax agreement."""
    shared = sorted(set(actual) & set(expected))
    if not shared:
        raise ParityError(f"no outputs in common: {sorted(actual)} vs {sorted(expected)}")
    abs_diff, rel_diff = {}, {}
    for name in shared:
        a, b = actual[name].astype(np.float64), expected[name].astype(np.float64)
        if a.shape != b.shape:
            raise ParityError(f"output {name!r}: shape {a.shape} vs {b.shape}")
        worst = float(np.max(np.abs(a - b))) if a.size else 0.0
        abs_diff[name] = worst
        rel_diff[name] = worst / max(float(np.max(np.abs(b))) if b.size else 0.0, np.finfo(np.float32).tiny)
    agreement = None
    if "probabilities" in shared:
        agreement = float(np.mean(actual["probabilities"].argmax(-1) == expected["probabilities"].argmax(-1)))
    identical = all(actual[name].dtype == expected[name].dtype and np.array_equal(actual[name], expected[name])
                    for name in shared)
    # NaN sorts last, so an output that went NaN is the worst one.
    worst_output = max(shared, key=lambda name: (np.isnan(rel_diff[name]), np.nan_to_num(rel_diff[name], nan=0.0)))
    return {"outputs": shared, "max_abs_diff": max(abs_diff.values()), "max_abs_diff_per_output": abs_diff,
            "max_rel_diff": max(rel_diff.values()), "max_rel_diff_per_output": rel_diff, "worst_output": worst_output,
            "argmax_agreement": agreement, "identical": identical}


# Rows per signature call of the input-limits probe: an image model's 2,050 rows at 224x224x3 are 1.2 GB as one
# tensor, ~8x slower to build than in chunks, and their activations more again.
PROBE_CHUNK_ROWS = 256


def probe_input_limits(signature, input_name: str, statistics: Statistics, row_shape: tuple[int, ...],
                       beyond: float = 0.0, *, per_column: bool = False, ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Rows with every feature, and each feature alone, at its training limits (diagnose.probes.edge_rows: each
    column's own with per_column, else the smallest and largest value of any feature), or `beyond` training ranges
    past them, through a SavedModel signature: how many give a NaN or inf output, and one of them; "error" when the
    signature refuses the rows (an id beyond an Embedding's table)."""
    import tensorflow as tf

    rows, labels = edge_rows(statistics, row_shape, beyond, per_column=per_column, ids=ids)
    probe = {"rows": len(rows), "low": float(np.min(rows)), "high": float(np.max(rows)), "beyond": beyond,
             "per_column": per_column, "id_columns": len(ids), "nonfinite_rows": 0, "example": None, "error": None}
    finite = np.ones(len(rows), bool)
    try:
        for start in range(0, len(rows), PROBE_CHUNK_ROWS):
            chunk = rows[start:start + PROBE_CHUNK_ROWS]
            outputs = signature(**{input_name: tf.constant(chunk)})
            for tensor in outputs.values():
                finite[start:start + len(chunk)] &= np.isfinite(
                    tensor.numpy().astype(np.float64).reshape(len(chunk), -1)).all(axis=1)
    except Exception as error:  # noqa: BLE001 - rows within the training data's limits the model cannot take
        probe["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error) else ''}"
        return probe
    bad = np.flatnonzero(~finite)
    probe.update(nonfinite_rows=int(len(bad)), example=labels[bad[0]] if len(bad) else None)
    return probe


def input_limits_passed(probe: dict) -> bool:
    return probe["nonfinite_rows"] == 0 and not probe.get("error")


def _violations(c: dict) -> list[str]:
    """What a precision comparison breaks of its tolerance, each naming the worst output; [] when it holds."""
    t = c["tolerance"]
    key = f"export.tolerances.{t['policy']}"
    worst = c["worst_output"]
    found = []
    if not c["max_rel_diff"] <= t["max_rel_diff"]:  # `not <=`: NaN violates
        found.append(f"output '{worst}' max rel diff {c['max_rel_diff']:.3g} (max abs diff "
                     f"{c['max_abs_diff_per_output'][worst]:.3g}) > {t['max_rel_diff']:g} ({key}.max_rel_diff)")
    if t["max_abs_diff"] is not None and not c["max_abs_diff"] <= t["max_abs_diff"]:
        output = max(c["max_abs_diff_per_output"], key=lambda name: np.nan_to_num(c["max_abs_diff_per_output"][name],
                                                                                   nan=np.inf))
        found.append(f"output '{output}' max abs diff {c['max_abs_diff']:.3g} > {t['max_abs_diff']:g} "
                     f"({key}.max_abs_diff)")
    agreement = c["argmax_agreement"]
    if agreement is not None and not agreement >= t["min_argmax_agreement"]:
        found.append(f"output 'probabilities' argmax agreement {agreement:.4f} < {t['min_argmax_agreement']:g} "
                     f"({key}.min_argmax_agreement)")
    drop = c.get("metric_drop")
    if drop is not None and not drop <= t["max_metric_drop"]:
        unit = "pt accuracy drop" if agreement is not None else "% MAE rise"
        found.append(f"validation rows: {drop:.3g} {unit} > {t['max_metric_drop']:g} ({key}.max_metric_drop)")
    return found


def _metric_drop(metric: dict | None, reference: dict | None) -> float | None:
    """How much worse than float32 on the validation rows: accuracy points lost, or MAE gained in % of float32's."""
    if not metric or not reference:
        return None
    if "accuracy" in metric:
        return (reference["accuracy"] - metric["accuracy"]) * 100
    if "mae" in metric:
        return (metric["mae"] - reference["mae"]) / max(reference["mae"], np.finfo(np.float32).tiny) * 100
    return None


def _summary(c: dict) -> str:
    text = f"max abs diff {c['max_abs_diff']:.3g}, max rel diff {c['max_rel_diff']:.3g}"
    if c["argmax_agreement"] is not None:
        text += f", argmax agreement {c['argmax_agreement']:.4f}"
    if c.get("metric_drop") is not None:
        text += (f", validation accuracy drop {c['metric_drop']:.3g} pt" if c["argmax_agreement"] is not None
                 else f", validation MAE rise {c['metric_drop']:.3g}%")
    return text + (", identical" if c["identical"] else "")


def describe_input_limits(probe: dict) -> str:
    """The input-limits probe in one line, for the export log, a refusal and verify."""
    beyond = probe.get("beyond")
    if probe.get("per_column"):
        text = f"{probe['rows']} rows with each feature at its own training min or max" + (
            f" moved {beyond:g} training ranges beyond it" if beyond else "") + (
            " (category ids stay among theirs)" if beyond and probe.get("id_columns") else "")
    else:
        where = f"{beyond:g} training ranges beyond it" if beyond else "the training rows' range"
        text = f"{probe['rows']} rows with each feature at {probe['low']:g} or {probe['high']:g} ({where})"
    if probe.get("error"):
        return text + f": the SavedModel fails on them: {probe['error']}"
    if probe["nonfinite_rows"] == 0:
        return text + ": every output finite"
    return text + f": {probe['nonfinite_rows']} give NaN or inf, e.g. {probe['example']}"


def _metric(outputs: dict[str, np.ndarray], golden: GoldenBatch) -> dict[str, float]:
    """Accuracy (classifiers) or MAE (regressors) of one path on the golden rows."""
    if "probabilities" in outputs:
        return {"accuracy": float(np.mean(outputs["probabilities"].argmax(-1) == golden.y.reshape(-1)))}
    if "predictions" in outputs:
        predictions = outputs["predictions"].reshape(len(golden.y), -1).astype(np.float64)
        return {"mae": float(np.mean(np.abs(predictions - golden.y.reshape(len(golden.y), -1))))}
    return {}


def write_report(gate: Gate, version_dir: Path) -> None:
    artifacts.write_json_atomic(version_dir / PARITY_JSON, gate.report())


def served_outputs(version_dir: Path, model_name: str, version: int, input_name: str,
                   golden: GoldenBatch, task_signature: str) -> dict[str, dict[str, np.ndarray]]:
    """The golden rows through the live server: serving's own gRPC stack started in-process on a free
    local port (serving.app.serving_in_process), answering Predict and Classify or Regress.

    Returns {"server_predict": ..., "server_classify"|"server_regress": ...} as named float32 outputs, and
    "server_images" (predict_images on the golden rows' image files) for an image-folder model.
    """
    quiet = _Quiet("serving")  # the load lines would name the throwaway copy
    try:
        with serving_in_process(version_dir, model_name, version) as address:
            return _query(address, model_name, version, input_name, golden, task_signature)
    except LoadError as error:
        raise ParityError(str(error)) from None
    finally:
        quiet.restore()


class _Quiet:
    """Raises the named loggers to WARNING until restore()."""

    def __init__(self, *names: str) -> None:
        self._levels = {name: logging.getLogger(name).level for name in names}
        for name in names:
            logging.getLogger(name).setLevel(logging.WARNING)

    def restore(self) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def _query(address: str, model_name: str, version: int, input_name: str, golden: GoldenBatch,
           task_signature: str) -> dict[str, dict[str, np.ndarray]]:
    with grpc.insecure_channel(address, options=grpc_client.CHANNEL_OPTIONS) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        predict = grpc_client.predict_request(model_name, {input_name: golden.x}, version=version)
        response = stub.Predict(predict, timeout=60)
        results = {"server_predict": {name: tensors.to_ndarray(proto, name) for name, proto in response.outputs.items()}}
        if golden.encoded:
            images = grpc_client.predict_request(model_name, {IMAGES_INPUT: np.array(golden.encoded, dtype=object)},
                                                 IMAGES_SIGNATURE, version=version)
            response = stub.Predict(images, timeout=60)
            results["server_images"] = {name: tensors.to_ndarray(proto, name) for name, proto in response.outputs.items()}
        examples = grpc_client.float_examples(golden.x, input_name)
        if golden.task == "regression":
            request = grpc_client.regress_request(model_name, examples, task_signature, version)
            regressions = stub.Regress(request, timeout=60).result.regressions
            values = np.array([r.value for r in regressions], np.float32).reshape(-1, 1)
            results["server_regress"] = {"predictions": values}
        else:
            request = grpc_client.classify_request(model_name, examples, task_signature, version)
            classifications = stub.Classify(request, timeout=60).result.classifications
            scores = np.array([[c.score for c in row.classes] for row in classifications], np.float32)
            results["server_classify"] = {"probabilities": scores}
    return results
