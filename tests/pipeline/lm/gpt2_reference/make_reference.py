"""Makes the GPT-2 parity fixtures of tests/pipeline/lm/test_gpt2.py with Hugging Face's own implementation: run once,
in a throwaway environment, never by the suite (torch is no dependency of the project; docs/pretrained.md#parity):

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy
    /tmp/refenv/bin/python tests/pipeline/lm/gpt2_reference/make_reference.py

For each of two tiny random GPT-2s it writes, in a directory of its name, what `save_pretrained` writes (config.json,
model.safetensors) and reference.npz: the token ids (4 x 128, seeded) and GPT2LMHeadModel's float32 logits for them,
teacher-forced. Every weight is drawn at random, the LayerNorms' and biases included (at their initial ones and zeros
a wrong mapping of them would go unseen).
"""

from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).parent
SHAPES = {
    # GPT-2's own numerics: the tanh GELU, the tied head, 2 blocks
    "tied_gelu_new": dict(vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4, n_inner=None,
                          activation_function="gelu_new", tie_word_embeddings=True, layer_norm_epsilon=1e-5),
    # the variants the importer also reads: the erf GELU, an untied head, another epsilon and n_inner
    "untied_gelu": dict(vocab_size=80, n_positions=128, n_embd=24, n_layer=1, n_head=3, n_inner=40,
                        activation_function="gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-6),
}


def main():
    for name, shape in SHAPES.items():
        torch.manual_seed(43)
        last = shape["vocab_size"] - 1  # GPT-2 ends its vocabulary with <|endoftext|>, its BOS and EOS
        config = GPT2Config(**shape, bos_token_id=last, eos_token_id=last, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)
        model = GPT2LMHeadModel(config).eval()
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("ln_1.weight") or parameter_name.endswith("ln_2.weight") or \
                        parameter_name.endswith("ln_f.weight"):
                    parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
                else:
                    parameter.copy_(0.2 * torch.randn_like(parameter))
        ids = np.random.default_rng(43).integers(0, shape["vocab_size"], size=(4, 128)).astype(np.int32)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy().astype(np.float32)
        out = HERE / name
        model.save_pretrained(out, safe_serialization=True)
        np.savez_compressed(out / "reference.npz", ids=ids, logits=logits)
        print(f"{name}: logits {logits.shape}, |max| {np.abs(logits).max():.3f}; transformers "
              f"{transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
