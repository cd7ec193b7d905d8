"""OpenAI's completions API for the served language models, under /openai/v1/ (KServe's prefix: OpenAI's own
GET /v1/models/{id} would collide with TF Serving's GET /v1/models/NAME), so that an `openai` client pointed at
base_url=http://HOST:PORT/openai/v1 works (docs/serving.md#generation):

    GET  /openai/v1/models            the served models that can generate (the decode protocol), latest versions
    GET  /openai/v1/models/{model}
    POST /openai/v1/tokenize          model, prompt, add_special_tokens (true): vLLM's {count, max_model_len, tokens}
    POST /openai/v1/detokenize        model, tokens: vLLM's {prompt}
    POST /openai/v1/completions       model, prompt (a string or a list), max_tokens (16), temperature (1),
                                      top_k (0: all; our addition, as vLLM's), top_p (1 only), seed, stop, stream,
                                      stream_options.include_usage, n (1 only), user, echo, logprobs (0-5)

`echo` puts the prompt before the completion; `logprobs: N` answers each token's log-probability and its N most
likely alternatives, the prompt's tokens too with echo; `max_tokens: 0` with both is a log-likelihood query (what
evaluation tools send). They are teacher-forced through the version's `score` signature after the completion is
made (serving/generation/scoring.py), and not streamed.

With "stream": true the answer is Server-Sent Events: `data: {chunk}` for each token of each prompt (a token that
ends inside a UTF-8 character, or may begin a stop sequence, is held back until it is whole), the finish_reason
("stop": end of text or a stop sequence, "length": max_tokens) on each prompt's last chunk with the usage counts,
then `data: [DONE]`. Bounds, checked before any model work: prompt bytes (--generation_max_prompt_bytes),
max_tokens (--generation_max_new_tokens, and prompt + max_tokens within the model's context, OpenAI's wording),
prompts per request (the decode batch). A client that disconnects, or whose --rest_api_timeout_in_ms passes, is
given up within one decode step. Errors are OpenAI's {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import logging
import secrets
import time
from typing import Any

import grpc
import orjson
from aiohttp import web
import numpy as np
from tensorflow_serving.apis import model_pb2, predict_pb2

from serving.errors import ServingError, short
from serving.generation.decoder import (TOKENIZE, Decoder, PromptTooLong, Row, Token, cache_refusal,
                                       prompt_token_counts)
from serving.generation import scoring
from serving.generation.scoring import DETOKENIZE
from serving.generation.predict import pad_id
from serving.generation.service import Generations
from serving.manager.model_manager import ModelManager
from serving.monitoring import Metrics
from serving.request_log import RequestLog
from serving.rest import json_codec
from serving.servable import tensors
from serving.servable.runner import Runner

log = logging.getLogger(__name__)

PREFIX = "/openai/v1"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOPS = 4  # OpenAI's limit on stop sequences
FAIL_WRITE_S = 1.0  # a stream's closing error event gets this long to be written; then the connection is closed
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "user", "logprobs", "echo", "best_of", "presence_penalty", "frequency_penalty",
           "logit_bias", "suffix"}
# fields a client may send at OpenAI's default only: the value that changes nothing
_DEFAULT_ONLY = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None,
                 "top_p": 1}
_TOKEN_ROUTES = ("/tokenize", "/detokenize")
_STATUS_TYPE = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded", 500: "server_error",
                503: "server_error", 504: "timeout"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclasses.dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int
    max_new_tokens: int
    timeout_s: float | None  # --rest_api_timeout_in_ms


@dataclasses.dataclass
class Completion:
    """A checked POST /completions body."""

    model: str
    prompts: list[bytes]
    max_tokens: int
    temperature: float
    top_k: int
    seed: int
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _STATUS_TYPE.get(status, "server_error"), "param": param,
                      "code": None}}


def parse_completion(body: Any, limits: Limits) -> Completion:
    """The request's fields, each checked (OpenAIError 400 naming the field and what it takes)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise OpenAIError(400, f"Unrecognized request argument supplied: {short(unknown[0])}", unknown[0])
    for field, default in _DEFAULT_ONLY.items():
        if field in body and body[field] is not None and body[field] != default:
            what = "it samples by top_k instead" if field == "top_p" else "only the default is supported"
            raise OpenAIError(400, f"{field} {short(repr(body[field]))} is not supported here ({field}: "
                                   f"{json_codec.dumps(default).decode()}; {what})", field)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required: the name of a served model (GET /openai/v1/models)", "model")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise OpenAIError(400, "prompt must be a string or a non-empty list of strings (token arrays are not "
                               "supported)", "prompt")
    encoded = [p.encode("utf-8", errors="surrogatepass") for p in prompts]
    longest = max(len(p) for p in encoded)
    if longest > limits.max_prompt_bytes:
        raise OpenAIError(400, f"prompt is {longest} bytes, more than the {limits.max_prompt_bytes} this server "
                               "takes (--generation_max_prompt_bytes)", "prompt")
    max_tokens = _integer(body, "max_tokens", DEFAULT_MAX_TOKENS, 0)
    if max_tokens > limits.max_new_tokens:
        raise OpenAIError(400, f"max_tokens is {max_tokens}, more than the {limits.max_new_tokens} this server "
                               "generates per prompt (--generation_max_new_tokens)", "max_tokens")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise OpenAIError(400, f"temperature must be a number from 0 to 2, got {short(repr(temperature))}",
                          "temperature")
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if (not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise OpenAIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise OpenAIError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise OpenAIError(400, "stream_options takes only include_usage", "stream_options")
    seed = body.get("seed")
    seed = secrets.randbits(63) if seed is None else _integer(body, "seed", 0, -(1 << 63), (1 << 63) - 1)
    echo = body.get("echo", False)
    echo = False if echo is None else echo
    if not isinstance(echo, bool):
        raise OpenAIError(400, "echo must be true or false", "echo")
    logprobs = None if body.get("logprobs") is None else _integer(body, "logprobs", 0, 0, scoring.MAX_LOGPROBS)
    if stream and (echo or logprobs is not None):
        raise OpenAIError(400, "echo and logprobs are not streamed here: send them with stream false",
                          "echo" if echo else "logprobs")
    return Completion(model=model, prompts=encoded, max_tokens=max_tokens, temperature=float(temperature),
                      top_k=_integer(body, "top_k", 0, 0), seed=seed, stops=tuple(stops),
                      stream=bool(stream), include_usage=bool(options.get("include_usage")), echo=echo,
                      logprobs=logprobs)


def _integer(body: dict, field: str, default: int, least: int, most: int = (1 << 31) - 1) -> int:
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise OpenAIError(400, f"{field} must be an integer from {least} to {most}, got {short(repr(value))}", field)
    return value


class ChoiceText:
    """One prompt's completion as text, built token by token: whole UTF-8 characters only, stop sequences cut off
    (the completion ends before the first one), and text that may be the start of a stop sequence held back."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0  # characters of text handed out
        self.tokens = 0
        self.finish: str | None = None
        self.ids: list[int] = []  # every token made, the one that ended the text included (the request log's)
        self.log_probs: list[float] = []
        self.pieces: list[bytes] = []

    def add(self, token: Token) -> str:
        """The text this token makes ready to send; sets finish when the choice is done."""
        if token.finish != "stop" or token.piece:
            self.tokens += 1
        self.ids.append(token.id)
        self.log_probs.append(token.log_prob)
        self.pieces.append(token.piece)
        self.text += self._utf8.decode(token.piece, final=token.finish is not None)
        cut = min((i for i in (self.text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
        else:
            self.finish = token.finish
        ready = len(self.text) if self.finish else len(self.text) - self._held_back()
        new, self.sent = self.text[self.sent:ready], max(self.sent, ready)
        return new

    def text_ids(self) -> list[int]:
        """The tokens the text holds: up to the one that completes it (a stop sequence cuts the text; EOS, no
        bytes, is none of it)."""
        size, covered = len(self.text.encode("utf-8", errors="surrogatepass")), 0
        for k, piece in enumerate(self.pieces):
            if covered >= size or not piece:
                return self.ids[:k]
            covered += len(piece)
        return list(self.ids)

    def _held_back(self) -> int:
        """Characters at the end of text that begin some stop sequence."""
        return max((k for stop in self.stops for k in range(1, len(stop)) if self.text.endswith(stop[:k])),
                   default=0)


class OpenAIApi:
    """The /openai/v1 routes (see the module docstring), answered on the server's event loop."""

    def __init__(self, manager: ModelManager, generations: Generations, limits: Limits,
                 metrics: Metrics | None = None, request_log: RequestLog | None = None) -> None:
        self._manager, self._generations, self._limits, self._metrics = manager, generations, limits, metrics
        self._request_log = request_log
        self._scoring = asyncio.Semaphore(1)  # one score call at a time: its memory is one row's logits

    async def handle(self, request: web.Request, body: bytearray) -> web.StreamResponse:
        start = time.monotonic()
        model, version = "", ""
        path = request.path[len(PREFIX):].rstrip("/")
        try:
            if request.method == "GET" and path == "/models":
                return _json(200, {"object": "list", "data": [self._card(name) for name in self._generative()]})
            if request.method == "GET" and path.startswith("/models/"):
                name = path[len("/models/"):]
                if name not in self._generative():
                    raise OpenAIError(404, f"The model `{short(name)}` does not exist or cannot generate", "model")
                return _json(200, self._card(name))
            if path not in ("/completions", *_TOKEN_ROUTES):
                raise OpenAIError(404, f"Not found: {short(request.method)} {short(request.path)}; this server "
                                       f"answers GET {PREFIX}/models and POST {PREFIX}/completions, "
                                       f"{PREFIX}/tokenize, {PREFIX}/detokenize")
            if request.method != "POST":
                raise OpenAIError(405, f"{PREFIX}{path} takes POST")
            try:
                parsed = json_codec.parse_body(body)
            except ServingError as error:  # malformed JSON, or over the JSON limits
                raise OpenAIError(400, str(error)) from None
            finally:
                body.clear()
            if path in _TOKEN_ROUTES:
                return await self._tokens(path, parsed)
            completion = parse_completion(parsed, self._limits)
            model = completion.model
            with self._manager.request_scope():  # the version stays loaded until the last token
                decoder = self._decoder(completion.model)
                version = str(decoder.runner.version)
                if completion.logprobs is not None:
                    _check_can_score(decoder)
                return await self._complete(request, completion, decoder, start)
        except OpenAIError as error:
            if path not in _TOKEN_ROUTES:  # the metrics count completions
                self._observe(model, version, _status_name(error.status), start)
            return _json(error.status, error_body(error.status, error.message, error.param))

    async def _tokens(self, path: str, body: Any) -> web.Response:
        """POST /tokenize {model, prompt, add_special_tokens (true: BOS first)} → {count, max_model_len, tokens};
        POST /detokenize {model, tokens} → {prompt}: vLLM's routes, through the version's own tokenizer (its
        `tokenize` and `detokenize` signatures), bounded as completions are."""
        fields = {"model", "prompt", "add_special_tokens"} if path == "/tokenize" else {"model", "tokens"}
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise OpenAIError(400, f"Unrecognized request argument supplied: {short(unknown[0])}", unknown[0])
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise OpenAIError(400, "model is required: the name of a served model (GET /openai/v1/models)", "model")
        with self._manager.request_scope():
            runner = self._decoder(body["model"]).runner
            context = self._generations.protocol(runner).context_length
            if path == "/tokenize":
                prompt = _token_prompt(body, self._limits)
                ids = await asyncio.to_thread(_tokenize, runner, prompt)
                tokens = ids if body.get("add_special_tokens", True) is not False else ids[1:]
                return _json(200, {"count": len(tokens), "max_model_len": context, "tokens": tokens})
            ids = _token_ids(body, context, _vocab_size(runner))
            if DETOKENIZE not in runner.signatures:
                raise _not_exported(runner, DETOKENIZE, "detokenize")
            out = await asyncio.to_thread(runner.predict, {"ids": np.array([ids], np.int32).reshape(1, len(ids))},
                                          DETOKENIZE)
            return _json(200, {"prompt": out["texts"][0].decode("utf-8", errors="replace")})

    def _generative(self) -> list[str]:
        names = []
        for name in self._manager.model_names:
            versions = self._manager.versions(name)
            if versions and self._generations.protocol(versions[max(versions)]) is not None:
                names.append(name)
        return names

    def _card(self, name: str) -> dict:
        versions = self._manager.versions(name)
        runner = versions[max(versions)]
        return {"id": name, "object": "model", "created": int(runner.path.stat().st_mtime), "owned_by": "tensorflow-serving",
                "version": runner.version,
                "context_length": self._generations.protocol(runner).context_length}

    def _decoder(self, name: str) -> Decoder:
        try:
            _, runner = self._manager.resolve(model_pb2.ModelSpec(name=name))
        except ServingError:
            raise OpenAIError(404, f"The model `{short(name)}` does not exist or has no version available "
                                   "(GET /openai/v1/models lists those that can generate)", "model") from None
        if self._generations.protocol(runner) is None:
            raise OpenAIError(400, f"model {short(name)} version {runner.version} cannot generate: it has no decode "
                                   "protocol (the tokenize, prefill and decode_step signatures)", "model")
        return self._generations.decoder(runner)

    async def _complete(self, request: web.Request, completion: Completion, decoder: Decoder,
                        start: float) -> web.StreamResponse:
        """Submits the prompts, streams or gathers their tokens until each choice finishes, and answers; every
        way out (the deadline, a client gone, a prompt too long) cancels the rows and is counted once."""
        queue, rows, choices = self._submit(request, completion, decoder)
        reply = _Reply(request, completion, rows)
        loop = asyncio.get_running_loop()
        deadline = None if self._limits.timeout_s is None else start + self._limits.timeout_s
        status = "OK"
        try:
            # the deadline covers the writes too: a client that stops reading its stream is cut off at it
            async with asyncio.timeout_at(None if deadline is None else loop.time() + deadline - time.monotonic()):
                if completion.max_tokens == 0:  # nothing to decode: the prompts counted for the usage
                    reply.prompt_tokens = await _count_prompt_tokens(completion.prompts, decoder)
                first_token_at = await self._relay_tokens(request, queue, rows, choices, reply,
                                                         decoder.protocol.context_length)
                logprobs = None if completion.logprobs is None else await self._logprobs(completion, decoder, choices)
                response = await reply.end(choices, logprobs)
            self._observe_generation(completion.model, decoder, choices, start, first_token_at)
            if self._request_log is not None and completion.max_tokens > 0:  # a log-likelihood query generates nothing
                self._request_log.log("Predict", *as_predict_log(completion, decoder, choices))
            return response
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            message = (f"the completion did not finish within {self._limits.timeout_s:g} s "
                       "(--rest_api_timeout_in_ms)")
            return await reply.fail(504, message)
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except ConnectionResetError:  # nobody is left to answer
            status = "CANCELLED"
            return reply.stream or web.Response(status=499)
        except OpenAIError as error:
            status = _status_name(error.status)
            return await reply.fail(error.status, error.message, error.param)
        finally:
            for row in rows:
                row.cancel()
            refused = status == "INVALID_ARGUMENT"  # a prompt that does not fit: no generation to count
            self._observe(completion.model, str(decoder.runner.version), status, start,
                          finished=[] if refused else [choice.finish or status.lower() for choice in choices])

    def _submit(self, request: web.Request, completion: Completion,
                decoder: Decoder) -> tuple[asyncio.Queue, list[Row], list[ChoiceText]]:
        """One decode row per prompt, handed to the version's decode loop; the queue their tokens arrive on and the
        choice each row's text builds."""
        if len(completion.prompts) > decoder.max_rows:
            raise OpenAIError(400, f"prompt is a list of {len(completion.prompts)}, more than the {decoder.max_rows} "
                                   "this server decodes together (--batching_parameters_file max_batch_size)",
                              "prompt")
        refused = cache_refusal(decoder, len(completion.prompts))
        if refused:
            raise OpenAIError(429, refused)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        # must_fit: the decode loop counts the prompts' tokens before any model work and hands a row that does
        # not fit PromptTooLong instead of tokens (serving/generation/decoder.py); the answer's status line goes
        # out with the first token, so that is still a 400
        choices = [ChoiceText(completion.stops) for _ in completion.prompts]
        if completion.max_tokens == 0:
            for choice in choices:
                choice.finish = "length"
            return queue, [], choices
        rows = [Row(prompt, completion.max_tokens, completion.temperature, completion.top_k, completion.seed, i,
                    queue, loop, must_fit=True, client=request.remote or "", streamed=completion.stream)
                for i, prompt in enumerate(completion.prompts)]
        decoder.submit(rows)
        return queue, rows, choices

    async def _logprobs(self, completion: Completion, decoder: Decoder, choices: list[ChoiceText]) -> list[dict]:
        """Each choice's OpenAI logprobs: its prompt and text teacher-forced through the `score` signature, one row
        a call, one call at a time; the prompt's tokens too with echo."""
        pad = pad_id(decoder.runner.metadata)
        found = []
        for prompt, choice in zip(completion.prompts, choices):
            async with self._scoring:
                (scored,) = await asyncio.to_thread(scoring.score, decoder.runner, [prompt], [choice.text_ids()],
                                                    completion.logprobs, pad)
            first = 0 if completion.echo else scored.prompt_tokens
            found.append(scoring.logprobs_object(scored, first, len(scored.pieces) - first, completion.logprobs))
        return found

    async def _relay_tokens(self, request: web.Request, queue: asyncio.Queue, rows: list[Row],
                            choices: list[ChoiceText], reply: _Reply, context: int) -> float | None:
        """Each token the decode loop hands the rows' queue, into its choice and out to the client, until every
        choice has finished; returns when the first token came (None if none did)."""
        first_token_at = None
        while any(choice.finish is None for choice in choices):
            index, item = await queue.get()
            if isinstance(item, PromptTooLong):
                raise _context_error(context, item.prompt_tokens, item.max_new_tokens)
            if isinstance(item, BaseException):
                raise OpenAIError(500, f"generation failed: {item}")
            choice = choices[index]
            if choice.finish is not None:  # a token made before a stop sequence ended the choice
                continue
            first_token_at = first_token_at or time.monotonic()
            text = choice.add(item)
            if choice.finish is not None:
                rows[index].cancel()
            await reply.token(index, text, choice)
            if len(choice.ids) == 1:  # the decode loop waits for this after the prefill (FIRST_TOKEN_WAIT_S)
                rows[index].first_token_sent()
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client went away")
        return first_token_at

    def _observe(self, model: str, version: str, status: str, start: float, finished: list[str] = ()) -> None:
        if self._metrics is None:
            return
        self._metrics.observe_request(model_name=model, version=version, signature_name="", api="rest",
                                      rpc="Completions", status=status, seconds=time.monotonic() - start)
        for reason in finished:
            self._metrics.observe_finish(model, version, reason)

    def _observe_generation(self, model: str, decoder: Decoder, choices: list[ChoiceText], start: float,
                            first_token_at: float | None) -> None:
        if self._metrics is not None and first_token_at is not None:
            self._metrics.observe_generation(model, str(decoder.runner.version), sum(c.tokens for c in choices),
                                             first_token_at - start, time.monotonic() - start)


def _context_error(context: int, prompt_tokens: int, max_new_tokens: int) -> OpenAIError:
    """OpenAI's wording for a prompt and completion that do not fit the model's context."""
    return OpenAIError(400, f"This model's maximum context length is {context} tokens, however you requested "
                            f"{prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in your prompt; {max_new_tokens} "
                            "for the completion). Please reduce your prompt; or completion length.", "max_tokens")


def _not_exported(runner: Runner, what: str, field: str) -> OpenAIError:
    return OpenAIError(400, f"model {short(runner.model_name)} version {runner.version} has no {what} in its export "
                            "(export it again with this version of the pipeline)", field)


def _check_can_score(decoder: Decoder) -> None:
    if not scoring.can_score(decoder.runner) or pad_id(decoder.runner.metadata) is None:
        raise _not_exported(decoder.runner, f"{scoring.SCORE} signature and PAD id", "logprobs")


def _token_prompt(body: dict, limits: Limits) -> bytes:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError(400, "prompt must be a string", "prompt")
    encoded = prompt.encode("utf-8", errors="surrogatepass")
    if len(encoded) > limits.max_prompt_bytes:
        raise OpenAIError(400, f"prompt is {len(encoded)} bytes, more than the {limits.max_prompt_bytes} this server "
                               "takes (--generation_max_prompt_bytes)", "prompt")
    if not isinstance(body.get("add_special_tokens", True), bool):
        raise OpenAIError(400, "add_special_tokens must be true or false", "add_special_tokens")
    return encoded


def _tokenize(runner: Runner, prompt: bytes) -> list[int]:
    """BOS and the prompt's token ids, by the version's `tokenize` signature."""
    if "ids" not in runner.signature_defs[TOKENIZE].outputs:
        raise _not_exported(runner, f"ids output of its {TOKENIZE} signature", "prompt")
    out = runner.predict({"prompts": np.array([prompt], dtype=object)}, TOKENIZE)
    return [int(i) for i in out["ids"][0, :int(out["prompt_tokens"][0])]]


def _vocab_size(runner: Runner) -> int:
    """The served model's vocabulary: its logits' last dimension (serving_default's output)."""
    return int(runner.signature_defs["serving_default"].outputs["logits"].tensor_shape.dim[-1].size)


def _token_ids(body: dict, context: int, vocab: int) -> list[int]:
    ids = body.get("tokens")
    if (not isinstance(ids, list) or len(ids) > context
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)):
        raise OpenAIError(400, f"tokens must be a list of at most {context} token ids (the context), each an "
                               f"integer from 0 to {vocab - 1}", "tokens")
    return ids


