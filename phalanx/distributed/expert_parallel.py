"""Expert parallelism across the data-parallel ranks (correct first, simple on CPU).

Owns: which experts a rank holds (`expert_range`), and `EPExchange`, the MoE hook that runs the
routed experts for every rank's tokens: all-gather every rank's (equally padded) hidden states and
routing, compute this rank's experts' contribution for all of them, all-reduce the sums, keep this
rank's rows. A rank with zero real tokens still takes part with its padding (DESIGN §5 rule 8).
Does not own: the padded size (the vote decides it) or the router (``layers.moe``).
"""

from __future__ import annotations

import torch

from phalanx.distributed.group import DPGroup
from phalanx.layers.moe import SparseMoE


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous, as even as possible: 8 experts on 3 ranks -> [0, 3), [3, 6), [6, 8)."""
    base, extra = divmod(num_experts, size)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0)


class EPExchange:
    def __init__(self, group: DPGroup, layer_id: int) -> None:
        self.group = group
        self.layer_id = layer_id

    def __call__(
        self, moe: SparseMoE, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor:  # x [T, H] with T the agreed padded size on every rank -> [T, H]
        t = x.shape[0]
        site = f"moe layer {self.layer_id}"
        self.group.check_agreed(t, site)
        all_x = self.group.all_gather(x, f"{site} hidden")  # [dp * T, H]
        all_ids = self.group.all_gather(top_ids, f"{site} expert ids")  # [dp * T, k]
        all_w = self.group.all_gather(top_weights, f"{site} expert weights")  # [dp * T, k]
        partial = moe.experts_forward(all_x, all_ids, all_w)  # this rank's experts only
        total = self.group.all_reduce_sum(partial, f"{site} combine")
        rank = self.group.rank
        return total[rank * t : (rank + 1) * t]


def install_expert_parallel(model: torch.nn.Module, group: DPGroup) -> None:
    """Point every MoE layer of an (already sharded) model at the exchange."""
    for i, module in enumerate(m for m in model.modules() if isinstance(m, SparseMoE)):
        module.exchange = EPExchange(group, i)
