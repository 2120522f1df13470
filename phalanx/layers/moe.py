"""Sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE routing).

Owns: the router (softmax in float32, top-k, optional renormalisation), the stacked expert
weights, the optional shared expert, and an `ExpertExchange` hook through which expert-parallel
execution replaces the local computation. Does not own: how tokens move between ranks
(``phalanx.distributed``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.layers.linear import PackedLinear, empty_linear, prepack_supported


class ExpertExchange(Protocol):
    """Runs the routed experts for a batch, possibly across ranks (expert parallelism)."""

    def __call__(
        self, moe: SparseMoE, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor: ...


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.intermediate_size = intermediate_size
        self.gate = empty_linear(hidden_size, num_experts)
        # Experts [first, last) computed by this rank; all of them unless expert-parallel.
        self.expert_range = (0, num_experts)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size:
            from phalanx.layers.mlp import GatedMLP

            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = empty_linear(hidden_size, 1)
        self.exchange: ExpertExchange | None = None
        # bf16 on CPU: per-expert (w13, w2) packed once loaded (`prepack`)
        self.packed_experts: list[tuple[PackedLinear, PackedLinear]] | None = None

    def prepack(self, isa: int | None = None) -> None:
        """Pack this rank's expert weights for the bf16 GEMM (after loading; ``layers.linear``: the
        experts are linears like any other, batch-invariant on the kernels' GEMM). The stacked dense
        tensors are dropped: the packed experts are the only copy."""
        if prepack_supported(self.w13.dtype, isa):
            self.packed_experts = [(PackedLinear(a, None, isa), PackedLinear(b, None, isa))
                                   for a, b in zip(self.w13, self.w2)]
            self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def shard(self, first: int, last: int) -> None:
        """Keep only experts [first, last) (expert parallelism); call before loading weights."""
        self.expert_range = (first, last)
        n = last - first
        self.w13 = nn.Parameter(torch.empty(n, *self.w13.shape[1:], dtype=self.w13.dtype))
        self.w2 = nn.Parameter(torch.empty(n, *self.w2.shape[1:], dtype=self.w2.dtype))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H] -> top_ids [T, k] int64, top_weights [T, k] float32
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_ids, top_w

    def experts_forward(
        self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor:
        """Contribution of this rank's experts ([first, last)) to every token of x. [T, H]"""
        out = torch.zeros_like(x)
        first, last = self.expert_range
        for e in torch.unique(top_ids).tolist():
            if not first <= e < last:
                continue
            tok, slot = torch.where(top_ids == e)
            if self.packed_experts is not None:
                up_proj, down_proj = self.packed_experts[e - first]
                gate, up = up_proj(x[tok]).chunk(2, dim=-1)
                h = down_proj(F.silu(gate) * up)
            else:
                gate, up = F.linear(x[tok], self.w13[e - first]).chunk(2, dim=-1)
                h = F.linear(F.silu(gate) * up, self.w2[e - first])
            out.index_add_(0, tok, (h * top_weights[tok, slot, None]).to(x.dtype))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        top_ids, top_w = self.route(x)
        if self.exchange is not None:
            out = self.exchange(self, x, top_ids, top_w)
        else:
            out = self.experts_forward(x, top_ids, top_w)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
