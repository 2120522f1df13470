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


@pytest.mark.parametrize("source", ["gemm.cpp", "attention.cpp"])
def test_the_amx_code_compiles_for_an_amx_target(source: str) -> None:
    """The GEMM's and the attention's AMX code calls the tile instructions through amx_tiles.h's
    `px_tile_*` names; a CPU without AMX builds that code only with the tiles emulated. A syntax-only
    compile for -march=sapphirerapids checks, on any x86-64 machine, that the hardware build still
    compiles, with its AMX code in (PHALANX_AMX) and not emulated."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 C++ compiler")
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in (str(CSRC), *include_paths(), sysconfig.get_paths()["include"])]
    probe = (f'#include "{source}"\n#if !PHALANX_AMX || defined(PHALANX_EMULATE_AMX)\n'
             '#error the AMX code is not in this build\n#endif\n')
    run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-fopenmp", "-march=sapphirerapids", *includes,
                          "-x", "c++", "-"], input=probe, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "sapphirerapids" in run.stderr:
        pytest.skip(f"this compiler has no -march=sapphirerapids: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr[-4000:]
