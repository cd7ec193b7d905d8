"""model.kind causal_lm: the decoder-only language model, its tokenizers and its decode loop, side by side.

    causal_lm.py   the model: token and position embeddings, causal self-attention that hands out its keys and
                   values, the causal mask, the cache's prefill and decode step, the tied float32 logits
    generate.py    the whole generation as one graph (cache written in place, top-k sampling keyed per row, EOS
                   per row) and its SavedModel: serving_default, generate, tokenize and the decode protocol
    tokenizers.py  data.tokenizer's one home: bytes (core ops) and sentencepiece (TF Text's ops in the graph)

Trained by pipeline/train/ like every kind (built through pipeline/models/build.py), exported by
pipeline/export/lm.py and gated by pipeline/export/lm_parity.py.
"""
