"""Giving the C heap's free memory back to the system (glibc's malloc_trim), for the device agents and the cloud.

An agent serves each HTTP request on a thread of its own, and the draft's tensors are allocated by whichever thread
runs the generation. glibc's malloc gives threads separate arenas (up to 8 per core), and memory freed in an arena
stays mapped to the process until it is trimmed: a long-running agent's RSS then climbs with every arena that held a
request's activations at its peak, although nothing is alive in them (measured: 40-95 MB above the live heap within
30 s on a host of 10 agents, and flat once trimmed; docs/SECURITY.md, "Memory"). `trim()` after each generation
returns those pages; it costs 0.3-13 ms against a request's seconds. The cloud's batched steps allocate from its loop
thread and torch's worker threads; it trims when its last session closes, and at most once per
CloudConfig.heap_trim_s while sessions stay open (cloud_runtime.server). Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Optional

_libc: Optional[ctypes.CDLL] = None
_looked = False


def _malloc_trim():
    global _libc, _looked
    if not _looked:
        _looked = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:
            _libc = None
    return _libc.malloc_trim if _libc is not None else None


def trim() -> float:
    """Release the heap's free pages to the system; returns the seconds it took (0.0 where there is no glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return 0.0
    t0 = time.perf_counter()
    fn(0)
    return time.perf_counter() - t0
