"""A tiny causal language model (1 block, width 16, context 32) trained by the pipeline's own loops on text files
under mixed_float16: finite loss, nats per byte against the baselines in metrics.json, samples.txt, the model.keras
that loads as it trained, the custom loop with accumulation, warm-up, cosine decay and clipping, a resume from a
mid-epoch checkpoint to the same weights (its export: tests/pipeline/export/test_lm_export.py)."""

import json
import shutil

import keras
import numpy as np
import pytest

from pipeline import models
from pipeline.config import load_config
from pipeline.lm import tokenizers
from pipeline.train import checkpoints, samples, train
from pipeline.train.history import TIMING_KEYS

from lm_helpers import TINY_LM_MODEL, write_texts

pytestmark = pytest.mark.timeout(300)

TINY_LM = [*TINY_LM_MODEL, "train.epochs=4", "train.batch_size=16", "train.optimizer=adam", "train.learning_rate=0.01",
           "train.checkpoint_every_steps=3", "train.keep_checkpoints=50"]


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    """Four files of repeated sentences, 1.5-2 KB each: a split by document, three for training and one for
    validation, and about 12 batches of 16 windows an epoch."""
    return write_texts(tmp_path_factory.mktemp("text"))


def lm_config(runs_dir, text_files, *more):
    return load_config(None, [*TINY_LM, f"data.path={text_files}/*.txt", f"train.runs_dir={runs_dir}",
                              "experiment=tiny_lm", *more])


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, text_files):
    run = train(lm_config(tmp_path_factory.mktemp("runs"), text_files))
    keras.config.set_dtype_policy("float32")
    return run


def without_timing(history):
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


def test_it_trains_under_mixed_float16_and_learns_below_the_baselines(lm_run):
    assert lm_run.policy.name == "mixed_float16"
    assert isinstance(lm_run.model.optimizer, keras.optimizers.LossScaleOptimizer)
    metrics = json.loads((lm_run.run_dir / "metrics.json").read_text())
    history = json.loads((lm_run.run_dir / "history.json").read_text())
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["val_nats_per_byte"]) for h in history)
    assert history[-1]["val_nats_per_byte"] < history[0]["val_nats_per_byte"]
    assert all("loss_scale" in h and "skipped_steps" in h for h in history)  # the loss-scale telemetry
    assert metrics["loss_scale_health"] and metrics["final_loss_scale"] > 0
    # Nats per byte over every target byte, with both baselines on the same validation bytes.
    baselines = metrics["baselines"]
    assert baselines["validation_bytes"] == lm_run.datasets.val_examples * 32
    assert 0 < baselines["bigram_nats_per_byte"] < baselines["unigram_nats_per_byte"] < np.log(256)
    loss = metrics["val_nats_per_byte"]
    assert metrics["val_nats_per_byte_vs_unigram"] == pytest.approx(loss / baselines["unigram_nats_per_byte"], abs=1e-4)
    assert metrics["val_nats_per_byte_vs_bigram"] == pytest.approx(loss / baselines["bigram_nats_per_byte"], abs=1e-4)
    assert loss < baselines["unigram_nats_per_byte"]  # four sentences repeated: learnt within four epochs
    assert not any("accuracy" in key for key in metrics)  # no classifier's metrics
    # The data record: the split and the baselines, as the run used them.
    recorded = json.loads((lm_run.run_dir / "data" / "text.json").read_text())
    assert recorded["corpus"]["split"] == "by document" and recorded["corpus"]["validation"]["documents"] == 1
    assert recorded["baselines"]["bigram"] == pytest.approx(baselines["bigram_nats_per_byte"], abs=1e-4)


def test_the_loss_is_float32_cross_entropy_over_every_position(lm_run):
    model, datasets = lm_run.model, lm_run.datasets
    x, y = datasets.validation_rows(8)
    logits = keras.ops.convert_to_numpy(model(x, training=False))
    assert logits.dtype == np.float32 and logits.shape == (8, 32, 259)
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, y[..., None], axis=-1).mean()
    loss = float(model.compute_loss(x=x, y=y, y_pred=keras.ops.convert_to_tensor(logits), training=False))
    assert loss == pytest.approx(expected, rel=1e-5)


