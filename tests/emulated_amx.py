"""The kernels' AMX code on a CPU without AMX: the build whose tiles are software
(``ops.cpu.build_emulated_amx``, csrc/amx_emulation.h), which the kernel and parity tests run AMX's
cases on where the CPU has AVX512-BF16 and AVX512BW but no AMX of its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from phalanx.ops import cpu as cpu_ops

AMX = cpu_ops.GEMM_ISAS["amx"]


def can_emulate_amx() -> bool:
    """Whether this CPU can run the emulated build and the kernels build at all (cheap: no build)."""
    return cpu_ops.kernel_for(torch.bfloat16) is not None and all(
        f in cpu_ops.cpu_flags() for f in cpu_ops.AMX_EMULATION_NEEDS)


def emulated_amx_module() -> Any:
    """The emulated build (built on first use, ~1 min), or the calling test skipped."""
    module = cpu_ops.emulated_amx()
    if module is None:
        pytest.skip("the emulated AMX build needs AVX512-BF16 and AVX512BW (and a compiler)")
    return module
