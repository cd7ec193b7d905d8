"""Figure 14: a pretrained GPT-2 through the pipeline (issue 43; docs/pretrained.md), at GPT-2 small's body
(12 blocks of width 768, 12 heads, 1,024 positions) over the pipeline's 457-id GPT-2 vocabulary:

- parity: bench/gpt2_weights.py's weights written as a Hugging Face checkpoint, imported (pipeline/lm/gpt2.py) and
  run teacher-forced over 4 x 128 tokens in float32, against GPT2LMHeadModel's logits on the same weights
  (bench/fixtures/, made once by bench/make_gpt2_reference.py in a throwaway environment): the max abs difference;
- the tokenizer inside a graph (pipeline/lm/bpe.py): MB/s over the embedded corpus as one text, with the 457-id
  vocabulary and, where the tests have fetched it (.gpt2-vocabulary/, docs/testing.md), GPT-2's own;
- fine-tuning: `pipeline.train` from that checkpoint under mixed_bfloat16 on the embedded corpus, a few epochs of a
  few steps: the validation loss at the first evaluation and at the last.
The smoke run does the same with a 2-block model of width 32.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench import gpt2_weights, timing
from bench.workloads import Sizes

TITLE = "Pretrained GPT-2: parity with Hugging Face's, the tokenizer in a graph, fine-tuning (docs/pretrained.md)"
TARGET = "logits within 1e-4 of GPT2LMHeadModel's; tokenizer >= 1 MB/s; fine-tuning lowers the validation loss"
COLUMNS = ["measure", "value", "unit", "target_met"]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
REAL_VOCABULARY = Path(__file__).resolve().parent.parent / ".gpt2-vocabulary" / "gpt2"


def write_checkpoint(shape: str, directory: Path) -> Path:
    """gpt2_weights' weights of shape as a checkpoint directory in Hugging Face's layout, with the 457-id vocabulary."""
    import shutil

    from pipeline.lm import bpe, gpt2
    from pipeline.lm.safetensors_file import write

    num_layers, width, num_heads, n_positions, vocab_size = gpt2_weights.SHAPES[shape]
    config = gpt2.Gpt2Config(vocab_size, n_positions, num_layers, num_heads, width, 4 * width, 1e-5, "gelu_tanh", True)
    directory.mkdir(parents=True)
    write(directory / gpt2.WEIGHTS_FILE, {f"transformer.{k}": v
                                          for k, v in gpt2_weights.weights(gpt2.expected_shapes(config)).items()})
    (directory / gpt2.CONFIG_FILE).write_text(json.dumps(gpt2.config_json(config)))
    for name in (bpe.VOCAB_FILE, bpe.MERGES_FILE):
        shutil.copy(bpe.PACKAGED / name, directory)
    return directory


def parity(shape: str, checkpoint: Path) -> dict:
    import keras
    import numpy as np

    from pipeline.lm import gpt2

    keras.config.set_dtype_policy("float32")
    started = time.perf_counter()
    model = gpt2.load(checkpoint)
    load_seconds = time.perf_counter() - started
    reference = np.load(FIXTURES / f"gpt2_{shape}.npz")
    logits = np.asarray(model(reference["ids"]))[:, gpt2_weights.KEPT_POSITIONS]
    parameters = model.count_params() - model.get_layer("token_embedding").embeddings.shape[1]  # less the stray row
    return {"max_abs_diff": float(np.abs(logits - reference["logits"]).max()), "load_seconds": load_seconds,
            "parameters": parameters}


def tokenizer_rate(directory: Path, text: bytes, rounds: int) -> float:
    import tensorflow as tf

    from pipeline.lm import bpe

    tokenizer = bpe.read(directory)
    encode = tf.function(lambda texts: tokenizer.encode(texts).flat_values)
    batch = tf.constant([text])
    encode(batch)  # traced
    return len(text) / timing.median([timing.seconds_per_call(lambda: encode(batch), 1) for _ in range(rounds)])


def fine_tune(checkpoint: Path, sizes: Sizes, work_dir: Path) -> list[float]:
    """The validation loss after each epoch of a short fine-tuning run from the checkpoint."""
    from pipeline.config import load_config
    from pipeline.train import train

    cfg = load_config(None, ["experiment=bench_gpt2", "data.source=text", "data.tokenizer=gpt2",
                             "model.kind=causal_lm", f"model.init_from={checkpoint}", "precision.policy=mixed_bfloat16",
                             f"train.runs_dir={work_dir / 'runs'}", "train.optimizer=adam", "train.learning_rate=3e-4",
                             *sizes.pretrained_train])
    train(cfg)
    history = json.loads((cfg.run_dir / "history.json").read_text())
    return [epoch["val_loss"] for epoch in history]


def run(sizes: Sizes, work_dir: Path) -> dict:
    from pipeline.data.text import embedded_corpus
    from pipeline.lm import bpe

    shape = sizes.pretrained_shape
    checkpoint = write_checkpoint(shape, work_dir / "gpt2")
    found = parity(shape, checkpoint)
    rows = [{"measure": f"parity: max abs logit difference vs GPT2LMHeadModel ({shape}, float32, 4 x 128 tokens)",
             "value": found["max_abs_diff"], "unit": "logit", "target_met": found["max_abs_diff"] <= 1e-4}]
    timing.progress(f"pretrained: {shape} ({found['parameters']:,} parameters) imported in "
                    f"{found['load_seconds']:.1f} s, max abs logit difference {found['max_abs_diff']:.2e}")
    text = b"".join(document.text for document in embedded_corpus())[: sizes.pretrained_text_bytes]
    for label, directory in (("457 ids", bpe.PACKAGED), ("GPT-2's 50,257 ids", REAL_VOCABULARY)):
        if not (directory / bpe.MERGES_FILE).exists():
            continue
        rate = tokenizer_rate(directory, text, sizes.pretrained_rounds) / 1e6
        rows.append({"measure": f"tokenizer in a graph, {label}, {len(text):,} bytes as one text", "value": rate,
                     "unit": "MB/s", "target_met": rate >= 1.0})
        timing.progress(f"pretrained: tokenizer ({label}) {rate:.2f} MB/s")
    losses = fine_tune(checkpoint, sizes, work_dir)
    rows += [{"measure": "fine-tuning (mixed_bfloat16): val_loss at the first evaluation", "value": losses[0],
              "unit": "nats/token", "target_met": None},
             {"measure": f"fine-tuning: val_loss after {len(losses)} evaluations", "value": losses[-1],
              "unit": "nats/token", "target_met": losses[-1] < losses[0]}]
    timing.progress(f"pretrained: fine-tuning val_loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {"rows": rows, "setup": {"shape": dict(zip(("num_layers", "width", "num_heads", "n_positions", "vocab_size"),
                                                      gpt2_weights.SHAPES[shape])),
                                    "parameters": found["parameters"], "import_seconds": found["load_seconds"],
                                    "fine_tuning": list(sizes.pretrained_train), "val_losses": losses}}


def plot(figure: dict, ax) -> None:
    losses = figure["setup"]["val_losses"]
    ax.plot(range(1, len(losses) + 1), losses, marker="o")
    ax.set_xlabel("evaluation (epoch)")
    ax.set_ylabel("val_loss (nats/token)")
    parity_row = figure["rows"][0]
    ax.set_title(f"14. GPT-2 fine-tuned from a checkpoint (parity {parity_row['value']:.1e})", fontsize=9)
