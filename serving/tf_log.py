"""Quiets TensorFlow's C++ start-up log unless the user chose its level: one mechanism for every entry point.

TensorFlow writes its C++ log to stderr while it loads (no CUDA drivers, `failed call to cuInit`, oneDNN's
float16 fallback, the CPU instructions it was built for); a newcomer reads those lines as failures.
TF_CPP_MIN_LOG_LEVEL sets what TensorFlow logs once loaded, but absl prints the load-time lines before it
reads the variable (docs/keras3-mixed-precision.md §8). So quiet_tensorflow() sets the variable (inherited
by child processes) and filters the first `import tensorflow`, wherever it happens, through a temporary
file: lines of the hidden severities are dropped, everything else (a traceback, a Python warning, a fatal
line) is written back. A user who sets TF_CPP_MIN_LOG_LEVEL (0 shows everything) gets TensorFlow as is.
The GPU build's `failed call to cuInit` is an ERROR line written when the devices are first listed, after the
import; on a machine with no NVIDIA device it says no more than the INFO line "Could not find cuda drivers",
so there the devices are listed inside the filter and that line is hidden too. Where a GPU is present it shows.
Likewise oneDNN's `oneDNN supports DT_HALF only on platforms with AVX-512 ...`, an ERROR line TensorFlow writes
once per process when a graph first has a float16 op on a CPU without AVX512_FP16, AMX_FP16 or AVX_NE_CONVERT
(an AMD EPYC; tensorflow/core/util/util.cc DataTypeUnsupportedWarning): on such a CPU a float16 graph is run
inside the filter, its line is hidden, and float16_note() says at INFO what the CPU does with float16 instead.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator

from serving.cpu_info import cpu_info

# absl's C++ log line: "I0000 00:00:1795465277.088969    5657 port.cc:153] ..."; its severity letter first.
_LOG_LINE = re.compile(rb"^([IWE])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")
# The banner absl prints before its first line, and the continuation of cpu_feature_guard's line.
_NOTES = (b"WARNING: All log messages before absl::InitializeLog() is called", b"To enable the following instructions:")
# Hidden only where no NVIDIA device exists (the driver creates /dev/nvidiactl): there it is not a failure.
_NO_GPU_NOTE = b"failed call to cuInit"
_NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"
# oneDNN computes float16 only with one of these (util.cc IsDataTypeSupportedByOneDNNOnThisCPU); else it says so.
_ONEDNN_FLOAT16_FLAGS = ("avx512_fp16", "amx_fp16", "avx_ne_convert")
_NO_ONEDNN_FLOAT16_NOTE = b"oneDNN supports DT_HALF only on platforms with AVX-512"
_HIDDEN_BY_LEVEL = {"1": b"I", "2": b"IW", "3": b"IWE"}  # TF_CPP_MIN_LOG_LEVEL: 1 INFO, 2 +WARNING, 3 +ERROR


# Set beside TF_CPP_MIN_LOG_LEVEL to the value this module gave it: a child process (a compare training, the
# demo's server) or a second call in one process can then tell our setting from the user's own choice.
_SET_HERE = "TF_CPP_MIN_LOG_LEVEL_SET_BY_SERVING_TF_LOG"


def quiet_tensorflow(level: str, environ: os._Environ | dict = os.environ) -> bool:
    """Sets TF_CPP_MIN_LOG_LEVEL to level ("1": warnings and errors still show; "3": nothing) and filters the
    lines TensorFlow prints while it loads, unless the user set the variable; returns whether it did."""
    current = environ.get("TF_CPP_MIN_LOG_LEVEL")
    if current is not None and environ.get(_SET_HERE) != current:
        return False  # the user's choice
    environ["TF_CPP_MIN_LOG_LEVEL"] = environ[_SET_HERE] = level
    if "tensorflow" not in sys.modules and not any(isinstance(f, _FilteredFirstImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FilteredFirstImport(_HIDDEN_BY_LEVEL.get(level, b"I")))
    return True


class _FilteredFirstImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` with a loader that runs its import while stderr is filtered; gone once it ran."""

    def __init__(self, hidden: bytes):
        self.hidden = hidden
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow" or self._finding:
            return None
        self._finding = True  # importlib.util.find_spec asks the finders again, this one included
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _FilteredLoader(spec.loader, self)
        return spec


