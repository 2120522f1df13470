"""Pre-packed bf16 linear layers for the CPU hot path.

Owns: `PackedLinear` (a linear whose weight lives in oneDNN's blocked layout, packed once at load)
and `prepack_linears`, which swaps a loaded module tree's bf16 `nn.Linear`s for it.
Does not own: loading weights (the models pack after `load_weights`) or fp32 models (left as they
are: their matmuls go through MKL, and packing them would change the fp32 parity paths).

Why: `F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it re-lays out on
every call. Packing once (what vLLM's CPU backend and inductor do) gives bitwise the same results
and is 1.5-3x faster for the few-row matmuls of decode and drafting, ~1.1-1.3x at 32 rows
(measured on this 2-core AVX-512-BF16 machine: the 40M model's 32000x512 lm_head, 1 row, 1.72 ms ->
0.53 ms; its 2816x512 gate/up, 86 -> 42 us). The dense weight is dropped after packing, so the
packed model takes no more memory than the plain one (a tied lm_head keeps its embedding).
"""

from __future__ import annotations

import torch
from torch import nn


def prepack_supported(dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose PyTorch build has oneDNN."""
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W pre-packed by oneDNN (`_reorder_linear_weight`); any leading dims."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(module: nn.Module) -> int:
    """Replace every bf16 `nn.Linear` under `module` by a `PackedLinear` (call after loading
    weights; nothing may read those layers' `.weight` afterwards). Returns how many were packed."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and prepack_supported(child.weight.dtype):
                setattr(parent, name, PackedLinear.from_linear(child))
                count += 1
    return count
