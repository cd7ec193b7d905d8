"""diagnose on a language model (model.kind causal_lm, issue 29): a tiny one (1 block, width 16, context 32, the
configs of tests/pipeline/train/test_lm_training.py) under mixed_float16. Healthy, it has no finding, and every
part the float32 rule names is seen in float32, op by op; the probes reach inside its DecoderBlock and its tied
embedding's second call (the logits); the input limits are token ids. A model whose MLP weights grew until
float16 overflows (a real risk of a long run) is an error, with a fix that makes it go away."""

import keras
import numpy as np
import pytest
import yaml
from keras import layers, ops

from pipeline import cli, models, precision
from pipeline.artifacts import MODEL_FILE
from pipeline.config import load_config
from pipeline.data import load_datasets
from pipeline.diagnose import diagnose
from pipeline.diagnose.ops import audit_ops

from lm_helpers import TINY_LM_MODEL, write_texts

pytestmark = pytest.mark.timeout(300)

TINY_LM = [*TINY_LM_MODEL, "train.batch_size=16", "experiment=tiny_lm"]


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_texts(tmp_path_factory.mktemp("text"))


def lm_config(runs_dir, text_files, *more):
    return load_config(None, [*TINY_LM, f"data.path={text_files}/*.txt", f"train.runs_dir={runs_dir}", *more])


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, text_files):
    return diagnose(lm_config(tmp_path_factory.mktemp("runs"), text_files), probe_batches=2)


def test_a_healthy_language_model_has_no_finding_and_its_float32_parts_compute_in_float32(healthy):
    assert healthy.ok and healthy.findings == [] and healthy.skipped == [] and healthy.at_risk == []
    ops_seen = {(o.layer, o.op): (o.count, o.dtype) for o in healthy.operations}
    # The attention scores and their weighted sum, the softmax, the LayerNorms, the logits and the loss: float32.
    assert ops_seen[("block_1", "BatchMatMulV2")] == (2, "float32")
    assert ops_seen[("block_1", "Softmax")] == (1, "float32")
    for norm in ("block_1/norm_1", "block_1/norm_2", "final_norm"):
        assert ops_seen[(norm, "Rsqrt")] == (1, "float32")
    assert ops_seen[("token_embedding", "model output")] == (1, "float32")  # the tied embedding's logits
    assert ops_seen[("(loss)", "SparseSoftmaxCrossEntropyWithLogits")] == (1, "float32")
    assert ops_seen[("(loss)", "loss value")] == (1, "float32")
    # The projections and the MLP compute in float16 (where the FLOPs are).
    dtypes = {d.name: d.compute_dtype for d in healthy.layers}
    assert {dtypes[p] for p in ("block_1/attention/query", "block_1/attention/value", "block_1/mlp_1",
                                "block_1/mlp_2")} == {"float16"}
    assert dtypes["block_1/norm_1"] == dtypes["final_norm"] == "float32"


def test_the_probes_reach_inside_the_blocks_and_the_tied_logits(healthy):
    ranges = {r.layer: r for r in healthy.ranges}
    assert ranges["block_1/mlp_1"].compute_dtype == "float16" and ranges["block_1/mlp_1"].values > 0
    assert ranges["block_1/attention/key"].compute_dtype == "float16"
    assert ranges["block_1"].compute_dtype == "float32"  # the block's output is the float32 residual stream
    assert ranges["token_embedding (call 2)"].values == 2 * 16 * 32 * 259  # 2 batches of logits
    assert {g.layer for g in healthy.gradients} >= {"block_1/mlp_1", "block_1/attention/query", "token_embedding"}
    order = [d.layer for d in healthy.divergence]  # graph order: the block's insides before its output
    assert order.index("block_1/norm_1") < order.index("block_1/mlp_2") < order.index("block_1") < order.index(
        "final_norm") < order.index("token_embedding (call 2)")
    assert healthy.first_divergence is None
    # Input limits as ids: every token id over the longest context, then ids outside the vocabulary.
    assert healthy.edge["rows"] == 259 and healthy.edge["nonfinite"] == 0
    assert "each token id 0..258 repeated over the longest context (32)" in healthy.edge["what"]
    assert healthy.edge["far"]["rows"] == 4 and "-1, 259" in healthy.edge["far"]["what"]
    text = healthy.text()
    assert "numerically sensitive ops" in text and "input limits probe: 259 rows, each token id" in text


