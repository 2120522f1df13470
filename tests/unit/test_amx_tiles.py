"""The AMX tile configuration (csrc/amx_tiles.h) as the compiler emits it, checked on any x86-64
machine: compiled alone for an AMX target, the rows and column widths must reach LDTILECFG's operand.

GCC 12's `_tile_loadconfig` declares only the first 8 bytes of its operand as read, so the stores of
the rows and widths were removed as dead: LDTILECFG loaded zero-sized tiles and the first tile
instruction faulted (SIGILL) on every AMX CPU, while CPUs without AMX never ran that code."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"

PROBE = '#include "amx_tiles.h"\nvoid probe(const int (&rows)[8]) { phalanx::load_amx_tile_config(rows); }\n'


def _assembly(source: str) -> str:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 C++ compiler")
    run = subprocess.run([cxx, "-O3", "-march=sapphirerapids", f"-I{CSRC}", "-S", "-o", "-", "-x", "c++", "-"],
                         input=source, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        if "sapphirerapids" in run.stderr:
            pytest.skip(f"this compiler has no -march=sapphirerapids: {run.stderr.strip()[:200]}")
        raise AssertionError(run.stderr)
    return run.stdout


def _body_before_ldtilecfg(asm: str) -> str:
    start = asm.index("_Z5probeRA8_Ki:")
    end = asm.index("ldtilecfg", start)
    return asm[start:end]


def test_the_tile_rows_reach_ldtilecfg() -> None:
    """The probe reads its `rows` argument (x86-64: %rdi) before LDTILECFG; the faulty build read
    nothing and loaded a zeroed block with only its palette byte set."""
    body = _body_before_ldtilecfg(_assembly(PROBE))
    assert re.search(r"\(%rdi\)", body), f"the rows never reach the tile configuration:\n{body}"
