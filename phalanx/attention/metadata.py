"""Attention metadata for one flattened, unpadded batch of mixed prefill / decode requests.

Owns: `AttentionMetadata` and `build_attention_metadata`, the vectorised translation of
(per-request query lengths, context lengths, block tables) into what the attention backend needs.
Does not own: the attention math (``attention.torch_paged``) or the KV tensors.

Layout. The batch is one flat token sequence, request after request:
    q_lens [2, 1, 3], num_computed [0, 5, 8]  ->  tokens [a0 a1 | b5 | c8 c9 c10]
    positions [0, 1, 5, 8, 9, 10],   slot of a token = block_table[req, pos // B] * B + pos % B.
Requests with short queries (decodes, draft verification, short chunks) form the *decode group*:
one padded [num_dec, max_q] query grid over their gathered blocks, one SDPA call for all of them.
Longer queries (prefill chunks) form the *prefill group*: one attention call each (the C++ kernel
over the paged cache, or SDPA on the reference path), no padding to the longest request.
Padding (data-parallel lockstep pads every rank to the agreed batch size): `num_pad` extra tokens
follow the real ones as one pseudo-request that attends only to itself and writes no KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

# A query this short goes into the padded decode group (covers decode + up to 15 drafts).
DECODE_GROUP_MAX_QUERY = 16


@dataclass
class PrefillSeq:
    start: int  # first token of this request in the flat batch
    end: int
    num_computed: int  # tokens already in the cache before this chunk
    # [1, num_blocks] covering num_computed + q_len; None for lockstep padding (which has no cache)
    block_ids: torch.Tensor | None
    visible: torch.Tensor | None = None  # [1, q_len] int64: keys each query attends (causal), as dec_visible


class AttentionPlan(NamedTuple):
    """The attention grouping as ``ops.cpu.fused_layer`` takes it (its last eight arguments, in order):
    the decode group's [Bd, Qd] grid — its block table and visible counts, and, unless the flat batch
    is that grid (gather is None), the flat rows gathered into it (padded), the grid entries that are
    real and the flat rows they land on — then each prefill chunk's [start, end) bounds (flattened),
    block table and visible counts."""

    dec_table: torch.Tensor | None
    dec_visible: torch.Tensor | None
    gather: torch.Tensor | None  # [Bd * Qd] flat rows
    real: torch.Tensor | None  # grid entries that are real queries
    real_rows: torch.Tensor | None  # their flat rows
    prefill_bounds: list[int]
    prefill_tables: list[torch.Tensor]
    prefill_visible: list[torch.Tensor]


@dataclass
class ForwardMemo:
    """What every layer of one forward shares, built by the first layer that needs it: one field per
    thing, each keyed (where it needs a key) by the objects it was built for."""

    fused_plan: AttentionPlan | None = None  # `AttentionMetadata.fused_plan`, once `fused_plan_built`
    fused_plan_built: bool = False
    # the reference decode group's [Bd, Qd, 1, L] mask (True = masked out)
    dec_mask: torch.Tensor | None = None
    # (dtype, device type) -> the C++ ops module serving this forward's attention, or None
    attention_kernels: dict[tuple[torch.dtype, str], Any] = field(default_factory=dict)
    # the GEMM path this forward's bf16 attention follows (``ops.cpu.gemm_isa``; 3: AMX tiles)
    attention_isa: int | None = None
    # (rotary module, dtype) -> its cos / sin rows [T, 1, D] at this batch's positions
    rotary_rows: dict[tuple[Any, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (block table, KV heads, cache blocks) -> the reference path's K / V gather index
    gather_index: dict[tuple[torch.Tensor, int, int], torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    num_tokens: int  # real + padding
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T_real] int64, where each real token's K/V is written
    # decode group (None when empty)
    dec_token_idx: torch.Tensor | None = None  # [Bd, Qd] int64 into the flat batch (padded with 0)
    dec_valid: torch.Tensor | None = None  # [Bd, Qd] bool
    dec_block_table: torch.Tensor | None = None  # [Bd, NBd] int64
    # [Bd, Qd] int64: how many keys each decode-group query attends (its position + 1, causal)
    dec_visible: torch.Tensor | None = None
    prefills: list[PrefillSeq] | None = None
    # Every request has the same short query length Q and there is no prefill or padding (pure
    # decode: Q = 1; every request verifying k drafts: Q = k + 1): the flat batch is already the
    # decode group's [R, Q] grid in order, so no gather or scatter is needed (dec_token_idx and
    # dec_valid stay None). 0 otherwise.
    uniform_decode_len: int = 0
    memo: ForwardMemo = field(default_factory=ForwardMemo)  # shared by all layers of the forward

    def fused_plan(self) -> AttentionPlan | None:
        """The attention grouping for ``ops.cpu.fused_layer``, for every batch without lockstep
        padding (its pseudo-request has no cache: the module path); None otherwise. A uniform batch
        is one [R, Q] grid and a lone prompt chunk the [1, q] grid of its rows (no gather). Built once
        per forward."""
        if self.memo.fused_plan_built:
            return self.memo.fused_plan
        plan = None
        prefills = self.prefills or []
        if all(seq.block_ids is not None and seq.visible is not None for seq in prefills):
            if self.uniform_decode_len:
                plan = AttentionPlan(self.dec_block_table, self.dec_visible, None, None, None, [], [], [])
            elif self.dec_token_idx is None and len(prefills) == 1 and prefills[0].end - prefills[0].start == self.num_tokens:
                plan = AttentionPlan(prefills[0].block_ids, prefills[0].visible, None, None, None, [], [], [])
            else:
                gather = real = None
                if self.dec_token_idx is not None:
                    assert self.dec_valid is not None
                    gather = self.dec_token_idx.reshape(-1)
                    real = torch.from_numpy(np.flatnonzero(self.dec_valid.numpy().reshape(-1)))
                plan = AttentionPlan(
                    self.dec_block_table,
                    self.dec_visible,
                    gather,
                    real,
                    None if gather is None else gather[real],
                    [b for seq in prefills for b in (seq.start, seq.end)],
                    [seq.block_ids for seq in prefills],  # type: ignore[misc]
                    [seq.visible for seq in prefills],  # type: ignore[misc]
                )
        self.memo.fused_plan, self.memo.fused_plan_built = plan, True
        return plan


IntArray = torch.Tensor | np.ndarray | Sequence[int]


def _np(x: IntArray) -> np.ndarray:
    """An int64 numpy view of a CPU tensor (no copy), or an int64 array of a list."""
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    return np.asarray(x, dtype=np.int64)


def build_attention_metadata(
    q_lens: IntArray,  # [R] query tokens per request
    num_computed: IntArray,  # [R] tokens already cached per request
    block_table: torch.Tensor | np.ndarray,  # [R, max_blocks] int64 (rows padded with 0)
    block_size: int,
    num_pad: int = 0,
) -> AttentionMetadata:
    """Index arithmetic in numpy (a small-array op costs ~1 us there against ~4 us as a torch op,
    and a step builds a dozen of them); the results are int64 torch tensors sharing its memory."""
    q_np, nc_np = _np(q_lens), _np(num_computed)
    table_np = _np(block_table)
    table = torch.from_numpy(table_np)
    num_reqs = q_np.shape[0]
    if num_pad == 0 and num_reqs > 0:
        q0 = int(q_np[0])
        if q0 <= DECODE_GROUP_MAX_QUERY and (q_np == q0).all():
            return _uniform_metadata(q0, nc_np, table, table_np, block_size)
    total = int(q_np.sum())
    starts = np.cumsum(q_np) - q_np  # [R] first flat index of each request
    req_of_token = np.repeat(np.arange(num_reqs), q_np)  # [T]
    # [a0 a1 | b5 | c8 c9 c10] -> positions [0, 1, 5, 8, 9, 10]
    positions = np.arange(total) - starts[req_of_token] + nc_np[req_of_token]
    slot_mapping = table_np[req_of_token, positions // block_size] * block_size + positions % block_size
    if num_pad:
        positions = np.concatenate([positions, np.arange(num_pad)])
    meta = AttentionMetadata(
        num_tokens=total + num_pad, positions=torch.from_numpy(positions), slot_mapping=torch.from_numpy(slot_mapping)
    )

    is_dec = q_np <= DECODE_GROUP_MAX_QUERY
    dec_rows = np.flatnonzero(is_dec)
    if dec_rows.size:
        dq = q_np[dec_rows]
        max_q = int(dq.max())
        seq_lens = nc_np[dec_rows] + dq
        num_blocks = int((seq_lens.max() + block_size - 1) // block_size)
        offs = np.arange(max_q)
        valid = offs[None, :] < dq[:, None]
        meta.dec_valid = torch.from_numpy(valid)
        meta.dec_token_idx = torch.from_numpy(np.where(valid, starts[dec_rows][:, None] + offs[None, :], 0))
        meta.dec_block_table = table[torch.from_numpy(dec_rows), :num_blocks]
        # [Bd, Qd]; a padding entry of the grid sees one key only (its output is never read), so a
        # ragged group costs the attention of its real rows, not of the padded grid's
        meta.dec_visible = torch.from_numpy(np.where(valid, nc_np[dec_rows][:, None] + offs[None, :] + 1, 1))
    meta.prefills = []
    for r in np.flatnonzero(~is_dec).tolist():
        start, q, nc = int(starts[r]), int(q_np[r]), int(nc_np[r])
        nb = (nc + q + block_size - 1) // block_size
        visible = torch.arange(nc + 1, nc + q + 1)[None]
        meta.prefills.append(PrefillSeq(start, start + q, nc, table[r : r + 1, :nb], visible))
    if num_pad:
        meta.prefills.append(PrefillSeq(total, total + num_pad, 0, None))
    return meta


def _uniform_metadata(
    q: int, num_computed: np.ndarray, table: torch.Tensor, table_np: np.ndarray, block_size: int
) -> AttentionMetadata:
    """Every request has the same short query length q and there is no padding (pure decode; every
    request verifying k drafts; a drafter's one-token passes): the same metadata as the general
    path, built with a handful of ops, and the batch is the decode grid as it stands."""
    num_reqs = num_computed.shape[0]
    q_pos = num_computed[:, None] + np.arange(q)[None, :]  # [R, q]
    slot_mapping = table_np[np.arange(num_reqs)[:, None], q_pos // block_size] * block_size + q_pos % block_size
    num_blocks = (int(num_computed.max()) + q + block_size - 1) // block_size
    return AttentionMetadata(
        num_tokens=num_reqs * q,
        positions=torch.from_numpy(q_pos.reshape(-1)),
        slot_mapping=torch.from_numpy(slot_mapping.reshape(-1)),
        dec_block_table=table[:, :num_blocks],
        dec_visible=torch.from_numpy(q_pos + 1),
        prefills=[],
        uniform_decode_len=q,
    )
