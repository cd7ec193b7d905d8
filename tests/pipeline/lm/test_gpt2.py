"""GPT-2 checkpoints (pipeline/lm/gpt2.py, docs/pretrained.md): the imported model computes what Hugging Face's
GPT2LMHeadModel computes on the same weights (fixtures made by gpt2_reference/make_reference.py), the layouts
checkpoints come in are read alike, a model is written back in that layout, and a damaged or hostile checkpoint costs
one line naming what is wrong before anything is built or read."""

import json
import shutil
import struct
import tracemalloc
from pathlib import Path

import keras
import ml_dtypes
import numpy as np
import pytest

from pipeline.errors import CheckpointError
from pipeline.lm import causal_lm, gpt2
from pipeline.lm.safetensors_file import TensorFile, write

REFERENCE = Path(__file__).parent / "gpt2_reference"
CHECKPOINTS = ("tied_gelu_new", "untied_gelu")


def reference(name):
    data = np.load(REFERENCE / name / "reference.npz")
    return data["ids"], data["logits"]


def copy_checkpoint(name, tmp_path) -> Path:
    target = tmp_path / name
    shutil.copytree(REFERENCE / name, target)
    return target


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_imported_logits_equal_hugging_faces_within_float32_rounding(name):
    """Teacher-forced over 4 x 128 tokens, float32: the issue's bound is 1e-4 max abs (HF's own cross-framework
    checks use 1e-5 to 2e-4); measured 3.2e-6 and 1.7e-6 with oneDNN on, on an AMD EPYC."""
    ids, expected = reference(name)
    logits = np.asarray(gpt2.load(REFERENCE / name)(ids))
    assert logits.dtype == np.float32 and logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)


def test_the_architecture_is_the_configs():
    model = gpt2.load(REFERENCE / "untied_gelu")
    block = causal_lm.blocks(model)[0]
    assert (len(causal_lm.blocks(model)), block.num_heads, block.width, block.mlp_width) == (1, 3, 24, 40)
    assert block.norm_1.epsilon == block.norm_2.epsilon == model.get_layer("final_norm").epsilon == 1e-6
    assert block.activation == "gelu" and not model.get_layer("logits").use_bias
    assert causal_lm.context_length(model) == 128
    tied = causal_lm.blocks(gpt2.load(REFERENCE / "tied_gelu_new"))[0]
    assert tied.activation == "gelu_tanh" and tied.mlp_width == 4 * 32


