"""Figure 12: generation served, streamed: python -m serving's OpenAI completions (Server-Sent Events, the decode
loop of serving/generation/) against the same model in this process.

Per policy (float32; mixed_bfloat16: a bfloat16 key/value cache), figure 11's model is saved by the pipeline
(pipeline/lm/generate.py) and served by a `python -m serving` child process (REST). Greedy, a 64-byte prompt:
- time to first token: from sending the request (for all the figure's new tokens) to the first `data:` event,
  STREAMS_PER_ROUND streams a round over one kept connection (as the openai client's connection pool keeps it),
  each beside the SavedModel's own prefill signature timed in this process (the work the first token needs).
  Both sides are timed alike: one call, after IDLE_S with both processes idle (a single call after a pause
  takes 9-17% longer than back-to-back ones here, which a request to an idle server pays too); the mean of 5
  back-to-back prefill calls is reported beside it (prefill_warm_ms, ttft_warm_ratio);
- tokens/s at batch 1 over the same streams, against the SavedModel's whole-loop `generate` in this process, one
  call beside each stream;
- 8 concurrent streams of 128 tokens (8 client threads), against the same 8 one after another;
- the server's CPU seconds per generated token (from /proc, over the concurrent run);
- float32 only, issue 30's hostile mix (hostile_run) while one well-behaved client streams: its tokens/s against
  its rate alone just before the mix, its first token, the hostile answers' status codes, the server's RSS growth.
Each measurement is the median of its rounds; the two sides of each ratio run seconds apart.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

from bench import timing
from bench.generation import language_model
from bench.workloads import Sizes

TITLE = "Generation served: OpenAI completions streamed by python -m serving vs in-process"
TARGET = ("time to first token <= 1.5x the in-process prefill; streamed tokens/s >= 80% of in-process at batch 1; "
          "8 concurrent streams in <= 0.5x the time of one after another; under the hostile mix the well-behaved "
          "stream keeps >= 50% of its rate")
COLUMNS = ["policy", "prefill_ms", "ttft_ms", "ttft_ratio", "prefill_warm_ms", "ttft_warm_ratio",
           "in_process_tokens_per_second",
           "stream_tokens_per_second", "stream_ratio", "concurrent_seconds", "sequential_seconds", "concurrent_ratio",
           "server_cpu_ms_per_token", "hostile_tokens_per_second", "hostile_alone_tokens_per_second", "hostile_ratio",
           "hostile_ttft_ms", "hostile_rss_growth_mb", "target_met"]
POLICIES = ("float32", "mixed_bfloat16")
HOSTILE_COLUMNS = ("hostile_tokens_per_second", "hostile_alone_tokens_per_second", "hostile_ttft_ms",
                   "hostile_statuses", "hostile_rss_growth_mb")
TEXT = "The quick brown fox jumps over the lazy dog. " * 2
PROMPT_BYTES = 64  # at most a quarter of the context (the smoke run's model has 64)
STREAMS_PER_ROUND = 5  # a first token is a few ms: more samples than rounds
IDLE_S = 0.1  # both processes idle before each timed first token and each timed single prefill
HOSTILE_ADDRESS = "127.0.0.2"  # the hostile mix's source: Linux's loopback answers all of 127.0.0.0/8


def stream(address: str, prompt: str, max_tokens: int,
           connection: http.client.HTTPConnection | None = None) -> tuple[float, int, float]:
    """One streamed greedy completion: (seconds to the first event, tokens, seconds in all). Over `connection`
    when given (read to its end, so it can carry the next one), else over a new connection, closed after."""
    start = time.perf_counter()
    kept = connection is not None
    connection = connection or http.client.HTTPConnection(address, timeout=600)
    connection.request("POST", "/openai/v1/completions", json.dumps({
        "model": "lm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}))
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"completions answered {response.status}: {response.read()[:300]!r}")
    first, tokens = None, 0
    while line := response.readline():
        if line.startswith(b"data: {"):
            first = first or time.perf_counter() - start
            tokens += 1
        elif line.startswith(b"data: [DONE]"):
            break
    elapsed = time.perf_counter() - start
    if kept:
        response.read()  # the end of the chunked body
    else:
        connection.close()
    return first, tokens, elapsed


def tokens_per_second(streamed: tuple[float, int, float]) -> float:
    """A whole stream's rate after its first token (stream()'s answer)."""
    first, tokens, total = streamed
    return (tokens - 1) / (total - first)


def hostile_run(address: str, pid: int, prompt: str, new_tokens: int, context: int) -> dict:
    """Issue 30's hostile mix, sent from another address (127.0.0.2: another client, as the server tells them)
    while one well-behaved client streams `new_tokens` from 127.0.0.1: 100 calls for the most tokens the context
    leaves, 20 streams never read, 20 prompts at the server's byte cap (refused), 20 clients that leave at once.
    Returns the well-behaved stream's rate under the mix and alone just before it, its first token under the mix,
    the answers' status codes and the server's RSS growth."""
    import socket
    from collections import Counter

    host, port = address.split(":")
    statuses, held = Counter(), []

    def send(body: dict, mode: str) -> None:
        payload = json.dumps(body).encode()
        sock = socket.create_connection((host, int(port)), source_address=(HOSTILE_ADDRESS, 0))
        # Connection: close, so a reader's recv() ends with the answer, not with the server's idle timeout (60 s)
        sock.sendall(b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        if mode == "hold":
            held.append(sock)
            return
        if mode == "read":
            head = sock.recv(64)
            statuses[int(head.split()[1]) if head else 0] += 1
            while sock.recv(65536):
                pass
        sock.close()

    most = context - len(prompt.encode()) - 1
    work = ([({"model": "lm", "prompt": prompt, "max_tokens": most, "temperature": 1.0}, "read")] * 100
            + [({"model": "lm", "prompt": prompt, "max_tokens": most, "stream": True}, "hold")] * 20
            + [({"model": "lm", "prompt": "x" * 65537, "max_tokens": 1}, "read")] * 20
            + [({"model": "lm", "prompt": prompt, "max_tokens": most}, "leave")] * 20)
    # the rate alone, seconds before the mix: this VM's pace drifts by tens of percent over minutes
    alone = timing.median([tokens_per_second(stream(address, prompt, new_tokens)) for _ in range(3)])
    rss_before = _rss(pid)
    threads = [threading.Thread(target=send, args=item) for item in work]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the hostile rows are decoding
    streamed = stream(address, prompt, new_tokens)
    for thread in threads:
        thread.join()
    for sock in held:
        sock.close()
    return {"hostile_tokens_per_second": tokens_per_second(streamed), "hostile_alone_tokens_per_second": alone,
            "hostile_ttft_ms": 1e3 * streamed[0],
            "hostile_statuses": dict(statuses), "hostile_rss_growth_mb": (_rss(pid) - rss_before) / 1e6}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def server_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(sizes: Sizes, work_dir: Path) -> dict:
    import numpy as np
    import tensorflow as tf

    from pipeline.lm import causal_lm, generate
    from pipeline.export import lm as lm_export
    from serving.client import process

    context = sizes.generation_model[-1]
    prompt = TEXT[:min(PROMPT_BYTES, context // 4)]
    new_tokens = min(sizes.generation_new_tokens, context - len(prompt) - 1)
    concurrent_tokens, rounds = min(sizes.streaming_tokens, new_tokens), sizes.generation_rounds
    rows = []
    for policy in POLICIES:
        base = work_dir / f"streaming_{policy}" / "lm"
        model = language_model(sizes, policy)
        generate.save(generate.Generator(model), base / "1")
        # what the server reads of an export's pipeline.json: the tokenizer (its PAD id, how many tokens a prompt
        # takes), the context and the cache (docs/export.md#language-models)
        (base / "1" / "assets.extra").mkdir()
        (base / "1" / "assets.extra" / "pipeline.json").write_text(
            json.dumps({"language_model": lm_export.language_model_facts(model)}))
        loaded = tf.saved_model.load(str(base / "1"))
        prefill_args = dict(prompts=tf.constant([prompt]), max_new_tokens=tf.constant([new_tokens]),
                            temperature=tf.zeros([1]), top_k=tf.zeros([1], tf.int32), seed=tf.zeros([1], tf.int64),
                            row=tf.zeros([1], tf.int32))
        whole_args = dict(prompts=tf.constant([prompt]), max_new_tokens=tf.constant(new_tokens),
                          temperature=tf.constant(0.0), top_k=tf.constant(0), seed=tf.constant(0, tf.int64))
        prefill, whole = loaded.signatures["prefill"], loaded.signatures["generate"]
        for _ in range(2):
            prefill(**prefill_args), whole(**whole_args)
        made = int(np.sum(whole(**whole_args)["ids"].numpy() != causal_lm.PAD))
        with process.running_server(["--model_name=lm", f"--model_base_path={base}", "--port=0",
                                     "--rest_api_port=-1"], work_dir / f"streaming_{policy}.log", rest=True) as server:
            address = server.rest_address
            stream(address, prompt, new_tokens)  # the decode loop starts, the signatures warm up
            prefill_s, prefill_warm_s, ttft_s, in_process_rate, stream_rate = [], [], [], [], []
            connection = http.client.HTTPConnection(address, timeout=600)
            for _ in range(rounds * STREAMS_PER_ROUND):
                time.sleep(IDLE_S)
                prefill_s.append(timing.seconds_per_call(lambda: prefill(**prefill_args), 1))
                prefill_warm_s.append(timing.seconds_per_call(lambda: prefill(**prefill_args), 5))
                time.sleep(IDLE_S)
                streamed = stream(address, prompt, new_tokens, connection)
                ttft_s.append(streamed[0])
                stream_rate.append(tokens_per_second(streamed))
                in_process_rate.append(made / timing.seconds_per_call(lambda: whole(**whole_args), 1))
            connection.close()
            sequential = sum(stream(address, prompt, concurrent_tokens)[2] for _ in range(8))
            cpu_before, start = server_cpu_seconds(server.process.pid), time.perf_counter()
            threads = [threading.Thread(target=stream, args=(address, prompt, concurrent_tokens)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            concurrent = time.perf_counter() - start
            cpu_per_token = (server_cpu_seconds(server.process.pid) - cpu_before) / (8 * concurrent_tokens)
            hostile = (hostile_run(address, server.process.pid, prompt, new_tokens, context) if policy == "float32"
                       else dict.fromkeys(HOSTILE_COLUMNS))  # measured once, under float32
        row = {"policy": policy, "prefill_ms": 1e3 * timing.median(prefill_s), "ttft_ms": 1e3 * timing.median(ttft_s),
               "prefill_warm_ms": 1e3 * timing.median(prefill_warm_s),
               "in_process_tokens_per_second": timing.median(in_process_rate),
               "stream_tokens_per_second": timing.median(stream_rate),
               "concurrent_seconds": concurrent, "sequential_seconds": sequential,
               "server_cpu_ms_per_token": 1e3 * cpu_per_token, **hostile}
        row["hostile_ratio"] = (None if hostile["hostile_tokens_per_second"] is None
                                else row["hostile_tokens_per_second"] / row["hostile_alone_tokens_per_second"])
        row["ttft_ratio"] = row["ttft_ms"] / row["prefill_ms"]
        row["ttft_warm_ratio"] = row["ttft_ms"] / row["prefill_warm_ms"]
        row["stream_ratio"] = row["stream_tokens_per_second"] / row["in_process_tokens_per_second"]
        row["concurrent_ratio"] = concurrent / sequential
        row["target_met"] = (row["ttft_ratio"] <= 1.5 and row["stream_ratio"] >= 0.8 and row["concurrent_ratio"] <= 0.5
                             and (row["hostile_ratio"] is None or row["hostile_ratio"] >= 0.5))
        rows.append(row)
        timing.progress(f"streaming: {policy}: first token {row['ttft_ms']:.1f} ms (prefill {row['prefill_ms']:.1f} "
                        f"ms), {row['stream_tokens_per_second']:.0f} vs {row['in_process_tokens_per_second']:.0f} "
                        f"tokens/s, 8 streams {concurrent:.2f} s vs {sequential:.2f} s one after another")
    return {"rows": rows, "setup": {"model": dict(zip(("num_layers", "num_heads", "width", "mlp_width",
                                                       "context_length"), sizes.generation_model)),
                                    "prompt_bytes": len(prompt.encode()), "new_tokens": new_tokens,
                                    "concurrent_tokens": concurrent_tokens, "rounds": rounds}}


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    keys = ("ttft_ratio", "stream_ratio", "concurrent_ratio")
    labels = ("first token / prefill", "stream / in-process tokens/s", "8 concurrent / sequential time")
    for i, row in enumerate(rows):
        ax.bar([k + 0.4 * i - 0.2 for k in range(len(keys))], [row[key] for key in keys], width=0.4,
               label=row["policy"])
    ax.set_xticks(range(len(keys)), labels, fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_ylabel("ratio")
    ax.set_title("12. generation served: streaming vs in-process", fontsize=9)
    ax.legend(fontsize=7)
