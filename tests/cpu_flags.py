"""The CPU's feature flags as Linux reports them (``/proc/cpuinfo``), for tests whose expectations
depend on the instruction set (AMX, AVX512-BF16, AVX2): one reader for every such test."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (empty where /proc/cpuinfo cannot be read or has no flags line)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