async def _count_prompt_tokens(prompts: list[bytes], decoder: Decoder) -> list[int]:
    """Each prompt's tokens, BOS included, by the declared rule or else the tokenize signature; a prompt that does
    not fit the context is OpenAI's 400."""
    counts = await asyncio.to_thread(prompt_token_counts, decoder.runner, decoder.protocol, prompts)
    context = decoder.protocol.context_length
    for count in counts:
        if count > context:
            raise _context_error(context, count, 0)
    return counts


def as_predict_log(completion: Completion, decoder: Decoder, choices: list[ChoiceText]) -> tuple[Any, Any]:
    """A completion as the Predict on the `generate` signature it amounts to, request and response, for the
    request log (serving/request_log.py): the same records as a TF Serving client's generate calls, so `pipeline
    audit` replays both alike and a log can serve as a warmup file. ids are padded with the model's PAD id (-1 if
    pipeline.json does not name it)."""
    runner = decoder.runner
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = completion.model, "generate"
    request.model_spec.version.value = runner.version
    inputs = {"prompts": np.array(completion.prompts, dtype=object),
              "max_new_tokens": np.array(completion.max_tokens, np.int32),
              "temperature": np.array(completion.temperature, np.float32),
              "top_k": np.array(completion.top_k, np.int32), "seed": np.array(completion.seed, np.int64)}
    pad = pad_id(runner.metadata)
    width = max(len(choice.ids) for choice in choices)
    ids = np.full((len(choices), width), -1 if pad is None else pad, np.int32)
    log_probs = np.zeros((len(choices), width), np.float32)
    for i, choice in enumerate(choices):
        ids[i, :len(choice.ids)], log_probs[i, :len(choice.ids)] = choice.ids, choice.log_probs
    outputs = {"completions": np.array([choice.text.encode() for choice in choices], dtype=object), "ids": ids,
               "lengths": np.array([choice.tokens for choice in choices], np.int32), "log_probs": log_probs}
    response = predict_pb2.PredictResponse()
    response.model_spec.CopyFrom(request.model_spec)
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tensors.to_tensor_proto(value))
    for name, value in outputs.items():
        response.outputs[name].CopyFrom(tensors.to_tensor_proto(value))
    return request, response


