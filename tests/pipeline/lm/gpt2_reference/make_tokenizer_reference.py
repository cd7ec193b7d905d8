"""Makes the tokenizer fixtures of tests/pipeline/lm/test_bpe.py with the reference encoders: run once, in a throwaway
environment (the same one as make_reference.py; `regex` comes with transformers), never by the suite:

    /tmp/refenv/bin/python tests/pipeline/lm/gpt2_reference/make_tokenizer_reference.py

It writes pipeline/lm/gpt2_vocabulary/{vocab.json, merges.txt} (GPT-2's first 200 merges: 457 ids) and tokenizer/reference.npz:
the ids of the 10,000 fuzz texts of tests/helpers/gpt2_vocabulary.py under the small and the real vocabulary, by
OpenAI's encoder (openai/gpt-2 src/encoder.py's algorithm, its pattern without the <|endoftext|> alternative: a
literal one is text, as tiktoken's encode_ordinary), checked against Hugging Face's GPT2Tokenizer on every text
without a literal <|endoftext|> (which that one makes the special id).
"""

import sys
from pathlib import Path

import numpy as np
import regex
from transformers import GPT2Tokenizer

HERE = Path(__file__).parent
PACKAGED = HERE.parents[3] / "pipeline" / "lm" / "gpt2_vocabulary"  # bpe.PACKAGED
sys.path.insert(0, str(HERE.parents[2] / "helpers"))
import gpt2_vocabulary  # noqa: E402

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def openai_encode(text, vocab, ranks, chars):
    """encoder.py's Encoder.encode and bpe, without its cache."""
    ids = []
    for piece in PATTERN.findall(text):
        word = tuple(chars[b] for b in piece.encode("utf-8"))
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            bigram = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
            if bigram not in ranks:
                break
            first, second = bigram
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        ids.extend(vocab[token] for token in word)
    return ids


def main():
    out = HERE / "tokenizer"
    ranks = gpt2_vocabulary.ranks_from_tiktoken(gpt2_vocabulary.tiktoken_file(Path("/tmp/gpt2-vocabulary"))
                                                .read_text())
    texts = gpt2_vocabulary.fuzz_texts()
    chars = gpt2_vocabulary.bytes_to_unicode()
    arrays = {}
    for name, merges in (("small", 200), ("real", None)):
        vocab, merge_list = gpt2_vocabulary.vocabulary(ranks, merges)
        directory = gpt2_vocabulary.write(PACKAGED if name == "small" else Path("/tmp/gpt2-vocabulary/real"),
                                          vocab, merge_list)
        pair_ranks = {pair: i for i, pair in enumerate(merge_list)}
        ids = [openai_encode(text, vocab, pair_ranks, chars) for text in texts]
        hf = GPT2Tokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
        disagree = [t for t, i in zip(texts, ids) if "<|endoftext|>" not in t and hf.encode(t) != i]
        assert not disagree, f"{name}: Hugging Face disagrees on {len(disagree)} texts, e.g. {disagree[0]!r}"
        arrays[f"{name}_ids"] = np.array([i for row in ids for i in row], np.uint16)  # ids < 65,536
        arrays[f"{name}_lengths"] = np.array([len(row) for row in ids], np.int32)
        print(f"{name}: {len(vocab)} ids, {len(merge_list)} merges, {sum(map(len, ids))} tokens; HF agrees")
    if (out / "real").exists():
        raise SystemExit("tokenizer/real must not be committed")
    hello = openai_encode("hello world", *gpt2_vocabulary.vocabulary(ranks)[:1],
                          {p: i for i, p in enumerate(gpt2_vocabulary.vocabulary(ranks)[1])}, chars)
    assert hello == [31373, 995], hello
    np.savez_compressed(out / "reference.npz", **arrays)


if __name__ == "__main__":
    main()