def test_under_a_mixed_policy_the_variables_hold_the_checkpoints_float32_values(tmp_path):
    """Fine-tuning starts from the checkpoint's own numbers: the mixed policies keep float32 variables."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = gpt2.load(REFERENCE / "tied_gelu_new")
    tensors = TensorFile(REFERENCE / "tied_gelu_new" / gpt2.WEIGHTS_FILE)
    kernel = causal_lm.blocks(model)[1].attention.value.kernel
    assert kernel.dtype == "float32" and causal_lm.cache_dtype(model) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(kernel), tensors.read("transformer.h.1.attn.c_attn.weight")[:, 64:96])
    ids, expected = reference("tied_gelu_new")
    logits = np.asarray(model(ids))
    assert logits.dtype == np.float32  # the logits stay float32 under the policy (docs/precision.md)
    assert np.mean(np.argmax(logits, -1) == np.argmax(expected, -1)) > 0.9


def test_a_hub_layout_in_bfloat16_reads_as_its_float32_values(tmp_path):
    """Hub files have no `transformer.` prefix and carry the attn.bias mask buffers; bfloat16 tensors (which the
    safetensors package's numpy reader refuses) give the same model as those values in float32."""
    source = TensorFile(REFERENCE / "tied_gelu_new" / gpt2.WEIGHTS_FILE)
    rounded = {name.removeprefix("transformer."): source.read(name).astype(ml_dtypes.bfloat16)
               for name in source.names()}
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(REFERENCE / "tied_gelu_new" / gpt2.CONFIG_FILE, hub)
    buffers = {f"h.{n}.attn.bias": np.tril(np.ones((128, 128), np.float32))[None, None] for n in range(2)}
    write(hub / gpt2.WEIGHTS_FILE, {**rounded, **buffers})
    as_float32 = tmp_path / "float32"
    as_float32.mkdir()
    shutil.copy(REFERENCE / "tied_gelu_new" / gpt2.CONFIG_FILE, as_float32)
    write(as_float32 / gpt2.WEIGHTS_FILE, {f"transformer.{name}": value.astype(np.float32)
                                           for name, value in rounded.items()})
    ids, expected = reference("tied_gelu_new")
    logits = np.asarray(gpt2.load(hub)(ids))
    np.testing.assert_array_equal(logits, np.asarray(gpt2.load(as_float32)(ids)))
    assert 1e-4 < np.abs(logits - expected).max() < 0.5  # bfloat16's rounding of the weights, and only that


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_model_written_back_is_the_checkpoint_it_came_from(name, tmp_path):
    """save writes what save_pretrained wrote: the same tensor names, shapes and float32 bits, and a config.json
    with the same architecture."""
    model = gpt2.load(REFERENCE / name)
    gpt2.save(model, tmp_path / "out")
    original, written = (TensorFile(d / gpt2.WEIGHTS_FILE) for d in (REFERENCE / name, tmp_path / "out"))
    assert sorted(written.names()) == sorted(original.names())
    for tensor in original.names():
        np.testing.assert_array_equal(written.read(tensor), original.read(tensor), err_msg=tensor)
    assert gpt2.read_config(tmp_path / "out") == gpt2.read_config(REFERENCE / name)
    assert not list(tmp_path.glob("*.partial"))
    with pytest.raises(CheckpointError, match="exists"):
        gpt2.save(model, tmp_path / "out")


# ---- hostile and damaged checkpoints: one line each, before the model is built ----

def raw_file(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def tensor_header(**tensors) -> bytes:
    return json.dumps(tensors).encode()


HOSTILE_FILES = {
    "shorter than its length prefix": (b"", None, b"", "not a safetensors file"),
    "a 2 GiB header": (b"{}", 2 << 30, b"", "a safetensors header is at most 100,000,000"),
    "a header longer than the file": (b"{}", 4096, b"", "the file has 2 after the length"),
    "a header that is not JSON": (b"{nope", None, b"", "its header is not JSON"),
    "a header that is a list": (b"[1, 2]", None, b"", "its header is a JSON list"),
    "a header nested without end": (b"[" * 100_000 + b"]" * 100_000, None, b"", "nests JSON too deeply"),
    "a dtype it does not name": (tensor_header(w={"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}),
                                 None, bytes(16), "dtype 'F128'; this reader knows F64, F32"),
    "a negative dimension": (tensor_header(w={"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}),
                             None, bytes(4), "a shape is a list of non-negative integers"),
    "offsets past the file": (tensor_header(w={"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}),
                              None, bytes(8), "the file holds 8"),
    "a size that is not the shape's": (tensor_header(w={"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}),
                                       None, bytes(8), "12 bytes, but its data_offsets span 8"),
    "overlapping tensors": (tensor_header(a={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                          b={"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}),
                            None, bytes(12), "overlap or leave a gap"),
    "metadata that is not strings": (tensor_header(__metadata__={"n": 1}), None, b"", "map strings to strings"),
}


@pytest.mark.parametrize("case", HOSTILE_FILES)
def test_a_hostile_tensor_file_is_one_line_and_no_memory(case, tmp_path):
    header, length, data, message = HOSTILE_FILES[case]
    path = raw_file(tmp_path / "model.safetensors", header, data, length)
    if not header and not data:
        path.write_bytes(b"\x01\x02")
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=message) as error:
            TensorFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    assert peak < 64 * len(path.read_bytes()) + (1 << 20)  # what the file holds, not what its header claims


def edited_config(tmp_path, **changes) -> Path:
    directory = copy_checkpoint("tied_gelu_new", tmp_path)
    config = json.loads((directory / gpt2.CONFIG_FILE).read_text())
    config.update(changes)
    (directory / gpt2.CONFIG_FILE).write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"vocab_size": -5}, "vocab_size is -5; it must be a positive integer"),
    ({"n_layer": "2"}, "n_layer is '2'; it must be a positive integer"),
    ({"n_head": 5}, "n_embd 32 is not a multiple of n_head 5"),
    ({"n_embd": 1_000_000_000, "n_head": 1}, "'transformer.h.0.attn.c_attn.bias' has shape \\[96\\]; "
                                             "config.json makes it \\[3000000000\\]"),
    ({"n_layer": 1}, "tensor 'transformer.h.1.attn.c_attn.bias' is not part of a GPT-2 model of this config"),
    ({"n_layer": 3}, "no tensor 'h.2.ln_1.weight' \\(and 11 more\\)"),
    ({"activation_function": "relu"}, "activation_function 'relu'; supported: gelu_new, gelu_pytorch_tanh, gelu"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx is True; this importer supports"),
    ({"add_cross_attention": True}, "add_cross_attention is True"),
    ({"model_type": "gpt_neo"}, "model_type 'gpt_neo'; this importer reads 'gpt2'"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon is 0; a number between 0 and 1"),
    ({"n_inner": -1}, "n_inner is -1"),
    ({"tie_word_embeddings": False}, "no tensor 'lm_head.weight'"),
])
def test_a_config_that_does_not_fit_the_checkpoint_is_one_line_before_any_model(changes, message, tmp_path):
    with pytest.raises(CheckpointError, match=message) as error:
        gpt2.load(edited_config(tmp_path, **changes))
    assert "\n" not in str(error.value)


def test_tensors_that_do_not_fit_are_named(tmp_path):
    directory = copy_checkpoint("tied_gelu_new", tmp_path)
    source = TensorFile(directory / gpt2.WEIGHTS_FILE)
    tensors = {name: source.read(name) for name in source.names()}
    (directory / gpt2.WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        gpt2.load(directory)
    (directory / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="a sharded checkpoint"):
        gpt2.load(directory)
    for edit, message in [
        (lambda t: t.update({"transformer.h.0.mlp.c_fc.bias": t["transformer.h.0.mlp.c_fc.bias"][:-1]}),
         "'transformer.h.0.mlp.c_fc.bias' has shape \\[127\\]; config.json makes it \\[128\\]"),
        (lambda t: t.update({"transformer.h.0.ln_1.weight": t["transformer.h.0.ln_1.weight"].astype(np.int32)}),
         "'transformer.h.0.ln_1.weight' is I32; weights are one of F32, F16, BF16, F64"),
        (lambda t: t.update({"h.0.ln_1.bias": t["transformer.h.0.ln_1.bias"]}),
         "'h.0.ln_1.bias' appears twice"),
        (lambda t: t.update({"transformer.h.0.crossattention.c_attn.weight": np.zeros((32, 64), np.float32)}),
         "'transformer.h.0.crossattention.c_attn.weight' is not part of a GPT-2 model"),
        (lambda t: t.pop("transformer.wpe.weight"), "no tensor 'wpe.weight'$"),
    ]:
        edited = dict(tensors)
        edit(edited)
        write(directory / gpt2.WEIGHTS_FILE, edited)
        with pytest.raises(CheckpointError, match=message):
            gpt2.load(directory)


def test_a_missing_or_damaged_config_is_named(tmp_path):
    directory = copy_checkpoint("tied_gelu_new", tmp_path)
    (directory / gpt2.CONFIG_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not a JSON config"):
        gpt2.load(directory)
    (directory / gpt2.CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        gpt2.load(directory)