class _Reply:
    """The answer of one completion: Server-Sent Events chunk by chunk, or one JSON body at the end."""

    def __init__(self, request: web.Request, completion: Completion, rows: list[Row]):
        self.request, self.completion, self.rows = request, completion, rows
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.stream: web.StreamResponse | None = None
        self.prompt_tokens: list[int] | None = None  # counted here where no decode row counted them

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.completion.model,
                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _usage(self, choices: list[ChoiceText]) -> dict:
        completion_tokens = sum(choice.tokens for choice in choices)
        prompt_tokens = sum(self.prompt_tokens if self.prompt_tokens is not None
                            else [row.prompt_tokens or 0 for row in self.rows])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def token(self, index: int, text: str, choice: ChoiceText) -> None:
        """A streamed answer's chunk for the token; the first one sends the status line and headers too, so an
        error found before it (a prompt that does not fit) is still a plain JSON error."""
        if not self.completion.stream or not (text or choice.finish):
            return
        await self._send(self._chunk([{"text": text, "index": index, "logprobs": None,
                                       "finish_reason": choice.finish}]))

    async def end(self, choices: list[ChoiceText], logprobs: list[dict] | None = None) -> web.StreamResponse:
        usage = self._usage(choices)
        if not self.completion.stream:
            echoed = [p.decode("utf-8", errors="replace") if self.completion.echo else ""
                      for p in self.completion.prompts]
            return _json(200, self._chunk([{"text": echoed[i] + c.text, "index": i,
                                            "logprobs": logprobs[i] if logprobs else None, "finish_reason": c.finish}
                                           for i, c in enumerate(choices)], usage))
        if self.completion.include_usage:
            await self._send(self._chunk([], usage))
        await self.stream.write(b"data: [DONE]\n\n")
        await self.stream.write_eof()
        return self.stream

    async def fail(self, status: int, message: str, param: str | None = None) -> web.StreamResponse:
        if self.stream is None:
            return _json(status, error_body(status, message, param))
        try:  # the status line went out with the first chunk: the error is the stream's last event
            async with asyncio.timeout(FAIL_WRITE_S):
                await self._send(error_body(status, message))
                await self.stream.write_eof()
        except (TimeoutError, ConnectionResetError):  # a client that does not read gets its connection closed
            if self.request.transport is not None:
                self.request.transport.close()
        return self.stream

    async def _send(self, payload: dict) -> None:
        if self.stream is None:
            self.stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await self.stream.prepare(self.request)
        await self.stream.write(b"data: " + orjson.dumps(payload) + b"\n\n")


def _json(status: int, payload: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _status_name(status: int) -> str:
    return {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED", 429: "RESOURCE_EXHAUSTED",
            500: "INTERNAL", 504: "DEADLINE_EXCEEDED"}.get(status, grpc.StatusCode.UNKNOWN.name)
