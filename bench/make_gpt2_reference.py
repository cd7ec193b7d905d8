"""Makes figure 14's reference logits with Hugging Face's GPT2LMHeadModel: run once, in a throwaway environment, never
by the bench (torch is no dependency of the project; docs/pretrained.md#parity):

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch==2.13.0 transformers==5.23.0 numpy
    /tmp/refenv/bin/python bench/make_gpt2_reference.py

For each shape of bench/gpt2_weights.py it loads those weights into GPT2LMHeadModel (float32, the tanh GELU, a tied
head, epsilon 1e-5) and writes bench/fixtures/gpt2_<shape>.npz: the ids and every 4th position's float32 logits.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import gpt2_weights  # noqa: E402


def main():
    for name, (num_layers, width, num_heads, n_positions, vocab_size) in gpt2_weights.SHAPES.items():
        config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=width, n_layer=num_layers,
                            n_head=num_heads, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                            tie_word_embeddings=True, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config).eval()
        shapes = {k.removeprefix("transformer."): tuple(v.shape) for k, v in model.named_parameters()}  # tied: no lm_head
        state = {f"transformer.{k}": torch.from_numpy(v) for k, v in gpt2_weights.weights(shapes).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("attn.bias") or k == "lm_head.weight" for k in missing), missing
        model.tie_weights()
        ids = gpt2_weights.token_ids(name)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy().astype(np.float32)
        out = HERE / "fixtures" / f"gpt2_{name}.npz"
        out.parent.mkdir(exist_ok=True)
        np.savez_compressed(out, ids=ids, logits=logits[:, gpt2_weights.KEPT_POSITIONS])
        print(f"{name}: logits {logits.shape}, |max| {np.abs(logits).max():.3f}; transformers "
              f"{transformers.__version__}, torch {torch.__version__} -> {out}")


if __name__ == "__main__":
    main()
