"""The export's parity gate: one pinned golden batch of held-out rows through every path a prediction takes.

Paths (each a dict of named float32 outputs on the same rows):
    trained          the trained Keras model under its training policy
    float32          the same weights rebuilt under float32 (the numerical yardstick)
    serving          the same weights rebuilt under export.serving_policy (only when it is not the trained one)
    saved_model      the reloaded SavedModel's serving_default signature
    server_predict   the live server (serving's own gRPC stack, in-process) answering Predict
    server_classify  ... answering Classify (classifiers), or server_regress answering Regress (regressors)

Rules, each one comparison in the report:
    same graph       saved_model vs the Keras model it was exported from: within export.parity_tolerance
                     (0 in practice on CPU for float32/float16; bfloat16's fused kernels round differently)
                     as a share of the output's largest magnitude, like every relative figure here
    same bits        every server path vs saved_model: identical (same graph, same inputs, same bits)
    precision        trained (and serving) vs float32: within export.policy_tolerance as a share of the
                     output's largest magnitude, and argmax agreement ≥ export.min_argmax_agreement

The report (assets.extra/parity.json) also carries each path's metric on the golden rows (accuracy, or
MAE for regressors) and its delta against float32.
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
from pipeline.errors import ParityError
from serving.client import grpc_client
from serving.servable import tensors
from serving.errors import LoadError
from serving.app import serving_in_process



@dataclasses.dataclass(frozen=True)
class GoldenBatch:
    """The first rows of the validation split: fixed by the data config and seed, so re-runnable."""

    x: np.ndarray
    y: np.ndarray
    task: str  # classification | regression

    @property
    def sha1(self) -> str:
        return hashlib.sha1(np.ascontiguousarray(self.x).tobytes()).hexdigest()


def golden_batch(val_x: np.ndarray, val_y: np.ndarray, rows: int, task: str) -> GoldenBatch:
    return GoldenBatch(np.asarray(val_x[:rows], np.float32), np.asarray(val_y[:rows]), task)


class Gate:
    """Collects the paths' outputs and checks the rules as they arrive; report() is parity.json."""

    def __init__(self, golden: GoldenBatch, *, trained_policy: str, serving_policy: str, parity_tolerance: float,
                 policy_tolerance: float, min_argmax_agreement: float) -> None:
        self.golden = golden
        self.policies = {"trained": trained_policy, "serving": serving_policy}
        self.parity_tolerance = parity_tolerance
        self.policy_tolerance = policy_tolerance
        self.min_argmax_agreement = min_argmax_agreement
        self.outputs: dict[str, dict[str, np.ndarray]] = {}
        self.paths: dict[str, dict[str, Any]] = {}
        self.comparisons: list[dict[str, Any]] = []

    def add(self, path: str, outputs: dict[str, np.ndarray], description: str) -> None:
        self.outputs[path] = {name: np.asarray(value) for name, value in outputs.items()}
        self.paths[path] = {"description": description, "outputs": sorted(outputs),
                            "metric": _metric(self.outputs[path], self.golden)}

    def same_graph(self, path: str, reference: str) -> None:
        """path was exported from reference: within export.parity_tolerance."""
        self._compare(path, reference, "same graph", f"max rel diff ≤ {self.parity_tolerance:g} "
                      "(export.parity_tolerance)", lambda c: c["max_rel_diff"] <= self.parity_tolerance)

    def same_bits(self, path: str, reference: str) -> None:
        """path runs reference's graph on the same inputs: identical outputs, dtype included."""
        self._compare(path, reference, "same bits", "identical outputs", lambda c: c["identical"])

    def precision(self, path: str, reference: str = "float32") -> None:
        """path computes in reduced precision: close to float32 and predicting the same classes."""
        def ok(c: dict) -> bool:
            agreement = c["argmax_agreement"]
            return c["max_rel_diff"] <= self.policy_tolerance and (
                agreement is None or agreement >= self.min_argmax_agreement)

        rule = (f"max rel diff ≤ {self.policy_tolerance:g} (export.policy_tolerance)"
                + (f", argmax agreement ≥ {self.min_argmax_agreement:g} (export.min_argmax_agreement)"
                   if self.golden.task == "classification" else ""))
        self._compare(path, reference, "precision", rule, ok)

    def _compare(self, path: str, reference: str, kind: str, rule: str, ok) -> None:
        comparison = {"path": path, "reference": reference, "kind": kind, "rule": rule,
                      **differences(self.outputs[path], self.outputs[reference])}
        metric, reference_metric = self.paths[path]["metric"], self.paths[reference]["metric"]
        comparison["metric_delta"] = {name: value - reference_metric[name] for name, value in metric.items()}
        comparison["passed"] = bool(ok(comparison))  # NaN compares False: a NaN output fails
        self.comparisons.append(comparison)

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.comparisons)

    def failures(self) -> list[str]:
        return [f"{c['path']} vs {c['reference']} ({c['kind']}): {_summary(c)}; required {c['rule']}"
                for c in self.comparisons if not c["passed"]]

    def report(self) -> dict[str, Any]:
        float32_metric = self.paths.get("float32", {}).get("metric", {})
        for info in self.paths.values():
            info["metric_delta_vs_float32"] = {name: value - float32_metric[name]
                                               for name, value in info["metric"].items() if name in float32_metric}
        return {"format": 1, "passed": self.passed, "rows": len(self.golden.x), "golden_rows_sha1": self.golden.sha1,
                "golden_rows": f"validation rows 0..{len(self.golden.x) - 1} (export.parity_rows)",
                "task": self.golden.task, "policies": self.policies,
                "tolerances": {"parity_tolerance": self.parity_tolerance, "policy_tolerance": self.policy_tolerance,
                               "min_argmax_agreement": self.min_argmax_agreement},
                "paths": self.paths, "comparisons": self.comparisons}

    def summary(self) -> str:
        """One line per comparison, for the export's log."""
        return "\n".join(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['path']:>15} vs {c['reference']:<12} "
                         f"{_summary(c)}" for c in self.comparisons)


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
    return {"outputs": shared, "max_abs_diff": max(abs_diff.values()), "max_abs_diff_per_output": abs_diff,
            "max_rel_diff": max(rel_diff.values()), "max_rel_diff_per_output": rel_diff,
            "argmax_agreement": agreement, "identical": identical}


def _summary(c: dict) -> str:
    text = f"max abs diff {c['max_abs_diff']:.3g}, max rel diff {c['max_rel_diff']:.3g}"
    if c["argmax_agreement"] is not None:
        text += f", argmax agreement {c['argmax_agreement']:.4f}"
    return text + (", identical" if c["identical"] else "")


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

    Returns {"server_predict": ..., "server_classify"|"server_regress": ...} as named float32 outputs.
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
