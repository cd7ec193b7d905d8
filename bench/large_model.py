"""Figure 13: a large language model through the pipeline per policy (configs/lm_85m.yaml: 85 M parameters).

For float32 and mixed_bfloat16 training, each step in a process of its own, so each peak RSS is its own:
- `python -m pipeline train` for a few steps: steps/s of the last epoch, the peak RSS beside the estimate the run
  printed before its first step (metrics.json's memory_estimate);
- `python -m pipeline export` serving float32 and bfloat16 respectively: wall time, peak RSS, the version's bytes
  of variables;
- `python -m serving` with that version: OpenAI completions streamed (greedy, as a client sees them) from a
  200-byte prompt: the first token, tokens/s at batch 1 (one stream) and at batch 8 (8 streams at once, which the
  server's decode loop steps together), and the server's RSS with the version loaded, after the streams; the same
  again from a second server started beside it under TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 (oneDNN keeps each
  matmul's weight pre-packed, docs/serving.md#frozen-weights), so each CPU shows whether the switch pays.
Decode at batch 1 is set against its roofline: the memory read bandwidth measured here (TensorFlow summing
512 MiB) over the bytes a token reads (the variables and one row's key/value cache over the whole context, an
upper bound of what attention reads). The quick sizes run a one-block model the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import machine, result_files, timing
from bench.server_processes import RunningServer, running_servers
from bench.streaming import stream, tokens_per_second
from bench.workloads import Sizes
from serving import frozen_weights

TITLE = "Large language model: training, export and served decode per policy (configs/lm_85m.yaml)"
TARGET = "bfloat16 served decode >= 1.8x float32's tokens/s at batch 1"
COLUMNS = ["policy", "serving", "train_steps_per_second", "train_peak_rss_mib", "estimated_peak_mib",
           "export_seconds", "export_peak_rss_mib", "variables_mib", "server_rss_mib", "first_token_ms",
           "decode_tokens_per_second_b1", "decode_tokens_per_second_b8", "roofline_share_b1",
           "frozen_tokens_per_second_b1", "frozen_tokens_per_second_b8", "frozen_server_rss_mib", "target_met"]
POLICIES = (("float32", "float32"), ("mixed_bfloat16", "bfloat16"))  # (training policy, export.serving_policy)
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "lm_85m.yaml"
ROOT = CONFIG.parent.parent
PROMPT = (b"The quick brown fox jumps over the lazy dog. " * 5)[:200].decode()
STREAMS_B1 = 3  # batch-1 streams a policy; the median of each measure
CONCURRENT = 8


def run(sizes: Sizes, work_dir: Path) -> dict:
    bandwidth = read_bandwidth()
    rows = []
    for policy, serving in POLICIES:
        overrides = [f"experiment=bench_lm_{policy}", f"precision.policy={policy}",
                     f"export.serving_policy={serving}", f"train.runs_dir={work_dir / 'runs'}",
                     f"export.base_path={work_dir / 'models'}", *sizes.large_model]
        trained = pipeline_command("train", overrides, work_dir / f"train_{policy}.log")
        exported = pipeline_command("export", overrides, work_dir / f"export_{policy}.log")
        run_dir = work_dir / "runs" / f"bench_lm_{policy}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        history = json.loads((run_dir / "history.json").read_text())
        steps_per_epoch = metrics["steps"] / len(history)  # the sizes give epochs of equal length
        version = max((work_dir / "models" / f"bench_lm_{policy}").iterdir(), key=lambda p: int(p.name))
        from serving.servable import saved_model

        weights = sum(saved_model.weights_by_dtype(version).values())
        facts = json.loads((version / "assets.extra" / "pipeline.json").read_text())["language_model"]
        served, frozen = served_decode(version.parent, facts["context_length"], work_dir / f"serve_{policy}")
        roofline = bandwidth / (weights + facts["kv_cache"]["bytes_per_sequence"])
        rows.append({
            "policy": policy, "serving": serving,
            "train_steps_per_second": steps_per_epoch / history[-1]["seconds"],
            "train_peak_rss_mib": trained["peak_rss_bytes"] / 2**20,
            "estimated_peak_mib": metrics["memory_estimate"]["peak_bytes"] / 2**20,
            "export_seconds": exported["seconds"], "export_peak_rss_mib": exported["peak_rss_bytes"] / 2**20,
            "variables_mib": weights / 2**20, "server_rss_mib": served["server_rss_mib"],
            "first_token_ms": served["first_token_s"] * 1e3,
            "decode_tokens_per_second_b1": served["b1"], "decode_tokens_per_second_b8": served["b8"],
            "roofline_share_b1": served["b1"] / roofline, "frozen_tokens_per_second_b1": frozen["b1"],
            "frozen_tokens_per_second_b8": frozen["b8"], "frozen_server_rss_mib": frozen["server_rss_mib"],
            "target_met": None})
        timing.progress(f"large_model: {policy}: {rows[-1]['train_steps_per_second']:.3f} steps/s, served decode "
                        f"{served['b1']:.1f} tokens/s at batch 1 ({rows[-1]['roofline_share_b1']:.2f} of the "
                        f"roofline), {served['b8']:.1f} at batch 8")
    float32, bfloat16 = rows
    bfloat16["target_met"] = bfloat16["decode_tokens_per_second_b1"] >= 1.8 * float32["decode_tokens_per_second_b1"]
    ratio = lambda key: bfloat16[key] / float32[key]  # noqa: E731 - a one-line helper for the notes
    return {"rows": rows, "bandwidth_gb_s": bandwidth / 1e9,
            "notes": [f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (TensorFlow summing 512 MiB); roofline at "
                      "batch 1 = bandwidth / (variable bytes + one row's key/value cache over the whole context)",
                      f"mixed_bfloat16 / float32: training steps/s {ratio('train_steps_per_second'):.2f}x (the last "
                      f"epoch's), served decode at batch 1 {ratio('decode_tokens_per_second_b1'):.2f}x, first token "
                      f"{ratio('first_token_ms'):.2f}x",
                      "each train, export and server a process of its own (its peak RSS its own); decode is "
                      "OpenAI completions streamed by python -m serving, greedy",
                      "frozen_*: the same streams from a server under TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1, whose matmuls "
                      "keep the weight layout of the first batch size they run (docs/serving.md#frozen-weights): "
                      + ", ".join(frozen_gains(row) for row in rows)],
            "setup": {"config": str(CONFIG.relative_to(ROOT)), "overrides": list(sizes.large_model),
                      "prompt_bytes": len(PROMPT), "streams_batch_1": STREAMS_B1, "streams_batch_8": CONCURRENT}}


def frozen_gains(row: dict) -> str:
    """The frozen-weights server's tokens/s over the default server's, at batch 1 and at CONCURRENT streams."""
    gain = {batch: row[f"frozen_tokens_per_second_{batch}"] / row[f"decode_tokens_per_second_{batch}"]
            for batch in ("b1", "b8")}
    return f"{row['policy']} {gain['b1']:.2f}x at batch 1, {gain['b8']:.2f}x at batch {CONCURRENT}"


def pipeline_command(verb: str, overrides: list[str], log_path: Path) -> dict:
    """`python -m pipeline VERB configs/lm_85m.yaml --set ...` in a child process: its wall seconds and peak RSS."""
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "pipeline", verb, str(CONFIG),
                                    *(f"--set={o}" for o in overrides)], cwd=ROOT, stdout=log, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        tail = " | ".join(log_path.read_text(errors="replace").splitlines()[-5:])
        raise RuntimeError(f"pipeline {verb} exited {process.returncode}: {tail} (log: {log_path})")
    return {"seconds": time.perf_counter() - started, "peak_rss_bytes": usage.ru_maxrss * 1024}


def served_decode(base_path: Path, context: int, log_stem: Path) -> tuple[dict, dict]:
    """The version served by two `python -m serving` processes started together, the second under
    TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1, measured one after the other (the idle one waits): streamed_rates of each."""
    flags = ["--model_name=lm", f"--model_base_path={base_path}"]
    setups = [(flags, log_stem.with_name(log_stem.name + suffix), True) for suffix in (".log", "_frozen.log")]
    environments = [{}, {frozen_weights.VARIABLE: "1"}]
    with running_servers(setups, environments=environments) as servers:
        for server, environment in zip(servers, environments):  # each says which way it runs: no mislabelled row
            if frozen_weights.describe(environment) not in server.log_path.read_text(errors="replace"):
                raise RuntimeError(f"the server does not say '{frozen_weights.describe(environment)}' "
                                   f"(log: {server.log_path})")
        return streamed_rates(servers[0], context), streamed_rates(servers[1], context)


def streamed_rates(server: RunningServer, context: int) -> dict:
    """Streamed greedy completions of PROMPT (cut to fit the context) from a server: first token and tokens/s of
    one stream (the medians of STREAMS_B1), tokens/s of CONCURRENT streams at once (their tokens after each one's
    first over the time from the last first token to the last end), the server's RSS after them."""
    prompt = PROMPT[:min(len(PROMPT), context // 2)]
    new_tokens = context - len(prompt.encode()) - 8  # within the context, whatever BOS/EOS the tokenizer adds
    address = server.rest_address
    stream(address, prompt, new_tokens)  # the signatures warm up
    alone = []
    for _ in range(STREAMS_B1):
        time.sleep(0.1)  # both processes idle, as a request after a pause finds them
        alone.append(stream(address, prompt, new_tokens))
    together: list[tuple[float, float, int]] = []

    def one() -> None:
        start = time.perf_counter()
        first, tokens, total = stream(address, prompt, new_tokens)
        together.append((start + first, start + total, tokens))

    threads = [threading.Thread(target=one) for _ in range(CONCURRENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(together) != CONCURRENT:
        raise RuntimeError(f"{CONCURRENT - len(together)} of {CONCURRENT} concurrent streams failed "
                           f"(log: {server.log_path})")
    last_first, last_end = max(t[0] for t in together), max(t[1] for t in together)
    return {"first_token_s": timing.median([s[0] for s in alone]),
            "b1": timing.median([tokens_per_second(s) for s in alone]),
            "b8": sum(t[2] - 1 for t in together) / (last_end - last_first),
            "server_rss_mib": machine.rss_mib(server.process.pid)}


def read_bandwidth() -> float:
    """Bytes per second TensorFlow reads summing 512 MiB of float32 (the best of 10, after 2 warm-up runs)."""
    import tensorflow as tf

    values = tf.ones((128 * 2**20,), tf.float32)
    total = tf.function(lambda: tf.reduce_sum(values))
    total(), total()
    best = min(timing.seconds_per_call(lambda: total().numpy(), 1) for _ in range(10))
    return 512 * 2**20 / best


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    result_files.grouped_bars(
        ax, rows, ("served decode, batch 1", [row["decode_tokens_per_second_b1"] for row in rows]),
        (f"served decode, batch {CONCURRENT} (per stream)",
         [row["decode_tokens_per_second_b8"] / CONCURRENT for row in rows]),
        ("frozen weights, batch 1", [row["frozen_tokens_per_second_b1"] for row in rows]),
        (f"frozen weights, batch {CONCURRENT} (per stream)",
         [row["frozen_tokens_per_second_b8"] / CONCURRENT for row in rows]))
    ax.set_ylabel("tokens/s")
    ax.set_title("13. large language model: served decode per policy", fontsize=9)
    ax.legend(fontsize=7)
