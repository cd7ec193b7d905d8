"""A language model's sample completions while it trains: at each epoch end, the greedy completion of a fixed
prompt, generated as a served model would (generate.Generator: prefill and the key/value cache), is added to the
run directory's samples.txt (rewritten whole, atomically) and logged, so a person can watch the model learn.

samples.txt holds one block per finished epoch:

    --- epoch 3 (val_nats_per_byte 2.1043) ---
    The <completion>

A resumed run keeps the blocks of the epochs its checkpoint finished and drops any a killed process wrote after it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import keras
import tensorflow as tf

from pipeline import artifacts
from pipeline.lm import generate, tokenizers
from pipeline.artifacts import SAMPLES_FILE
from pipeline.models.build import NATS_PER_BYTE

log = logging.getLogger(__name__)

NEW_TOKENS = 120  # at most; fewer when the context is shorter (prompt and completion must fit it)
_HEADING = re.compile(r"^--- epoch (\d+)\b.*---$", re.MULTILINE)


class SampleWriter(keras.callbacks.Callback):
    """Writes samples.txt at each epoch end; finished_epochs: the epochs the run resumes after (0: a new run);
    tokenizer: the run's (pipeline/lm/tokenizers.py)."""

    def __init__(self, run_dir: Path, finished_epochs: int, tokenizer=tokenizers.BYTES):
        super().__init__()
        self.tokenizer = tokenizer
        self.path = run_dir / SAMPLES_FILE
        self.blocks = [block for epoch, block in read_blocks(self.path) if epoch <= finished_epochs]
        self.generator: generate.Generator | None = None

    def on_epoch_end(self, epoch, logs=None):
        prompt = self.tokenizer.sample_prompt
        completion = self.complete(prompt)
        loss = (logs or {}).get(f"val_{NATS_PER_BYTE}")
        heading = f"--- epoch {epoch + 1}" + (f" (val_{NATS_PER_BYTE} {loss:.4f})" if loss is not None else "") + " ---"
        self.blocks.append(f"{heading}\n{prompt}{completion}\n\n")
        artifacts.write_text_atomic(self.path, "".join(self.blocks))
        log.info("sample after epoch %d: %r", epoch + 1, prompt + completion)

    def complete(self, prompt: str) -> str:
        """The greedy completion of prompt (text; a byte sequence cut inside a character shows U+FFFD)."""
        if self.generator is None:  # traced at the first epoch end, reused after
            self.generator = generate.Generator(self.model, tokenizer=self.tokenizer)
        budget = self.generator.context_length - len(prompt.encode()) - 1  # BOS and the prompt (≤ 1 token a byte)
        out = self.generator.generate(tf.constant([prompt]), tf.constant(max(1, min(NEW_TOKENS, budget))),
                                      tf.constant(0.0), tf.constant(0), tf.constant(0, tf.int64))
        return out["completions"].numpy()[0].decode("utf-8", errors="replace")


def read_blocks(path: Path) -> list[tuple[int, str]]:
    """(epoch, block) for each block of an existing samples.txt; none when there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    starts = [match.start() for match in _HEADING.finditer(text)] + [len(text)]
    return [(int(_HEADING.match(text, start).group(1)), text[start:end]) for start, end in zip(starts, starts[1:])]
