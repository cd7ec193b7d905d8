"""The language-model gate's look at the decode path as `python -m serving` computes it when started under oneDNN's
frozen-weights switch (serving/frozen_weights.py), which TensorFlow reads once per process, so it runs in a process
of its own (docs/export.md#language-models).

The exporting process cannot turn the switch on for itself (it may train in the same process, as the tests do),
and with it the decode step's matmuls run other kernels: log-probabilities move by ~1e-7 in float32 and ~1e-3 in
bfloat16 (docs/large-models.md#decode). So before the version is published, a child process started with
TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 loads the written SavedModel and steps the gate's greedy prompts through
prefill and decode_step, as such a server does; lm_parity.Gate.frozen_weights compares its steps with the same steps
in the exporting process.

    python -m pipeline.export.frozen_check REQUEST.json RESULT.json     (what stepped() runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

from pipeline.errors import ExportError
from serving import frozen_weights


def stepped(saved_model: Path, prompts: list[bytes], max_new_tokens: int, tokenizer) -> dict[str, np.ndarray]:
    """lm_parity.stepped_greedy of the SavedModel at saved_model, in a child process under TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1."""
    request = {"saved_model": str(saved_model), "prompts": [list(prompt) for prompt in prompts],
               "max_new_tokens": max_new_tokens, "eos": tokenizer.eos, "pad": tokenizer.pad,
               "op_libraries": list(tokenizer.op_libraries)}
    with tempfile.TemporaryDirectory(prefix="frozen-check-") as folder:
        request_file, result_file = Path(folder) / "request.json", Path(folder) / "result.json"
        request_file.write_text(json.dumps(request))
        env = {**os.environ, frozen_weights.VARIABLE: "1"}
        done = subprocess.run([sys.executable, "-m", __name__, str(request_file), str(result_file)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        if done.returncode != 0 or not result_file.exists():
            last = (done.stdout.strip().splitlines() or ["no output"])[-1]
            raise ExportError(f"the decode check under {frozen_weights.VARIABLE}=1 (a child process) exited "
                              f"{done.returncode}: {last}; nothing was published")
        result = json.loads(result_file.read_text())
    return {"ids": np.array(result["ids"], np.int32), "log_probs": np.array(result["log_probs"], np.float32)}


def main(argv: list[str]) -> int:
    request_file, result_file = map(Path, argv)
    request = json.loads(request_file.read_text())
    if not frozen_weights.is_on():
        print(f"error: {frozen_weights.VARIABLE} is not set to 1 in this process", file=sys.stderr)
        return 2
    import importlib

    import tensorflow as tf

    from pipeline.export import lm_parity

    for library in request["op_libraries"]:  # a sentencepiece tokenizer's ops, registered before the load
        importlib.import_module(library)
    loaded = tf.saved_model.load(request["saved_model"])
    tokenizer = types.SimpleNamespace(eos=request["eos"], pad=request["pad"])
    out = lm_parity.stepped_greedy(loaded.signatures, [bytes(prompt) for prompt in request["prompts"]],
                                   request["max_new_tokens"], tokenizer)
    # float32 → float64 is exact, and json writes a float64 so that it reads back the same
    result_file.write_text(json.dumps({"ids": out["ids"].tolist(),
                                       "log_probs": out["log_probs"].astype(np.float64).tolist()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
