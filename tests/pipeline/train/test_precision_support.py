"""The start-of-run line that says what the machine computes natively (in place of TensorFlow's C++ log)."""

import pytest

from pipeline.precision import Hardware
from pipeline.train.run import precision_support


@pytest.mark.parametrize("hardware, expected", [
    (Hardware(cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"})),
     "precision: this CPU (no GPU): float16 is emulated (no AVX512_FP16), so mixed_float16 computes correctly but "
     "slower than float32; bfloat16 is native (avx512_bf16), so mixed_bfloat16 may beat float32, by how much depends "
     "on the model's shapes (precision.policy auto measures both)"),
    (Hardware(cpu_flags=frozenset({"avx2"})),
     "precision: this CPU (no GPU): float16 is emulated (no AVX512_FP16), so mixed_float16 computes correctly but "
     "slower than float32; bfloat16 is emulated too (no AVX512_BF16 or AMX_BF16), so float32 is the fastest policy"),
    (Hardware(cpu_flags=frozenset({"avx512_fp16", "amx_bf16", "amx_fp16"})),
     "precision: this CPU (no GPU): float16 is native (avx512_fp16, amx_fp16); bfloat16 is native (amx_bf16), so "
     "mixed_bfloat16 may beat float32, by how much depends on the model's shapes (precision.policy auto measures "
     "both)"),
    (Hardware(gpus=(("Tesla T4", (7, 5)),), cpu_flags=frozenset({"avx512_bf16"})),
     "precision: GPU Tesla T4 (compute capability 7.5): float16 on Tensor Cores; no bfloat16 Tensor Cores (below 8.0)"),
    (Hardware(gpus=(("NVIDIA H100", (9, 0)),)),
     "precision: GPU NVIDIA H100 (compute capability 9.0): float16 on Tensor Cores; bfloat16 on Tensor Cores"),
    (Hardware(gpus=(("Tesla K80", (3, 7)),)),
     "precision: GPU Tesla K80 (compute capability 3.7): no float16 Tensor Cores (below 7.0); no bfloat16 Tensor "
     "Cores (below 8.0)"),
    (Hardware(tpu=True), "precision: TPU: bfloat16 is its native matmul type"),
])
def test_the_line_names_what_is_native_and_what_is_emulated(hardware, expected):
    assert precision_support(hardware) == expected
