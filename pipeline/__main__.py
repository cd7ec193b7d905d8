"""`python -m pipeline`: quiets TensorFlow's C++ log unless the user chose its level, then runs the CLI.

TensorFlow writes ~10 lines of C++ log to stderr before and while a command runs (no CUDA drivers,
`failed call to cuInit`, oneDNN's float16 fallback, the CPU instructions it was built for); a newcomer
reads them as failures. Unless TF_CPP_MIN_LOG_LEVEL is set, it is set to 3 (TensorFlow's C++ log off)
before TensorFlow is imported, which the processes this one starts inherit. That level does not reach
the lines TensorFlow's libraries print while they load (docs/keras3-mixed-precision.md §8), so the
first `import tensorflow`, wherever it happens, runs with those lines filtered out of stderr. Setting
TF_CPP_MIN_LOG_LEVEL yourself (0 shows everything) leaves both alone. What the hidden lines said about
float16 and bfloat16 support, the CLI says once in its own words (pipeline/cli.py, precision_support).
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

from pipeline.cli import main

# absl's C++ log lines ("I0000 00:00:1795465277.088969    5657 port.cc:153] ..."), the banner absl prints before
# the first of them, and the continuation of cpu_feature_guard's line. Fatal ("F") lines are kept.
_LOAD_LINE = re.compile(rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
                        rb"|[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] |To enable the following instructions:)")


def quiet_tensorflow(environ: os._Environ | dict = os.environ) -> bool:
    """Turns TensorFlow's C++ log off for this process and its children unless the user set its level;
    returns whether it did."""
    if "TF_CPP_MIN_LOG_LEVEL" in environ:
        return False
    environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.meta_path.insert(0, _FilteredFirstImport())
    return True


class _FilteredFirstImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` with a loader that runs its import while stderr is filtered; gone once it ran."""

    def __init__(self):
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
        with _load_lines_filtered():
            self.loader.exec_module(module)


@contextlib.contextmanager
def _load_lines_filtered() -> Iterator[None]:
    """Sends file descriptor 2 to a temporary file for the block, then writes back every line but _LOAD_LINE's
    (a traceback or a Python warning printed meanwhile comes through, after the block)."""
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
            kept = b"".join(line for line in captured if not _LOAD_LINE.match(line))
            if kept:
                with os.fdopen(os.dup(2), "wb") as stderr:
                    stderr.write(kept)


if __name__ == "__main__":
    quiet_tensorflow()
    sys.exit(main())
