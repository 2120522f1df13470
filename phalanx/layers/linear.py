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
packed model takes no more memory than the plain one (a tied lm_head keeps its embedding), except
that layers of at most 2 MiB keep a second packed copy for few-row calls (`pair_linear`).
"""

from __future__ import annotations

import torch
from torch import nn


def prepack_supported(dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose PyTorch build has oneDNN."""
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


# Few-row calls (decode, verification, drafting) of bias-free layers with at most this much weight go
# to the C++ `pair_linear` (ops.cpu): oneDNN spends a fixed ~18 us per call at 1-4 rows, most of a
# small layer's time (the demo model's 512 x 256 qkv: 19 -> 4 us, 1408 x 256 gate/up: 22 -> 10 us,
# 2 threads). Bigger weights stream from memory, where oneDNN is as fast or faster (at 2816 x 512
# they break even; the 40M model's 32000 x 512 lm_head is 2.5x faster on oneDNN), so they stay there.
# Every row is summed in oneDNN's one-row order (K in blocks of 512), so the kernel's result equals
# oneDNN's at one row, and at 2-4 rows when K <= 512. For K > 512 oneDNN's multi-row order differs from
# its own one-row order (measured: K = 1408 at 2-4 rows, the last bit of some outputs), so no choice
# keeps both; the kernel makes 1-4 rows agree with each other (a request verifying 3 drafts at c = 1
# gets bitwise the logits of plain decoding) and with oneDNN at one row.
PAIR_MAX_ROWS = 4
PAIR_MAX_WEIGHT_BYTES = 2 << 20


class PackedLinear(nn.Module):
    """y = x W^T + b with W pre-packed by oneDNN (`_reorder_linear_weight`); any leading dims.
    A small bias-free layer also keeps W packed for `pair_linear` and sends calls of up to
    `PAIR_MAX_ROWS` rows there: bitwise oneDNN's result at one row (and at 2-4 rows when K <= 512), and
    the same for every row count it serves (tests/unit/test_packed_linear.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.pairs: torch.Tensor | None = None  # W for pair_linear (small bias-free layers only)
        self._pair_linear = None
        if bias is None and weight.numel() * weight.element_size() <= PAIR_MAX_WEIGHT_BYTES:
            from phalanx.ops import cpu as cpu_ops

            module = cpu_ops.pair_linear_module()
            if module is not None:
                self.pairs = module.pack_pairs(weight.detach())
                self._pair_linear = module.pair_linear

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pair_linear is not None and x.dim() == 2 and x.shape[0] <= PAIR_MAX_ROWS and x.is_contiguous():
            return self._pair_linear(x, self.pairs, self.out_features)
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
