"""Pre-packed bf16 linear layers for the CPU hot path.

Owns: `PackedLinear` (a linear whose weight is packed once at load for the GEMM that serves it),
`prepack_linears`, which swaps a loaded module tree's bf16 `nn.Linear`s for it,
`PackedEmbedding` (a tied model's token lookup, reading the logits head's packed table), and
`empty_linear` / `empty_embedding` (the layers the served models are built from, left unfilled
until their weights load).
Does not own: the GEMM kernels (csrc/gemm.cpp, ``ops.cpu``), loading weights (the models pack after
`load_weights`) or fp32 models (left as they are: their matmuls go through MKL, and packing them
would change the fp32 parity paths).

Which GEMM (``ops.cpu.gemm_isa``, once per layer at load): by default the kernels' own bf16 GEMM
(AMX tiles where the CPU has them, else AVX512-BF16, else AVX2 + FMA), which sums every output in
one fixed order that does not depend on the number of rows in the call, so a request's logits are
bitwise the same alone or batched, chunked or whole, verified in a speculative step or decoded
plainly (csrc/gemm.cpp states the orders: the AMX tiles' differs from the other two paths').
Without those kernels (``PHALANX_KERNELS=torch``, no compiler, a CPU below AVX2) or with
``PHALANX_CPU_ISA=onednn``, oneDNN's packed linear serves (what vLLM's CPU backend uses): its kernel
and so its summation order change with the row count, and with the CPU (AMX tiles where present),
so bf16 results are not batch-invariant there. On a CPU where oneDNN cannot pack bf16 weights
(AVX2 without AVX512BW/VL/DQ) that path packs nothing: the layers stay `nn.Linear`.

Either way the weight exists once: the packed copy replaces the dense one. A tied model's embedding
and logits head share one table: on the kernels' GEMM the head packs it and the lookup reads the
packed pairs back (`PackedEmbedding`); on oneDNN's path (an opaque layout) the lookup keeps the
row-major table and the head packs a copy.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from phalanx.ops import cpu as cpu_ops


class _Unfilled:
    """Mixin: the layer's parameters are allocated (torch.empty) but `reset_parameters` does not fill
    them. Every model phalanx serves loads each weight from its checkpoint and fails on any it lacks,
    so PyTorch's random initialisation would only be overwritten (~0.9 s of SmolLM2-135M's load,
    seconds for a 1B model)."""

    def reset_parameters(self) -> None:
        pass


class _UnfilledLinear(_Unfilled, nn.Linear):
    pass


class _UnfilledEmbedding(_Unfilled, nn.Embedding):
    pass


def empty_linear(in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> nn.Linear:
    """An `nn.Linear` (a subclass: isinstance checks and state-dict names are nn.Linear's) whose
    parameters are left unfilled until its weights load (see `_Unfilled`)."""
    return _UnfilledLinear(in_features, out_features, bias=bias, dtype=dtype)


def empty_embedding(num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> nn.Embedding:
    """An `nn.Embedding` left unfilled until its weights load (see `_Unfilled`)."""
    return _UnfilledEmbedding(num_embeddings, embedding_dim, dtype=dtype)


@functools.cache
def onednn_bf16_supported() -> bool:
    """Whether oneDNN's bf16 packed linear runs on this CPU: PyTorch built with oneDNN, and a CPU with
    AVX512BW/VL/DQ or AVX-NE-CONVERT (on an AVX2-only CPU oneDNN refuses to pack bf16 weights)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_supported(dtype: torch.dtype, isa: int | None = None) -> bool:
    """bf16 with a GEMM to pack for on GEMM path `isa` (None: ``ops.cpu.gemm_isa()``): the kernels'
    GEMM (1, 2), or oneDNN's packed linear (0) where this CPU runs it. Otherwise the linears stay
    `nn.Linear` (PyTorch's own bf16 matmul)."""
    if dtype != torch.bfloat16:
        return False
    isa = cpu_ops.gemm_isa() if isa is None else isa
    return bool(isa) or onednn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once for its GEMM path `isa` (``ops.cpu.gemm_isa``): 3 / 2 / 1 the
    kernels' batch-invariant GEMM on AMX / AVX512-BF16 / AVX2 (W in `pack_pairs` layout for that
    path), 0 oneDNN's packed linear (W in oneDNN's blocked layout). Any leading dims."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.isa = cpu_ops.gemm_isa() if isa is None else isa
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._gemm = None
        if self.isa:
            module = cpu_ops.load(required=True)
            self.packed = module.pack_pairs(weight.detach(), self.isa)  # [ceil(N / 16), pairs, 16, 2]
            self._gemm = module.gemm
        elif onednn_bf16_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            raise RuntimeError(
                "PackedLinear: GEMM path 0 (oneDNN's packed bf16 linear) does not run on this CPU (it needs "
                "AVX512BW/VL/DQ or AVX-NE-CONVERT); valid paths here: "
                f"{cpu_ops.load().gemm_isas() if cpu_ops.kernel_for(torch.bfloat16) else []} "
                "(or leave the layer an nn.Linear: prepack_supported() says which)")

    @classmethod
    def from_linear(cls, linear: nn.Linear, isa: int | None = None) -> PackedLinear:
        return cls(linear.weight, linear.bias, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        if self._gemm is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.dim() == 2:
            return self._gemm(x, self.packed, self.out_features, self.bias, self.isa)
        y = self._gemm(x.reshape(-1, self.in_features), self.packed, self.out_features, self.bias, self.isa)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = {3: "amx", 2: "avx512_bf16", 1: "avx2", 0: "onednn"}.get(self.isa, str(self.isa))
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, gemm={path}")


def prepack_linears(module: nn.Module, isa: int | None = None) -> int:
    """Replace every bf16 `nn.Linear` under `module` by a `PackedLinear` (call after loading
    weights; nothing may read those layers' `.weight` afterwards), all on one GEMM path (`isa`;
    None: ``ops.cpu.gemm_isa()``). Returns how many were packed."""
    isa = cpu_ops.gemm_isa() if isa is None else isa
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and prepack_supported(child.weight.dtype, isa):
                setattr(parent, name, PackedLinear.from_linear(child, isa))
                count += 1
    return count


class PackedEmbedding(nn.Module):
    """The token lookup of a tied model whose logits head is a `PackedLinear` on the kernels' GEMM:
    it reads the head's packed table (``embedding_rows``: each row's pairs gathered back, the same
    bf16 values as the row-major table), so the [V, H] table is held once. Takes what `nn.Embedding`
    takes (integer ids of any shape) and returns [..., H]."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        if not head.isa:
            raise ValueError("PackedEmbedding needs a head packed for the kernels' GEMM (isa 1, 2 or 3), "
                             f"got isa {head.isa} (oneDNN's layout cannot be read back)")
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self._head = (head,)  # not a submodule: the logits head owns the table
        self._rows = cpu_ops.load(required=True).embedding_rows

    @property
    def table(self) -> torch.Tensor:
        """The packed table (`pack_pairs` layout), for the kernels that look rows up themselves."""
        return self._head[0].packed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self._rows(self.table, input_ids.reshape(-1).long(), self.embedding_dim, self.num_embeddings)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed=True"
