"""model.kind causal_lm: the decoder-only language model, its tokenizers and its decode loop, side by side.

    causal_lm.py   the model: token and position embeddings, causal self-attention that hands out its keys and
                   values, the causal mask, the cache's prefill and decode step, the tied float32 logits
    generate.py    the whole generation as one graph (cache written in place, top-k sampling keyed per row, EOS
                   per row) and its SavedModel: serving_default, generate, tokenize and the decode protocol
    tokenizers.py  data.tokenizer's one home: bytes (core ops), sentencepiece (TF Text's ops in the graph) and
                   gpt2 (bpe.py's, core ops)
    gpt2.py        a GPT-2 checkpoint in Hugging Face's layout (model.init_from) read into causal_lm, written back
    bpe.py         GPT-2's byte-level BPE as TensorFlow core ops, equal to OpenAI's encoder
    safetensors_file.py  the safetensors format, read and written, every rule checked before a tensor is read

Trained by pipeline/train/ like every kind (built through pipeline/models/build.py), exported by
pipeline/export/lm.py and gated by pipeline/export/lm_parity.py.
"""