class _FilteredLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, finder: _FilteredFirstImport):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self.finder in sys.meta_path:  # the import itself, not a probe (importlib.util.find_spec)
            sys.meta_path.remove(self.finder)
        module.__loader__ = module.__spec__.loader = self.loader  # TensorFlow sees its own loader
        no_gpu = not os.path.exists(_NVIDIA_CONTROL_DEVICE)
        no_float16 = _onednn_lacks_float16()
        with _filtered_stderr(self.finder.hidden, no_gpu, no_float16):
            self.loader.exec_module(module)
            if no_gpu:
                module.config.list_physical_devices()  # writes the cuInit line now, inside the filter
            if no_float16:
                _run_a_float16_graph(module)  # writes oneDNN's float16 line now, inside the filter
        _float16_note[0] = _FLOAT16_NOTE if no_float16 else None


_FLOAT16_NOTE = ("float16 on this CPU: it has none of " + ", ".join(_ONEDNN_FLOAT16_FLAGS) + ", so oneDNN has no "
                 "float16 kernels and TensorFlow's Eigen kernels compute float16, slower than float32 "
                 "(docs/precision.md); bfloat16 or float32 weights serve faster here")
_float16_note: list[str | None] = [None]


def float16_note() -> str | None:
    """What this CPU does with float16, once TensorFlow was imported through the filter on a CPU whose oneDNN
    has no float16 kernels (for the server's start-up log, at INFO); None elsewhere."""
    return _float16_note[0]


def _onednn_lacks_float16() -> bool:
    """Whether oneDNN is on and this x86 CPU (as /proc/cpuinfo says) has none of its float16 instructions."""
    _, flags = cpu_info()
    return (os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0" and "avx2" in flags
            and not any(flag in flags for flag in _ONEDNN_FLOAT16_FLAGS))


def _run_a_float16_graph(tf) -> None:  # noqa: ANN001 - the tensorflow module being imported
    """A float16 MatMul in a graph: oneDNN's graph pass checks the dtype and writes its once-per-process line.

    Run by a session of its own, on the CPU, with threads of its own: an eager op would fix TensorFlow's thread
    pools and devices for the whole process, and the server, the bench and training set those after the import
    (--tensorflow_intra_op_parallelism failed with "cannot be modified after initialization" on such a CPU)."""
    graph = tf.Graph()
    with graph.as_default(), tf.device("/CPU:0"):
        x = tf.ones((2, 2), tf.float16)
        y = tf.nn.relu(tf.matmul(x, x))
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0}, intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1, use_per_session_threads=True)
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(y)


def _hidden(line: bytes, severities: bytes, no_gpu: bool, no_float16: bool = False) -> bool:
    match = _LOG_LINE.match(line)
    if match and no_gpu and _NO_GPU_NOTE in line:
        return True  # at every quieting level: the INFO line "Could not find cuda drivers" said it already
    if match and no_float16 and _NO_ONEDNN_FLOAT16_NOTE in line:
        return True  # float16_note() says it at INFO
    return bool(match and match.group(1) in severities) or line.startswith(_NOTES)


@contextlib.contextmanager
def _filtered_stderr(severities: bytes, no_gpu: bool, no_float16: bool = False) -> Iterator[None]:
    """Sends file descriptor 2 to a temporary file for the block, then writes back every line but the hidden ones."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured if not _hidden(line, severities, no_gpu, no_float16))
            if kept:
                with os.fdopen(os.dup(2), "wb") as stderr:
                    stderr.write(kept)
