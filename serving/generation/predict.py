"""TF Serving's Predict on a language model's `generate` signature, answered by the decode loop instead of one
whole-graph call (docs/serving.md#generation-openai-completions-streamed): the same outputs (completions, ids
padded with the tokenizer's PAD, lengths, log_probs; the same tokens, as every row's random draws are keyed by
the seed, its index and the step), but the rows share decode steps with every other generation of the moment,
and a call whose gRPC deadline or --rest_api_timeout_in_ms passes, or whose client cancels, leaves the batch
before the next step instead of running to its last token."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np

from serving.errors import ServingError
from serving.generation.decoder import Decoder, Row, cache_refusal
from serving.servable.signature import ModelCall

GENERATE = "generate"
_INPUTS = {"prompts", "max_new_tokens", "temperature", "top_k", "seed"}


def pad_id(metadata: dict | None) -> int | None:
    """The id `generate` pads its ids with, from pipeline.json (None: unknown, so the whole graph answers)."""
    try:
        return int(metadata["language_model"]["tokenizer"]["special_ids"]["pad"])
    except (KeyError, TypeError, ValueError):
        return None


def steppable(call: ModelCall) -> bool:
    """A generate call the decode loop can answer: the signature's five inputs, a batch of prompts, scalars."""
    inputs = call.inputs
    return (set(inputs) == _INPUTS and inputs["prompts"].ndim == 1 and len(inputs["prompts"]) > 0
            and all(inputs[name].ndim == 0 for name in _INPUTS - {"prompts"}))


async def generate(decoder: Decoder, call: ModelCall, pad: int, time_remaining: float | None,
                   client: str = "") -> dict[str, np.ndarray]:
    """The generate signature's outputs for the call, made by the decode loop; DEADLINE_EXCEEDED once
    time_remaining (seconds, None: none) is spent, its rows given up. client: who sent it (client_of)."""
    inputs = call.inputs
    context = decoder.protocol.context_length
    max_new = int(np.clip(inputs["max_new_tokens"], 0, context - 1))  # as generate clamps it
    prompts = [bytes(p) if not isinstance(p, str) else p.encode() for p in inputs["prompts"]]
    ids = np.full((len(prompts), max_new), pad, np.int32)
    log_probs = np.zeros((len(prompts), max_new), np.float32)
    completions, lengths = [b""] * len(prompts), np.zeros(len(prompts), np.int32)
    refused = cache_refusal(decoder, len(prompts))
    if refused:
        raise ServingError(refused, grpc.StatusCode.RESOURCE_EXHAUSTED)
    if max_new:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        rows = [Row(prompt, max_new, float(inputs["temperature"]), int(inputs["top_k"]), int(inputs["seed"]), i,
                    queue, loop, client=client) for i, prompt in enumerate(prompts)]
        made = [0] * len(rows)
        pieces: list[list[bytes]] = [[] for _ in rows]
        decoder.submit(rows)
        try:
            async with asyncio.timeout(time_remaining):
                left = len(rows)
                while left:
                    index, token = await queue.get()
                    if isinstance(token, BaseException):
                        raise ServingError(f"generation failed: {token}", grpc.StatusCode.INTERNAL)
                    ids[index, made[index]], log_probs[index, made[index]] = token.id, token.log_prob
                    made[index] += 1
                    pieces[index].append(token.piece)
                    if token.finish == "stop":
                        lengths[index] = made[index] - 1  # the tokens before the end of text
                    elif token.finish == "length":
                        lengths[index] = made[index]
                    left -= token.finish is not None
        except TimeoutError:
            raise ServingError("Deadline Exceeded", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        finally:
            for row in rows:
                row.cancel()
        completions = [b"".join(parts) for parts in pieces]
    outputs = {"completions": np.array(completions, dtype=object), "ids": ids, "lengths": lengths,
               "log_probs": log_probs}
    return {name: outputs[name] for name in call.outputs}


def client_of(context: Any) -> str:
    """The address a gRPC call (context.peer(): 'ipv4:10.0.0.7:51234', 'ipv6:[::1]:51234') or a REST request
    (context.client) came from, without its port: one client's calls share one fair share of the decode batch."""
    if isinstance(getattr(context, "client", None), str):
        return context.client
    peer = getattr(context, "peer", None)
    address = peer() if callable(peer) else ""
    host = address.rsplit(":", 1)[0] if address.count(":") >= 2 else address  # the port, after the scheme
    return host.split(":", 1)[1] if ":" in host else host


def remaining(context: Any) -> float | None:
    """Seconds left of a gRPC call's deadline or a REST request's --rest_api_timeout_in_ms (None: no deadline)."""
    time_remaining = getattr(context, "time_remaining", None)
    return time_remaining() if callable(time_remaining) else None
