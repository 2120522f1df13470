"""RMSNorm, computed in float32 like Hugging Face's reference so fp32 parity is exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        # Same numerics as HF (normalise in float32, round to the input dtype, then scale), with
        # the normalisation as one fused op: F.rms_norm without weight is bit-identical in fp32.
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)
