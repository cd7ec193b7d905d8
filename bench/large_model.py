"""Figure 13: a large language model through the pipeline per policy (configs/lm_85m.yaml: 85 M parameters).

For float32 and mixed_bfloat16 training: `python -m pipeline train` for a few steps (steps/s of the last epoch, the
peak RSS and the estimate printed before the first step, metrics.json), `python -m pipeline export` serving float32
and bfloat16 respectively (wall time and peak RSS of the export process), the version's variable bytes, and the
version's decode through the in-process runner (prefill, then decode_step 16 tokens a call, as the server steps it)
at batch 1 and 8, with the first token of a 200-byte prompt. Decode at batch 1 is set against its roofline: the
memory read bandwidth measured here (TensorFlow summing 512 MiB) over the bytes a token reads (the weights and one
row's cache). Each train and export runs in a process of its own, so its peak is its own; --quick runs a one-block
model in this process (its peaks are this process's, not a measurement).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import timing
from bench.workloads import Sizes

TITLE = "Large language model: training, export and decode per policy (configs/lm_85m.yaml)"
TARGET = "bfloat16 decode >= 1.8x float32's tokens/s at batch 1"
COLUMNS = ["policy", "serving", "train_steps_per_second", "train_peak_rss_mib", "estimated_peak_mib",
           "export_seconds", "export_peak_rss_mib", "variables_mib", "first_token_ms", "decode_tokens_per_second_b1",
           "decode_tokens_per_second_b8", "roofline_share_b1", "target_met"]
POLICIES = (("float32", "float32"), ("mixed_bfloat16", "bfloat16"))  # (training policy, export.serving_policy)
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "lm_85m.yaml"
ROOT = CONFIG.parent.parent
PROMPT = (b"The quick brown fox jumps over the lazy dog. " * 5)[:200]
TOKENS_PER_CALL = 16  # what the server's decode loop asks of decode_step (serving/generation/decoder.py)


def run(sizes: Sizes, work_dir: Path, in_process: bool = False) -> dict:
    bandwidth = read_bandwidth()
    rows = []
    for policy, serving in POLICIES:
        overrides = [f"experiment=bench_lm_{policy}", f"precision.policy={policy}",
                     f"export.serving_policy={serving}", f"train.runs_dir={work_dir / 'runs'}",
                     f"export.base_path={work_dir / 'models'}", *sizes.large_model]
        trained = _command("train", overrides, in_process)
        exported = _command("export", overrides, in_process)
        run_dir = work_dir / "runs" / f"bench_lm_{policy}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        history = json.loads((run_dir / "history.json").read_text())
        steps_per_epoch = metrics["steps"] / len(history)  # the sizes give epochs of equal length
        version = max((work_dir / "models" / f"bench_lm_{policy}").iterdir(), key=lambda p: int(p.name))
        decode = measure_decode(version)
        from serving.servable import saved_model

        weights = sum(saved_model.weights_by_dtype(version).values())
        roofline = bandwidth / (weights + decode["cache_bytes_per_row"])
        rows.append({
            "policy": policy, "serving": serving,
            "train_steps_per_second": steps_per_epoch / history[-1]["seconds"],
            "train_peak_rss_mib": (trained["peak_rss_bytes"] or metrics["peak_rss_bytes"]) / 2**20,
            "estimated_peak_mib": metrics["memory_estimate"]["peak_bytes"] / 2**20,
            "export_seconds": exported["seconds"], "export_peak_rss_mib": exported["peak_rss_bytes"] / 2**20,
            "variables_mib": weights / 2**20, "first_token_ms": decode["first_token_s"] * 1e3,
            "decode_tokens_per_second_b1": decode[1], "decode_tokens_per_second_b8": decode[8],
            "roofline_share_b1": decode[1] / roofline, "target_met": None})
        timing.progress(f"large_model: {policy}: {rows[-1]['train_steps_per_second']:.3f} steps/s, decode "
                        f"{decode[1]:.1f} tokens/s at batch 1 ({rows[-1]['roofline_share_b1']:.2f} of the roofline)")
    float32, bfloat16 = rows
    bfloat16["target_met"] = bfloat16["decode_tokens_per_second_b1"] >= 1.8 * float32["decode_tokens_per_second_b1"]
    return {"rows": rows, "bandwidth_gb_s": bandwidth / 1e9,
            "notes": [f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (TensorFlow summing 512 MiB); roofline at "
                      "batch 1 = bandwidth / (variable bytes + one row's key/value cache over the whole context)",
                      "train steps/s: the last epoch's; mixed_bfloat16 / float32 = "
                      f"{bfloat16['train_steps_per_second'] / float32['train_steps_per_second']:.2f}x",
                      "smoke run: in this process" if in_process else
                      "each train and export in a process of its own (its peak RSS its own)"],
            "setup": {"config": str(CONFIG.relative_to(ROOT)), "overrides": list(sizes.large_model),
                      "prompt_bytes": len(PROMPT), "tokens_per_call": TOKENS_PER_CALL}}


def _command(verb: str, overrides: list[str], in_process: bool) -> dict:
    """`python -m pipeline VERB configs/lm_85m.yaml --set ...`: its wall seconds and its peak RSS (None in process)."""
    started = time.perf_counter()
    if in_process:
        from pipeline.config import load_config

        cfg = load_config(CONFIG, overrides)
        if verb == "train":
            from pipeline.train import train

            train(cfg)
        else:
            from pipeline.export import export

            export(cfg)
        import keras

        keras.config.set_dtype_policy("float32")
        return {"seconds": time.perf_counter() - started, "peak_rss_bytes": _own_peak_rss()}
    process = subprocess.Popen([sys.executable, "-m", "pipeline", verb, str(CONFIG),
                                *(f"--set={o}" for o in overrides)], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    error = process.stderr.read().decode(errors="replace")
    if process.returncode:
        raise RuntimeError(f"pipeline {verb} exited {process.returncode}: {error[-2000:]}")
    return {"seconds": time.perf_counter() - started, "peak_rss_bytes": usage.ru_maxrss * 1024}


def _own_peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_bandwidth() -> float:
    """Bytes per second TensorFlow reads summing 512 MiB of float32 (the best of 10, after 2 warm-up runs)."""
    import tensorflow as tf

    values = tf.ones((128 * 2**20,), tf.float32)
    total = tf.function(lambda: tf.reduce_sum(values))
    total(), total()
    best = min(timing.seconds_per_call(lambda: total().numpy(), 1) for _ in range(10))
    return 512 * 2**20 / best


def measure_decode(version: Path) -> dict:
    """The version's first token (batch 1, PROMPT cut to fit) and decode tokens/s at batch 1 and 8, as the server's
    decode loop drives it (serving/generation/decoder.py)."""
    import numpy as np

    from serving.generation.decoder import DECODE_STEP, PREFILL, DecodeProtocol
    from serving.servable.runner import Runner

    runner = Runner.load(version, model_name="lm")
    protocol = DecodeProtocol.of(runner)
    calls = 2
    new_tokens = 1 + (calls + 1) * TOKENS_PER_CALL
    prompt = PROMPT[:max(1, protocol.context_length - new_tokens - 2)]
    found = {"cache_bytes_per_row": protocol.cache_bytes_per_row}
    for rows in (1, 8):
        settings = {"temperature": np.zeros(rows, np.float32), "top_k": np.zeros(rows, np.int32),
                    "seed": np.zeros(rows, np.int64), "row": np.arange(rows, dtype=np.int32)}
        inputs = {"prompts": np.array([prompt] * rows, dtype=object),
                  "max_new_tokens": np.full(rows, new_tokens, np.int32), **settings}
        for _ in range(2):  # traced and warm
            runner.run_with_state(PREFILL, inputs, {}, protocol.cache_names)
        started = time.perf_counter()
        out, caches = runner.run_with_state(PREFILL, inputs, {}, protocol.cache_names)
        if rows == 1:
            found["first_token_s"] = time.perf_counter() - started
        step = np.ones(rows, np.int32)
        seconds = []
        for call in range(calls + 1):  # the first call warms decode_step up
            started = time.perf_counter()
            _, caches = runner.run_with_state(
                DECODE_STEP, {"token": out["token"], "position": out["position"] + step - 1, "step": step,
                              **settings, "steps": np.array(TOKENS_PER_CALL, np.int32)}, caches, protocol.cache_names)
            seconds.append(time.perf_counter() - started)
            step = step + TOKENS_PER_CALL
        found[rows] = rows * calls * TOKENS_PER_CALL / sum(seconds[1:])
    return found


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    labels = [row["policy"] for row in rows]
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [row["decode_tokens_per_second_b1"] for row in rows], width=0.4,
           label="decode, batch 1", color="#1f77b4")
    ax.bar([p + 0.2 for p in positions], [row["decode_tokens_per_second_b8"] / 8 for row in rows], width=0.4,
           label="decode, batch 8 (per row)", color="#ff7f0e")
    ax.set_xticks(list(positions), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title("13. large language model: decode per policy", fontsize=9)
    ax.legend(fontsize=7)
