"""What machine the numbers came from: CPU model, cores, the flags that decide precision, TF, GPU."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

MEASURED = "measured per model"  # machine_info's auto_policy where auto times its candidates
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile",
                  "f16c", "fma")


def machine_info() -> dict:
    """Recorded in every result file; also what the Markdown header names."""
    import tensorflow as tf
    from pipeline import precision

    hardware = precision.detect_hardware()
    policy, reason = precision.choose_policy(hardware)
    if precision.measurement_decides(hardware):  # the flags do not decide here: auto times each model's candidates
        policy, reason = MEASURED, (f"{reason}, where auto times {' and '.join(precision.TRAIN_CANDIDATES)} train "
                                    "steps of each model and keeps the faster")
    return {
        "hostname": socket.gethostname(),
        "cpu_model": hardware.cpu_model or platform.processor() or "unknown",
        "cpu_cores": os.cpu_count(),
        "cpu_flags": sorted(flag for flag in RELEVANT_FLAGS if flag in hardware.cpu_flags),
        "gpus": [{"name": name, "compute_capability": list(cc) if cc else None} for name, cc in hardware.gpus],
        "auto_policy": policy,
        "auto_policy_reason": reason,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "platform": platform.platform(),
    }


def _memory_gib() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.virtual_memory().total / 2**30, 1)


def peak_rss_mib(pid: int | None = None) -> float | None:
    """Peak resident memory (VmHWM) of a process, in MiB; None where /proc has no such field."""
    return _status_mib(pid, "VmHWM")


def rss_mib(pid: int | None = None) -> float | None:
    """Resident memory now (VmRSS) of a process, in MiB; None where /proc has no such field."""
    return _status_mib(pid, "VmRSS")


def _status_mib(pid: int | None, field: str) -> float | None:
    path = Path(f"/proc/{pid or 'self'}/status")
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a process has used so far, in seconds; None where /proc has no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