def test_mlp_weights_that_overflow_float16_are_an_error_whose_fix_clears_it(tmp_path, text_files, capsys):
    cfg = lm_config(tmp_path, text_files)
    precision.apply_policy(cfg.precision)
    datasets = load_datasets(cfg.data, seed=cfg.seed)
    model = models.build_model(cfg.model, datasets.spec, datasets.statistics)
    mlp = model.get_layer("block_1").mlp_1
    mlp.kernel.assign(mlp.kernel * 1e5)  # activations of ~1e5: past float16's 65504
    cfg.run_dir.mkdir(parents=True)
    model.save(cfg.run_dir / MODEL_FILE)
    keras.config.set_dtype_policy("float32")

    found = diagnose(cfg, probe_batches=1)
    assert not found.ok
    errors = {f.layer: f for f in found.findings if f.severity == "error"}
    assert "exceed float16's maximum 65504" in errors["block_1/mlp_1"].problem
    assert yaml.safe_load(errors["block_1/mlp_1"].fix) == {"precision": {"float32_layers": ["block_1/mlp_1"]}}
    assert "block_1/mlp_1" in {r.layer for r in found.at_risk}
    assert found.first_divergence is not None
    # The command: the same findings, exit 1.
    config = tmp_path / "tiny_lm.yaml"
    config.write_text(yaml.safe_dump(_nested(TINY_LM)))
    assert cli.main(["diagnose", str(config), "--batches", "1", "--set", f"data.path={text_files}/*.txt",
                     "--set", f"train.runs_dir={tmp_path}"]) == 1
    assert "ERROR  block_1/mlp_1:" in capsys.readouterr().out

    # The suggested override: the MLP in float32, and its activations are no risk any more.
    fixed = diagnose(lm_config(tmp_path, text_files, "precision.float32_layers=[block_1/mlp_1, block_1/mlp_2]"),
                     probe_batches=1)
    assert not any(f.layer.startswith("block_1/mlp") for f in fixed.findings)
    assert {r.layer: r.compute_dtype for r in fixed.ranges}["block_1/mlp_1"] == "float32"


def _nested(overrides: list[str]) -> dict:
    config: dict = {}
    for override in overrides:
        key, value = override.split("=", 1)
        section, _, name = key.rpartition(".")
        target = config.setdefault(section, {}) if section else config
        target[name] = yaml.safe_load(value)
    return config


class HalfAttention(layers.Layer):
    """Self-attention written in its layer's compute dtype, softmax included: what the op audit is for (the layer
    audit sees one layer, not the softmax inside its call)."""

    def call(self, x):
        scores = ops.matmul(x, ops.swapaxes(x, -1, -2))
        return ops.matmul(ops.softmax(scores, axis=-1), x)


def test_the_op_audit_finds_a_softmax_computed_in_float16_inside_a_layers_call():
    keras.config.set_dtype_policy("mixed_float16")
    ids = keras.Input((8,), dtype="int32")
    x = layers.Embedding(259, 16, dtype="float32", name="embed")(ids)
    x = HalfAttention(name="half_attention")(x)
    model = keras.Model(ids, layers.Dense(259, dtype="float32", name="logits")(x))
    keras.config.set_dtype_policy("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows, findings = audit_ops(model, loss, np.zeros((1, 8), np.int32), np.zeros((1, 8), np.int32))
    seen = {(r.layer, r.op): (r.count, r.dtype) for r in rows}
    assert seen[("half_attention", "Softmax")] == (1, "float16")
    assert seen[("half_attention", "BatchMatMulV2")] == (2, "float16")
    assert seen[("logits", "model output")] == (1, "float32")
    assert {(f.severity, f.layer) for f in findings} == {("error", "half_attention")}
    assert all(yaml.safe_load(f.fix) == {"precision": {"float32_layers": ["half_attention"]}} for f in findings)
