"""The CPU's model name and instruction-set flags as Linux lists them (/proc/cpuinfo): the one reader, for the
TensorFlow log filter (serving/tf_log.py), precision's `auto` (pipeline/precision.py) and the bench's machine record."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_info(cpuinfo: Path = CPUINFO) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU listed; ("", frozenset()) where there is no /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        if line.startswith("model name") and not model:
            model = line.partition(":")[2].strip()
        elif line.startswith("flags"):
            flags = frozenset(line.partition(":")[2].split())
            break
    return model, flags
