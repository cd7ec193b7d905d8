"""GPT-2's vocabulary for the tokenizer tests, offline: the real 50,257 entries rebuilt from the copy the
`openai-whisper` source distribution ships (whisper/assets/gpt2.tiktoken, MIT), fetched from the package registry
without its dependencies into `.gpt2-vocabulary/` beside `.venv` once (~1 s; docs/testing.md), or the first merges
of it as a small vocabulary; and the fuzz texts the encoder is checked on.

gpt2.tiktoken is base64(token bytes) and rank per line; the ranks are GPT-2's ids (the 256 bytes first, then the
token merge n makes at 256 + n), so merges.txt is rebuilt by splitting each token the way BPE over the lower ranks
splits it. Also run by gpt2_reference/make_tokenizer_reference.py, in its throwaway environment.
"""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = REPO_ROOT / ".gpt2-vocabulary"
WHISPER = "openai-whisper==20250625"
MEMBER = "whisper/assets/gpt2.tiktoken"
END_OF_TEXT = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → character map (openai/gpt-2 src/encoder.py), written out again so the reference maker does
    not import the code it checks."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def ranks_from_tiktoken(text: str) -> dict[bytes, int]:
    ranks = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocabulary(ranks: dict[bytes, int], merges: int | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab.json's map, merges.txt's pairs) of the ranks, cut after the first `merges` merges (all by default),
    with <|endoftext|> as the last id, as GPT-2's."""
    chars = bytes_to_unicode()
    text = {token: "".join(chars[b] for b in token) for token in ranks}
    by_rank = sorted(ranks, key=ranks.get)
    assert [len(t) for t in by_rank[:256]] == [1] * 256, "the first 256 ranks are the bytes"
    kept = by_rank[: 256 + (len(by_rank) - 256 if merges is None else merges)]
    pairs = [_split(token, ranks) for token in kept[256:]]
    vocab = {text[token]: i for i, token in enumerate(kept)}
    vocab[END_OF_TEXT] = len(kept)
    return vocab, [(text[left], text[right]) for left, right in pairs]


def _split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens BPE over ranks below the token's own joins into it."""
    parts, limit = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        best = min((ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1))
        if best[0] >= limit:
            break
        i = best[1]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
    assert len(parts) == 2, token
    return parts[0], parts[1]


def write(directory: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> Path:
    """vocab.json and merges.txt as Hugging Face writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                          encoding="utf-8")
    return directory


def tiktoken_file(directory: Path = CACHE) -> Path:
    """gpt2.tiktoken, fetched from the package registry the first time."""
    target = directory / "gpt2.tiktoken"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        step = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", WHISPER,
                "-d", download]
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed: {(done.stderr or done.stdout)[-2000:]}")
        archive = next(Path(download).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(MEMBER))
            partial = target.with_suffix(".partial")
            partial.write_bytes(tar.extractfile(member).read())
            partial.replace(target)
    return target


def real_vocabulary(directory: Path = CACHE) -> Path:
    """A directory with GPT-2's own vocab.json and merges.txt (50,257 ids, 50,000 merges)."""
    out = directory / "gpt2"
    if not (out / "merges.txt").exists():
        vocab, merges = vocabulary(ranks_from_tiktoken(tiktoken_file(directory).read_text()))
        write(out.with_name("gpt2.partial"), vocab, merges).replace(out)
    return out


# ---- the fuzz texts ----

PIECES = ["hello", " world", "Hello", "HELLO", "it's", "I'm", "we'll", "they've", "you're", "'d", "'S", "don't",
          " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\x0b", "\x1c", "\x85",
          "0", "7", "42", "2026", "3.14", "1,000", "٣", "Ⅻ", "½", "²", "!", "?!", "...", "--", "()", "{}", "#",
          "@user", "$5", "%", "&amp;", "é", "ü", "ß", "Ω", "naïve", "café", "中文", "日本語", "한국어", "Ελληνικά",
          "русский", "עברית", "العربية", "हिन्दी", "ไทย", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "\u200d", "\ufeff", "a\u0301",
          "x" * 40, "ab" * 15, " " * 9, "\x00", "\x7f", "<|endoftext|>", "'", "''", "'''s", " 's", "  's", "\t's",
          "https://example.com/a?b=c", "snake_case", "CamelCase", "e-mail", "tab\tbed", "end.", " .", "  ."]


def fuzz_texts(count: int = 10_000, seed: int = 43) -> list[str]:
    """count texts of 0-12 pieces (words, contractions, whitespace runs, digits, scripts, emoji, controls) and
    random code points, the same for the same seed."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randrange(13)):
            if rng.random() < 0.15:
                code = rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0xa0, 0x3000),
                                   rng.randrange(0x3000, 0xd7ff), rng.randrange(0x1f300, 0x1faff)])
                parts.append(chr(code))
            else:
                parts.append(rng.choice(PIECES))
        texts.append("".join(parts))
    return texts
