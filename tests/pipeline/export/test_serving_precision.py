"""export.serving_policy end to end, one version per policy of the same tiny trained run: export (the gate),
verify, then the server's gRPC and REST answers, each within its policy's tolerance of the float32 version.

float16 and bfloat16 store the weights in that dtype (half the variables); every boundary stays float32.
"""

from __future__ import annotations

import json
import urllib.request

import keras
import numpy as np
import pytest

from pipeline import precision
from pipeline.config import load_config
from pipeline.export import export, parity
from pipeline.verify import verify
from serving.app import Core, ServerThread
from serving.client import grpc_client
from serving.flags import Options
from serving.manager.model_config import single_model_config
from serving.manager.model_manager import ModelManager
from serving.monitoring import Metrics
from serving.servable import saved_model
from serving.servable.runner import Runner

pytestmark = pytest.mark.timeout(300)

# version -> export.serving_policy; version 2 (float32) is the yardstick the others are held to.
POLICIES = {1: "trained", 2: "float32", 3: "mixed_bfloat16", 4: "float16", 5: "bfloat16"}
WEIGHTS = {"trained": "float32", "float32": "float32", "mixed_bfloat16": "float32", "float16": "float16",
           "bfloat16": "bfloat16"}


@pytest.fixture(scope="module")
def versions(trained_run, tiny_config_path, tmp_path_factory):
    """The tiny run exported once per serving policy, as versions 1-5 of one model."""
    base = tmp_path_factory.mktemp("serving_precision")
    exported = {}
    for version, policy in POLICIES.items():
        cfg = load_config(tiny_config_path, [f"export.base_path={base}", f"export.serving_policy={policy}",
                                             f"export.version={version}"])
        exported[policy] = export(cfg)
        keras.config.set_dtype_policy("float32")
    return cfg, exported


@pytest.mark.parametrize("policy", POLICIES.values())
def test_each_policy_stores_its_weights_passes_the_gate_and_verify(versions, policy):
    _, exported = versions
    meta = saved_model.read_pipeline_json(exported[policy])
    served = "mixed_float16" if policy == "trained" else policy  # the tiny run trains under mixed_float16
    assert meta["serving_policy"]["name"] == served and meta["weights"]["dtype"] == WEIGHTS[policy]
    weights = meta["weights"]["bytes_by_dtype"]
    float32_weights = saved_model.read_pipeline_json(exported["float32"])["weights"]["bytes_by_dtype"]
    if WEIGHTS[policy] == "float32":
        assert weights == float32_weights
    else:  # every kernel and bias, in half the bytes (the standardisation's float32 constants are in the graph)
        assert weights == {WEIGHTS[policy]: float32_weights["float32"] // 2}
    report = json.loads((exported[policy] / "assets.extra/parity.json").read_text())
    assert report["passed"] and report["input_limits"]["nonfinite_rows"] == 0
    assert report["validation_rows"] == 359 and served in report["tolerances"]
    judged = next(c for c in report["comparisons"] if c["kind"] == "precision" and c["policy"] == served)
    assert judged["tolerance"] == precision.tolerance(served).to_dict() and judged["metric_drop"] <= 0.5
    assert meta["parity"]["vs_float32"]["policy"] == served
    checks = verify(exported[policy])
    assert checks.ok and {c.name: c.status for c in checks.checks}["weights"] == "PASS", checks.text()
    assert checks.weights == weights


def test_half_precision_weights_compute_what_the_mixed_policy_computes(versions, trained_run):
    """A mixed policy casts every float32 weight to float16 on each call; float16 weights are that cast, done once."""
    _, exported = versions
    x = trained_run.datasets.val.x
    mixed = Runner.load(exported["trained"]).predict({"features": x})
    half = Runner.load(exported["float16"]).predict({"features": x})
    for name in mixed:
        np.testing.assert_array_equal(half[name], mixed[name])


@pytest.fixture(scope="module")
def server(versions):
    cfg, _ = versions
    config = single_model_config(cfg.export.model_name, cfg.model_base_path)
    config.model_config_list.config[0].model_version_policy.all.SetInParent()
    manager = ModelManager(file_system_poll_wait_seconds=0)
    metrics = Metrics()
    core = Core(manager, metrics=metrics)
    manager.reload_config(config)
    with ServerThread(Options(port=0, rest_api_port=-1, grpc_max_threads=2), core) as thread:
        yield thread, metrics
    for runner in manager.versions(cfg.export.model_name).values():
        runner.close()
    core.close()


def _rest_predict(address: str, model: str, version: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    request = urllib.request.Request(f"http://{address}/v1/models/{model}/versions/{version}:predict",
                                     data=json.dumps({"instances": rows.tolist()}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        predictions = json.loads(response.read())["predictions"]
    return {name: np.array([row[name] for row in predictions], np.float32) for name in predictions[0]}


def test_grpc_and_rest_answer_every_policy_within_its_tolerance_of_float32(server, versions, trained_run):
    thread, metrics = server
    cfg, _ = versions
    x = trained_run.datasets.val.x[:64]
    name = cfg.export.model_name
    answers = {policy: grpc_client.predict_rows(thread.grpc_address, name, "features", x, batch_size=32,
                                                version=version) for version, policy in POLICIES.items()}
    for version, policy in POLICIES.items():
        assert {output.dtype for output in answers[policy].values()} == {np.dtype(np.float32)}
        # the same 8 rows in one call each way: a call of another size may take other kernels (Eigen's blocking
        # on an AVX2-only CPU), which round differently; the transports must not
        over_rest = _rest_predict(thread.rest_address, name, version, x[:8])
        over_grpc = grpc_client.predict_rows(thread.grpc_address, name, "features", x[:8], batch_size=8,
                                             version=version)
        for output, values in over_rest.items():
            np.testing.assert_allclose(values, over_grpc[output], rtol=1e-6, atol=1e-7)
        found = parity.differences(answers[policy], answers["float32"])
        tolerance = precision.tolerance("mixed_float16" if policy == "trained" else policy)
        assert found["max_rel_diff"] <= tolerance.max_rel_diff, (policy, found)
        assert found["argmax_agreement"] >= tolerance.min_argmax_agreement, (policy, found)
    text = metrics.exposition().decode()
    assert ('tensorflow_serving_model_weights_bytes{dtype="bfloat16",model_name="tiny_digits",policy="bfloat16",'
            'version="5"}') in text
    assert 'dtype="float16",model_name="tiny_digits",policy="float16",version="4"' in text
