"""The data tests' file writers (data_files.py), loaded by path and registered so that test files can
`import data_files`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _load_data_files():
    spec = importlib.util.spec_from_file_location("data_files", Path(__file__).with_name("data_files.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sys.modules.setdefault("data_files", module)


_load_data_files()
