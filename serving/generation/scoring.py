"""Log-likelihoods of given text through a language model's `score` signature (pipeline/lm/generate.py), for
OpenAI's `echo` and `logprobs` (serving/rest/openai.py): teacher-forced, one forward pass over prompt + completion,
computed in float32 from the served policy's logits (docs/serving.md#log-probabilities).

The answer's shape is OpenAI's legacy completions `logprobs` object: `tokens`, `token_logprobs`, `top_logprobs`
(the top N per token, the token itself added where it is not among them: OpenAI's "up to logprobs + 1"),
`text_offset` (each token's first character in the choice's text).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.servable.runner import Runner

SCORE, DETOKENIZE = "score", "detokenize"
MAX_LOGPROBS = 5  # OpenAI's limit on completions' logprobs


@dataclasses.dataclass
class Scored:
    """One row of a score call: the tokens after BOS (the prompt's first, then the continuation's), their bytes
    and log-probabilities, and the top alternatives at each."""

    prompt_tokens: int
    pieces: list[bytes]
    log_probs: list[float]
    top: list[list[tuple[bytes, float]]]


def can_score(runner: Runner) -> bool:
    return SCORE in runner.signatures


def score(runner: Runner, prompts: list[bytes], continuations: list[list[int]], top_n: int, pad: int) -> list[Scored]:
    """Each prompt followed by its continuation ids, scored in one call of the `score` signature."""
    width = max((len(ids) for ids in continuations), default=0)
    ids = np.full((len(prompts), width), pad, np.int32)
    for i, row in enumerate(continuations):
        ids[i, :len(row)] = row
    out = runner.predict({"prompts": np.array(prompts, dtype=object), "continuations": ids,
                          "top_n": np.array(top_n, np.int32)}, SCORE)
    rows = []
    for i in range(len(prompts)):
        n = int(out["lengths"][i])
        rows.append(Scored(prompt_tokens=int(out["prompt_tokens"][i]), pieces=list(out["pieces"][i, :n]),
                           log_probs=[float(x) for x in out["log_probs"][i, :n]],
                           top=[list(zip(out["top_pieces"][i, t], map(float, out["top_log_probs"][i, t])))
                                for t in range(n)]))
    return rows


def token_text(piece: bytes) -> str:
    """A token as OpenAI writes it: its text, or `bytes:\\xNN...` where it is not whole UTF-8 (a byte of a longer
    character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


def logprobs_object(scored: Scored, first: int, count: int, top_n: int) -> dict:
    """OpenAI's logprobs for tokens [first, first + count) of a scored row, offsets counted from the first."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    text = b""
    for t in range(first, first + count):
        piece = scored.pieces[t]
        offsets.append(len(text.decode("utf-8", errors="ignore")))  # the whole characters before it
        text += piece
        tokens.append(token_text(piece))
        token_logprobs.append(scored.log_probs[t])
        top = {token_text(p): lp for p, lp in scored.top[t][:top_n]}
        top.setdefault(tokens[-1], scored.log_probs[t])
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs if top_n else None, "text_offset": offsets}