def test_each_epoch_appends_a_greedy_sample_of_the_prompt(lm_run):
    blocks = samples.read_blocks(lm_run.run_dir / "samples.txt")
    assert [epoch for epoch, _ in blocks] == [1, 2, 3, 4]
    history = json.loads((lm_run.run_dir / "history.json").read_text())
    for (epoch, block), entry in zip(blocks, history):
        assert block.startswith(f"--- epoch {epoch} (val_nats_per_byte {entry['val_nats_per_byte']:.4f}) ---\n")
        assert block.split("\n")[1].startswith(tokenizers.SAMPLE_PROMPT)
    writer = samples.SampleWriter(lm_run.run_dir, finished_epochs=4)
    writer.set_model(lm_run.model)
    last = blocks[-1][1].split("\n", 1)[1]
    assert last.startswith(tokenizers.SAMPLE_PROMPT + writer.complete(tokenizers.SAMPLE_PROMPT))  # greedy: the same text again


def test_model_keras_loads_with_its_precision_as_trained(lm_run, text_files):
    cfg = lm_config(lm_run.run_dir.parent, text_files)
    keras.config.set_dtype_policy("mixed_float16")
    loaded = models.load_trained_model(lm_run.run_dir / "model.keras", cfg.model)
    policies = lambda model: {path: layer.dtype_policy.name for path, layer in models.layer_paths(model).items()}
    assert policies(loaded) == policies(lm_run.model)
    assert policies(loaded)["block_1/norm_1"] == "float32" and policies(loaded)["block_1/mlp_1"] == "mixed_float16"
    x, _ = lm_run.datasets.validation_rows(4)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(lm_run.model(x)))


def test_a_run_resumed_mid_epoch_ends_with_the_same_weights_and_samples(lm_run, tmp_path, text_files):
    steps_per_epoch = lm_run.metrics["steps"] // lm_run.metrics["epochs"]
    assert steps_per_epoch > 3, "checkpoint 3 must fall inside the first epoch"
    copy = tmp_path / "tiny_lm"
    shutil.copytree(lm_run.run_dir, copy)
    for checkpoint in (copy / "checkpoints").iterdir():  # as if killed after step 3
        if int(checkpoint.name.split("-")[1]) > 3:
            shutil.rmtree(checkpoint)
    assert checkpoints.read_state(checkpoints.latest_checkpoint(copy)).step_in_epoch == 3

    resumed = train(lm_config(tmp_path, text_files))
    assert resumed.metrics["weights_sha1"] == lm_run.metrics["weights_sha1"]
    assert resumed.metrics["val_nats_per_byte"] == lm_run.metrics["val_nats_per_byte"]
    assert without_timing(json.loads((copy / "history.json").read_text())) == \
        without_timing(json.loads((lm_run.run_dir / "history.json").read_text()))
    assert (copy / "samples.txt").read_text() == (lm_run.run_dir / "samples.txt").read_text()


def test_the_custom_loop_trains_it_with_accumulation_warmup_cosine_and_clipping(tmp_path, text_files):
    cfg = lm_config(tmp_path, text_files, "train.loop=custom", "train.gradient_accumulation_steps=2",
                    "train.warmup_steps=2", "train.learning_rate_schedule=cosine", "train.global_clipnorm=1.0",
                    "train.epochs=2")
    run = train(cfg)
    history = json.loads((cfg.run_dir / "history.json").read_text())
    assert all(np.isfinite(h["loss"]) for h in history)
    # Below the untrained model's uniform guess, and better after the second epoch than after the first.
    assert history[1]["val_nats_per_byte"] < history[0]["val_nats_per_byte"] < np.log(259)
    assert int(run.model.optimizer.iterations) == run.metrics["steps"] // 2  # one update per two batches
    assert [epoch for epoch, _ in samples.read_blocks(cfg.run_dir / "samples.txt")] == [1, 2]

