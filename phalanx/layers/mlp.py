"""Gated SiLU MLP with fused gate/up projection (Llama family)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.layers.linear import empty_linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_linear(hidden_size, 2 * intermediate_size)
        self.down_proj = empty_linear(intermediate_size, hidden_size)
        self.kernel: Any = None  # the compiled ops module (``ops.cpu.attach``), bf16 only

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None and gate_up.dim() == 2:
            return self.down_proj(self.kernel.silu_mul(gate_up))  # the same roundings, one pass
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
