"""RMSNorm, computed in float32 like Hugging Face's reference so fp32 parity is exact; bf16 models
use the fused C++ form when ``ops.cpu.attach`` gave them one (same rounding steps)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel: Any = None  # the compiled ops module (``ops.cpu.attach``), bf16 only

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        if self.kernel is not None:
            return self.kernel.rms_norm(x, self.weight, self.eps)
        # Same numerics as HF (normalise in float32, round to the input dtype, then scale), with
        # the normalisation as one fused op: F.rms_norm without weight is bit-identical in fp32.
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add of a decoder layer fused with the
        norm that follows it."""
        if self.kernel is not None:
            normed, total = self.kernel.add_rms_norm(x, residual, self.weight, self.eps)
            return normed, total
        total = x + residual
        return self(total), total
