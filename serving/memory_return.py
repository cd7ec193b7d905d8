"""Gives memory the server freed back to the system, so that a burst of large or hostile requests does not
leave the process holding it.

glibc keeps freed heap memory in its arenas for reuse instead of returning it: four 1 GiB-in-1 MB gzip
Predicts, refused RESOURCE_EXHAUSTED at gRPC's receive limit, left RSS 67 MB above where it was, for good
(issue 31 #4). malloc_trim(0) returns it (+65 MB to +1 MB within one interval, measured on a 2-vCPU
Intel Xeon). It walks the arenas under their locks, so it runs only where RSS grew by GROWTH_BYTES above the
lowest seen, checked every INTERVAL_S on its own thread (MemoryReturner). Without glibc (musl, macOS) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

INTERVAL_S = 2.0
MAX_INTERVAL_S = 64.0  # an unhelpful trim is retried at doubling intervals up to this
GROWTH_BYTES = 16 * 2**20
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's RSS (/proc/self/statm); 0 where there is none."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim() -> "ctypes._CFuncPtr | None":
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


def trim_now() -> None:
    """Returns the heap's free memory to the system once, now (a caller that has just let large objects go)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class MemoryReturner:
    """A daemon thread that trims glibc's heap after RSS grew; stop() ends it.

    It trims when RSS is GROWTH_BYTES above the lowest it has seen. A trim while the memory is still in use (a
    burst of requests in flight) gives little back; the memory freed after it would then stay held (a test saw
    +70 MB kept), so an unhelpful trim is tried again, at doubling intervals up to MAX_INTERVAL_S; one unhelpful
    at that interval means the working set itself grew (a version loaded), which becomes the new low."""

    def __init__(self, interval_s: float = INTERVAL_S, growth_bytes: int = GROWTH_BYTES, trim=None,
                 resident=resident_bytes) -> None:
        self._trim = trim or _malloc_trim()
        self._resident = resident
        self._interval_s, self._growth_bytes = interval_s, growth_bytes
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.low = 0
        self.wait_s = interval_s

    def start(self) -> "MemoryReturner":
        if self._trim is not None and self._resident():
            self.low = self._resident()
            self._thread = threading.Thread(target=self._run, name="memory-return", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.wait_s):
            self.check()

    def check(self) -> None:
        """One look at RSS: trim if it grew, and set when to look next (wait_s)."""
        now = self._resident()
        if now - self.low < self._growth_bytes:
            self.low, self.wait_s = min(self.low, now), self._interval_s
            return
        self._trim(0)
        after = self._resident()
        if now - after >= self._growth_bytes or after - self.low < self._growth_bytes:  # it gave memory back
            self.low, self.wait_s = min(self.low, after), self._interval_s
        elif self.wait_s >= MAX_INTERVAL_S:
            self.low, self.wait_s = after, self._interval_s
        else:
            self.wait_s = min(2 * self.wait_s, MAX_INTERVAL_S)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
