"""Generation stepped by the server (docs/serving.md#generation): one decode loop per loaded language model, on a
thread of its own, that runs every generating row of every request in one batch, a token at a time.

A model takes part when its SavedModel has the decode protocol (pipeline/lm/generate.py writes it): `tokenize`
(prompts → prompt_tokens), `prefill` (prompts and per-row settings → each row's first token, its position, the
key/value cache as cache_* tensors) and `decode_step` (each row's last token, position and step, the cache →
the next token and the cache). Each loop turn:
  0. rows newly submitted that must fit the context (a completion's: prompt + max_new_tokens ≤ context_length) are
     counted, by the rule pipeline.json declares (bytes + 1) or else by `tokenize`, all in one call, and those
     that do not fit are handed PromptTooLong instead of any token: the check is the loop's, before any model
     work for the row, and costs no hop to another thread;
  1. rows that are done (end of text, their max_new_tokens, a stop sequence) or given up (the client left, its
     deadline passed) leave the batch, and their cache rows with them;
  2. rows waiting to start join, up to max_rows: their prompts go through prefill together (their first token;
     the loop then waits, at most FIRST_TOKEN_WAIT_S, until the requests that stream it have written it).
     While rows of more than one client (a peer address) are decoding or waiting, a client holds at most
     max_rows_per_client rows in the batch: its rows beyond that are paused (their cache rows kept aside, in host
     memory) and join again, where they left off, as its other rows finish or once it is alone. A step's time
     grows with its rows (bench figure 12's model: 8.2 ms for 8 tokens of one row, 11 of 4, 43 of 32), so this
     keeps one client's many long calls from slowing every other client's stream to the pace of a full batch;
  3. one decode_step for every row in the batch: up to TOKENS_PER_STEP tokens each, one while rows wait to join.
So a row never waits for the others to finish (iteration-level scheduling, as Orca's "continuous batching";
unlike vLLM there is no paged cache: each row holds a context-long cache), a client that leaves stops costing
CPU within one step, and calls arriving together share every step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from serving.limits import DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT
from serving.servable.runner import Runner

log = logging.getLogger(__name__)

# The decode protocol's signatures and its cache tensors' prefix: pipeline/lm/generate.py writes them this way.
TOKENIZE, PREFILL, DECODE_STEP = DECODE_PROTOCOL = ("tokenize", "prefill", "decode_step")
CACHE_PREFIX = "cache_"
DEFAULT_MAX_ROWS = 32  # rows decoded together when --enable_batching gives no max_batch_size
# Tokens per row per decode_step call while no row waits to join (one while one does): a call's fixed cost (the
# signature call, the inputs' checks, the cache's copy, handing tokens out: ~0.8 ms on the Intel VM, ~3 ms with the
# event loop's writes on the AVX2-only AMD one) is then paid once per 16 tokens, not per token; a client that leaves
# costs at most this many more tokens, and a row arriving waits for the step under way (docs/serving.md#generation).
TOKENS_PER_STEP = 16
# After a prefill, the decode loop waits at most this long for the streamed rows' requests to write their first
# tokens before its next step: started at once, the step's threads take the cores the event loop needs to write
# them (bench figure 12's model, 2 vCPUs: 1.2-2.0 ms of a 9-14 ms first token went to that hand-over, 0.2-0.4 ms
# with the wait; docs/serving.md#generation). A request that writes slower costs the batch no more than this.
FIRST_TOKEN_WAIT_S = 0.002


@dataclasses.dataclass(frozen=True)
class DecodeProtocol:
    """What the server reads of a model that can be stepped: its context (prompt + new tokens must fit), the
    names of its cache tensors, and, where pipeline.json declares it, how many tokens a prompt of n bytes takes
    (per_byte * n + added: the bytes tokenizer's; docs/export.md#language-models)."""

    context_length: int
    cache_names: tuple[str, ...]
    prompt_tokens_rule: tuple[int, int] | None = None  # (per_byte, added)
    cache_bytes_per_row: int = 0  # one row's keys and values over the whole context, every block

    @classmethod
    def of(cls, runner: Runner) -> "DecodeProtocol | None":
        """The runner's decode protocol, or None if it lacks one of the three signatures."""
        if not all(name in runner.signatures for name in (TOKENIZE, PREFILL, DECODE_STEP)):
            return None
        inputs = runner.signature_defs[DECODE_STEP].inputs
        names = tuple(sorted(name for name in inputs if name.startswith(CACHE_PREFIX)))
        if not names:
            return None
        dims = inputs[names[0]].tensor_shape.dim  # [batch, heads, context_length, head_dim]
        row_bytes = sum(int(np.prod([d.size for d in inputs[name].tensor_shape.dim[1:]], dtype=np.int64))
                        * np.dtype(tf.as_dtype(inputs[name].dtype).as_numpy_dtype).itemsize for name in names)
        return cls(context_length=int(dims[2].size), cache_names=names,
                   prompt_tokens_rule=_prompt_tokens_rule(runner.metadata), cache_bytes_per_row=int(row_bytes))

    def prompt_tokens(self, prompt: bytes) -> int | None:
        """The prompt's tokens, BOS included, by the declared rule; None where only `tokenize` can tell."""
        if self.prompt_tokens_rule is None:
            return None
        per_byte, added = self.prompt_tokens_rule
        return per_byte * len(prompt) + added


def _prompt_tokens_rule(metadata: dict | None) -> tuple[int, int] | None:
    """pipeline.json's language_model.tokenizer.prompt_tokens as (per_byte, added), or None (not declared: an
    older export, a sentencepiece tokenizer, a model from elsewhere)."""
    try:
        rule = metadata["language_model"]["tokenizer"]["prompt_tokens"]
        per_byte, added = int(rule["per_byte"]), int(rule["added"])
    except (KeyError, TypeError, ValueError):
        return None
    return (per_byte, added) if per_byte >= 0 and added >= 0 else None


def warm_decode_protocol(runner: Runner) -> bool:
    """Runs tokenize, prefill and decode_step once (an empty prompt, one token) before the version is AVAILABLE,
    so the first completion does not pay for the graphs' first run (0.3 s for prefill on a one-block model,
    measured); False when the runner has no decode protocol."""
    protocol = DecodeProtocol.of(runner)
    if protocol is None:
        return False
    runner.predict({"prompts": np.array([b""], dtype=object)}, TOKENIZE)
    settings = {"temperature": np.zeros(1, np.float32), "top_k": np.zeros(1, np.int32), "seed": np.zeros(1, np.int64),
                "row": np.zeros(1, np.int32)}
    out, caches = runner.run_with_state(PREFILL, {"prompts": np.array([b""], dtype=object),
                                                  "max_new_tokens": np.full(1, 2, np.int32), **settings}, {},
                                        protocol.cache_names)
    runner.run_with_state(DECODE_STEP, {"token": out["token"], "position": out["position"],
                                        "step": np.ones(1, np.int32), **settings, "steps": np.array(1, np.int32)},
                          caches, protocol.cache_names)
    return True


def prompt_token_counts(runner: Runner, protocol: DecodeProtocol, prompts: list[bytes]) -> list[int]:
    """Each prompt's tokens, BOS included: by the rule pipeline.json declares, else one tokenize call for those
    it does not cover."""
    counts = [protocol.prompt_tokens(prompt) for prompt in prompts]
    uncounted = [i for i, count in enumerate(counts) if count is None]
    if uncounted:
        out = runner.predict({"prompts": np.array([prompts[i] for i in uncounted], dtype=object)}, TOKENIZE)
        for i, count in zip(uncounted, out["prompt_tokens"]):
            counts[i] = int(count)
    return counts


def cache_refusal(decoder: "Decoder", rows: int) -> str | None:
    """Why a call of this many rows can never join the decode loop under --generation_max_cache_bytes (its rows'
    caches alone are more than the budget), or None: it may wait for room."""
    if decoder.max_cache_rows is None or rows <= decoder.max_cache_rows:
        return None
    need = rows * decoder.protocol.cache_bytes_per_row
    return (f"{rows} rows need {need:,} bytes of key/value cache ({decoder.protocol.cache_bytes_per_row:,} per row), "
            f"more than this server's --generation_max_cache_bytes {decoder.max_cache_bytes:,} "
            f"({decoder.max_cache_rows} rows); send fewer prompts at once")


class PromptTooLong(ValueError):
    """A row whose prompt + max_new_tokens does not fit the model's context; handed to the row instead of tokens."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        super().__init__(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new ones is more than the model's "
                         f"context of {context_length}")
        self.prompt_tokens, self.max_new_tokens, self.context_length = prompt_tokens, max_new_tokens, context_length


@dataclasses.dataclass
class Token:
    """One row's new token, as the decode loop hands it to the row's request."""

    id: int
    piece: bytes  # the token's text bytes (b"" for the end of text)
    log_prob: float
    finish: str | None  # "stop" (end of text), "length" (max_new_tokens), or None: more to come


class Row:
    """One prompt being generated. Its tokens go to the queue of the request it belongs to, as (index, Token) or
    (index, the error that ended the row), on that request's event loop; the request may give the row up with
    cancel() from any thread, and the decode loop drops it before its next step. A streamed row's request calls
    first_token_sent() once its first token is written (or it gives the row up): the decode loop waits for that
    (bounded) before the step after the row's prefill."""

    def __init__(self, prompt: bytes, max_new_tokens: int, temperature: float, top_k: int, seed: int, index: int,
                 queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, must_fit: bool = False,
                 client: str = "", streamed: bool = False) -> None:
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.temperature, self.top_k, self.seed, self.index = temperature, top_k, seed, index
        self._queue, self._loop = queue, loop  # the queue holds at most max_new_tokens entries of this row
        # True: refused (PromptTooLong) unless prompt + max_new_tokens fit the context; False: prefill keeps the
        # prompt's last tokens instead, as the generate signature does
        self.must_fit = must_fit
        self.prompt_tokens: int | None = None  # the prompt's tokens, BOS included, once counted or prefilled
        self.client = client  # who sent it (the peer's address): the batch is shared fairly between clients
        self.paused: dict[str, np.ndarray] | None = None  # a paused row's cache rows, until it joins again
        self.cancelled = False
        self._first_token_sent = threading.Event() if streamed else None
        self.generated = 0  # the decode loop's: tokens made so far
        self.last_token = 0  # -1 once the row has ended its text
        self.position = 0  # where the first generated token was written: the prompt's length

    def cancel(self) -> None:
        self.cancelled = True
        self.first_token_sent()  # nothing more will be written: the decode loop need not wait for it

    def first_token_sent(self) -> None:
        """Called by a streamed row's request once its first token is on its way to the client."""
        if self._first_token_sent is not None:
            self._first_token_sent.set()

    def wait_first_token_sent(self, seconds: float) -> None:
        """Called on the decode thread after the row's prefill: returns once the request wrote the first token
        (at once for a row that is not streamed), or after `seconds`."""
        if self._first_token_sent is not None:
            self._first_token_sent.wait(seconds)

    @property
    def unchecked(self) -> bool:
        """A row that must fit the context and has not been counted against it yet."""
        return self.must_fit and self.prompt_tokens is None

    @property
    def ready(self) -> bool:
        """A waiting row that may join: checked against the context where it must fit, and not given up."""
        return not self.cancelled and not self.unchecked

    def deliver(self, item: "Token | BaseException") -> None:
        """Called on the decode thread: hands a token (or the error that ends the row) to the request's loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (self.index, item))
        except RuntimeError:  # the event loop is closed: the server is stopping
            self.cancelled = True


class Decoder:
    """The decode loop of one runner (see the module docstring). submit() adds rows; the thread runs while there
    are rows and sleeps otherwise; stop() ends it.

    Args:
        runner: the loaded model; protocol: its DecodeProtocol.
        max_rows: the most rows in one step (the batching flags' max_batch_size).
        max_rows_per_client: the most rows of one client in a step while other clients' rows decode or wait.
        on_step: called after every prefill and step with (kind, rows, seconds), for the metrics.
        max_cache_bytes: the key/value cache all rows may hold, in the batch and paused (0: max_rows alone bounds
            it; --generation_max_cache_bytes): a row joins only while the cache has room for it, and waits till then.
    """

    def __init__(self, runner: Runner, protocol: DecodeProtocol, max_rows: int = DEFAULT_MAX_ROWS,
                 on_step: Callable[[str, int, float], None] | None = None,
                 max_rows_per_client: int = DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT, max_cache_bytes: int = 0) -> None:
        self.runner, self.protocol, self.max_rows = runner, protocol, max_rows
        self.max_rows_per_client = max_rows_per_client
        self.max_cache_bytes = max_cache_bytes
        # rows whose caches fit the budget together (None: no budget)
        self.max_cache_rows = (max_cache_bytes // max(protocol.cache_bytes_per_row, 1)) if max_cache_bytes else None
        self._on_step = on_step
        self._waiting: list[Row] = []
        self._active: list[Row] = []
        self._caches: dict[str, Any] = {}  # the batch's key/value cache, as the runner holds it (run_with_state)
        self._wake = threading.Condition()
        self._stopped = False
        self.steps = 0  # decode_step calls so far (tests and the bench read it)
        self.most_rows = 0  # the most rows one decode_step has held
        self.paused_rows = 0  # rows paused so far, for a client's fair share (tests read it)
        self._thread = threading.Thread(target=self._run, name=f"decode-{runner.model_name}-{runner.version}",
                                        daemon=True)
        self._thread.start()

    def submit(self, rows: list[Row]) -> None:
        with self._wake:
            self._waiting.extend(rows)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def rows(self) -> int:
        """Rows being decoded or waiting to start."""
        return len(self._active) + len(self._waiting)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopped:
                    self._fail(self._active + self._waiting, RuntimeError("the model is being unloaded"))
                    return
                unchecked = [row for row in self._waiting if row.unchecked]
            joining: list[Row] = []
            try:
                if unchecked:
                    self._check_fit(unchecked)
                self._leave()
                with self._wake:
                    self._waiting = [row for row in self._waiting if not row.cancelled]
                    pausing, joining = self._plan()
                    if pausing:
                        self._pause(pausing)
                    self._waiting = pausing + [row for row in self._waiting if row not in joining]
                starting = [row for row in joining if row.paused is None]
                if len(starting) < len(joining):
                    self._resume([row for row in joining if row.paused is not None])
                if starting:
                    self._prefill(starting)
                    self._wait_first_tokens_sent(starting)
                    self._leave()
                if self._active:
                    self._step()
            except Exception as error:  # noqa: BLE001 - a failed run fails its rows, never the loop
                log.error("model %s version %d: generation failed: %s", self.runner.model_name, self.runner.version,
                          error)
                self._fail(self._active + joining + [row for row in unchecked if row.unchecked], error)
                self._active, self._caches = [], {}

    def _check_fit(self, rows: list[Row]) -> None:
        """Counts the rows' prompt tokens (by the declared rule, else one tokenize call for all: 0.6-0.9 ms of a
        first token's time on bench figure 12's model); a row that does not fit the context is handed
        PromptTooLong and given up, so it never reaches prefill."""
        counts = prompt_token_counts(self.runner, self.protocol, [row.prompt for row in rows])
        context = self.protocol.context_length
        for row, count in zip(rows, counts):
            row.prompt_tokens = count
            if row.prompt_tokens + row.max_new_tokens > context:
                row.cancel()
                row.deliver(PromptTooLong(row.prompt_tokens, row.max_new_tokens, context))

    def _leave(self) -> None:
        """Drops the rows that are done or given up, and their cache rows."""
        self._keep([i for i, row in enumerate(self._active) if not row.cancelled and not self._done(row)])

    def _keep(self, keep: list[int]) -> None:
        """Keeps the active rows at these indices, and their cache rows."""
        if len(keep) == len(self._active):
            return
        self._active = [self._active[i] for i in keep]
        self._caches = {name: np.asarray(cache)[keep] for name, cache in self._caches.items()} if keep else {}

    def _cap(self) -> int:
        """The most rows one client may hold in the batch now: all of it while one client alone generates."""
        clients = {row.client for row in self._active} | {row.client for row in self._waiting if row.ready}
        return self.max_rows if len(clients) <= 1 else min(self.max_rows, self.max_rows_per_client)

    def _plan(self) -> tuple[list[Row], list[Row]]:
        """(active rows to pause, waiting rows to join): each client within the cap, the batch within max_rows;
        a client's rows keep their order (the longest decoding stay, paused rows join before its new ones)."""
        cap, held = self._cap(), collections.Counter()
        pausing = []
        for row in self._active:
            held[row.client] += 1
            if held[row.client] > cap:
                pausing.append(row)
                held[row.client] -= 1
        room = self.max_rows - (len(self._active) - len(pausing))
        cache_room = self._cache_room()
        joining = []
        for row in self._waiting:
            if len(joining) < room and row.ready and held[row.client] < cap and (row.paused is not None
                                                                                 or cache_room > 0):
                joining.append(row)
                held[row.client] += 1
                cache_room -= row.paused is None  # a paused row's cache rows are counted already
        return pausing, joining

    def _cache_room(self) -> int | float:
        """New rows the cache budget has room for: the rows in the batch and the paused ones hold their cache."""
        if self.max_cache_rows is None:
            return float("inf")
        return self.max_cache_rows - len(self._active) - sum(row.paused is not None for row in self._waiting)

    def _pause(self, rows: list[Row]) -> None:
        """Takes the rows out of the batch, each with a copy of its cache rows, to join again later."""
        for i, row in enumerate(self._active):
            if row in rows:
                row.paused = {name: np.array(np.asarray(cache)[i:i + 1]) for name, cache in self._caches.items()}
        self._keep([i for i, row in enumerate(self._active) if row not in rows])
        self.paused_rows += len(rows)

    def _resume(self, rows: list[Row]) -> None:
        """Paused rows back into the batch, where they left off (no prefill: their cache rows come back)."""
        self._join(rows, {name: np.concatenate([row.paused[name] for row in rows]) for name in rows[0].paused})
        for row in rows:
            row.paused = None

    def _join(self, rows: list[Row], caches: dict[str, Any]) -> None:
        self._caches = (caches if not self._active else  # rows join rarely: numpy's copy is fine then
                        {name: np.concatenate([np.asarray(self._caches[name]), np.asarray(caches[name])])
                         for name in caches})
        self._active.extend(rows)

    @staticmethod
    def _done(row: Row) -> bool:
        return row.generated >= row.max_new_tokens or row.last_token < 0

    def _settings(self, rows: list[Row]) -> dict[str, np.ndarray]:
        return {"temperature": np.array([row.temperature for row in rows], np.float32),
                "top_k": np.array([row.top_k for row in rows], np.int32),
                "seed": np.array([row.seed for row in rows], np.int64),
                "row": np.array([row.index for row in rows], np.int32)}

    def _prefill(self, rows: list[Row]) -> None:
        start = time.perf_counter()
        out, caches = self.runner.run_with_state(
            PREFILL, {"prompts": np.array([row.prompt for row in rows], dtype=object),
                      "max_new_tokens": np.array([row.max_new_tokens for row in rows], np.int32),
                      **self._settings(rows)}, {}, self.protocol.cache_names)
        for i, row in enumerate(rows):
            row.position = row.prompt_tokens = int(out["position"][i])
        self._join(rows, caches)
        self._hand_out(rows, out)
        if self._on_step:
            self._on_step(PREFILL, len(rows), time.perf_counter() - start)

    @staticmethod
    def _wait_first_tokens_sent(rows: list[Row]) -> None:
        """Lets the streamed rows' requests write their first tokens before the next step takes the cores
        (FIRST_TOKEN_WAIT_S in all, however many rows)."""
        deadline = time.monotonic() + FIRST_TOKEN_WAIT_S
        for row in rows:
            row.wait_first_token_sent(max(0.0, deadline - time.monotonic()))

    def _step(self) -> None:
        rows = self._active
        start = time.perf_counter()
        # one token while a row waits for room in the batch (not for its client's share): it joins a step sooner
        cap, held = self._cap(), collections.Counter(row.client for row in rows)
        waits = self._cache_room() > 0 and any(row.ready and held[row.client] < cap for row in self._waiting)
        tokens = 1 if waits else min(TOKENS_PER_STEP, *(row.max_new_tokens - row.generated for row in rows))
        out, self._caches = self.runner.run_with_state(
            DECODE_STEP, {"token": np.array([row.last_token for row in rows], np.int32),
                          "position": np.array([row.position + row.generated - 1 for row in rows], np.int32),
                          "step": np.array([row.generated for row in rows], np.int32), **self._settings(rows),
                          "steps": np.array(tokens, np.int32)},
            self._caches, self.protocol.cache_names)
        self.steps += 1
        self.most_rows = max(self.most_rows, len(rows))
        self._hand_out(rows, {name: out[name] for name in ("token", "log_prob", "piece", "finished")})
        if self._on_step:
            self._on_step(DECODE_STEP, len(rows), time.perf_counter() - start)

    def _hand_out(self, rows: list[Row], out: dict[str, np.ndarray]) -> None:
        """Each row's new tokens ([rows] from prefill, [rows, steps] from decode_step) to its request, up to the
        one that ends it; a row that ended its text is marked done (last_token < 0)."""
        for i, row in enumerate(rows):
            for j in range(out["token"].shape[1] if out["token"].ndim == 2 else 1):
                at = (i, j) if out["token"].ndim == 2 else i
                row.generated += 1
                finish = "stop" if out["finished"][at] else "length" if row.generated >= row.max_new_tokens else None
                row.last_token = -1 if finish == "stop" else int(out["token"][at])
                if not row.cancelled:
                    row.deliver(Token(int(out["token"][at]), bytes(out["piece"][at]), float(out["log_prob"][at]),
                                      finish))
                if finish:
                    break

    @staticmethod
    def _fail(rows: list[Row], error: BaseException) -> None:
        for row in rows:
            row.cancel()  # a waiting row leaves at the next turn
            row.deliver(error)
