"""EAGLE-1 / EAGLE-3 proposer: a one-layer head over the target's hidden states.

Owns: the head, its one-layer KV cache (same block ids as the target), and the drafting loop.
The head at position t consumes (next token x_{t+1}, target feature at t), so its KV stays exactly
in step with the target's: after each step it covers the positions whose target state is valid.

Per step, pass 1 and one pass per draft position of the deepest request (see ``proposer``):
  pass 1   every scheduled request runs its valid positions [nc, nc + num_valid) with the tokens
           one to the right and this step's target features (EAGLE-3: three aux layers fused by
           fc); the last position of each drafting request drafts token 1. A request that does
           not draft keeps the raw features of its new positions instead (`Waiting`) and feeds
           them, with the tokens, when it drafts again (``proposer``: deferred catch-up).
  pass j   each request that wants a j-th draft feeds (draft j-1, the head's own previous hidden
           state) at the next position and drafts token j.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from phalanx.attention.torch_paged import cache_block_size
from phalanx.config import ModelConfig
from phalanx.models.eagle import Eagle3Head, load_eagle_head
from phalanx.models.llama import CausalLM
from phalanx.ops import cpu as cpu_ops
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.spec_decode.proposer import (
    DrafterPass,
    Feed,
    ProposeBatch,
    chain_grid,
    chain_rest,
    draft_rest,
    drafter_pass,
    drafter_room,
    feed_range,
    max_lag,
    pass_size,
    plan_passes,
    uniform_grid,
)

# Up to this many requests' waiting rows are copied slice by slice, more in one gather (`_wait`).
SLICED_WAITS = 2


class Chunk(NamedTuple):
    """One step's waiting positions of one request: rows [a, b) of `source`, the step's target
    features themselves (EAGLE-3: its three aux tensors) where the positions that wait make up at
    least half of the step's rows, else a copy of just its rows (so a step's tensors stay alive
    for a wait only where the wait holds most of them)."""

    source: tuple[torch.Tensor, ...]
    a: int
    b: int

    def raw(self) -> torch.Tensor:  # [b - a, F] the features before the head's fc
        if len(self.source) == 1:
            return self.source[0][self.a : self.b]
        return torch.cat([t[self.a : self.b] for t in self.source], dim=-1)


class Waiting(NamedTuple):
    """A request's positions not yet fed to the head: from `start` on, with their raw target
    features, one chunk per step (fc runs only when they are fed)."""

    start: int
    chunks: list[Chunk]

    @property
    def num_positions(self) -> int:
        return sum(c.b - c.a for c in self.chunks)


class EagleProposer:
    needs_target_hidden = True

    def __init__(self, spec: SpeculativeConfig, target_model: torch.nn.Module, target_cfg: ModelConfig) -> None:
        assert spec.model is not None and isinstance(target_model, CausalLM)
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.num_lookahead_slots = spec.num_speculative_tokens
        self.room = drafter_room(spec, target_cfg)
        self.head = load_eagle_head(spec.model, spec.method, target_model)
        self.is_eagle3 = isinstance(self.head, Eagle3Head)
        self.aux_layer_ids: tuple[int, ...] = self.head.aux_layer_ids if isinstance(self.head, Eagle3Head) else ()
        # a waiting position keeps its raw features: the target's hidden state (EAGLE-3: one per aux layer)
        row_bytes = max(len(self.aux_layer_ids), 1) * target_cfg.hidden_size * target_cfg.dtype.itemsize
        self.max_lag = max_lag(row_bytes)  # the longest wait (``proposer``)
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 16
        self.passes_run = 0
        self.rows_fed = 0
        self.pass_rows = 0
        self._waiting: dict[str, Waiting] = {}

    def kv_cache_spec(self) -> list[tuple[int, int]]:
        cfg = self.head.config
        return [(cfg.num_kv_heads, cfg.head_dim)] * len(self.head.layers)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.block_size = cache_block_size(kv_caches[0])

    def start_request(self, req_id: str, num_computed: int) -> None:
        self._waiting.pop(req_id, None)  # the head's progress is the target's num_computed

    def finish_request(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)

    def drafter_kv_ends(self) -> dict[str, int]:
        return {r: w.start for r, w in self._waiting.items()}

    def _run(self, p: DrafterPass, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if p.num_pad:  # padding rows carry zero features
            hidden = torch.cat([hidden, hidden.new_zeros(p.num_pad, hidden.shape[1])])
        return self.head(p.input_ids, hidden, self.kv_caches, p.meta)

    def _chains(self, batch: ProposeBatch) -> bool:
        """Drafting passes go through the C++ chain (``draft_chain`` of the head, bitwise the
        pass-by-pass path): a one-layer head on the fused kernels and no lockstep padding (DP
        lockstep pads every pass to the voted size: the pass-by-pass path)."""
        return (
            batch.pass_sizes is None
            and self.head.chain_form() is not None
            and cpu_ops.kernel_for(self.head.config.dtype) is not None
        )

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        assert batch.target_hidden is not None
        self.passes_run = 0
        self.rows_fed = 0
        self.pass_rows = 0
        k = self.num_speculative_tokens
        may_defer = batch.pass_sizes is None
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        feeds: list[Feed] = []
        fed_rows: list[int] = []  # target rows of this step's positions fed now, in feed order
        kept: list[Waiting | None] = []  # per feed: the positions it waited with (fed first)
        num_waiting = 0  # positions that wait
        wait_spans: list[tuple[str, int, int, int]] = []  # (request, first waiting position, first row, rows)
        drafting: list[int] = []  # indices into feeds of requests that get drafts
        room, lag = self.room - k, self.max_lag
        for i, (req_id, nc, nv, wanted, prompt_len, row) in enumerate(zip(
                batch.req_ids, batch.num_computed, batch.num_valid, batch.num_drafts, batch.prompt_lens,
                batch.token_offsets)):
            if nv == 0 or nc + nv > room:
                continue
            waiting = self._waiting.get(req_id)
            start, end = (nc if waiting is None else waiting.start), nc + nv
            upto = feed_range(start, end, prompt_len, wanted > 0, may_defer, lag)
            off = row - nc  # target row of position p: off + p
            if upto > start:
                # position t consumes token t + 1: positions [start, upto) <- tokens [start + 1, upto + 1)
                feeds.append(Feed(i, batch.token_ids[i][start + 1 : upto + 1], start))
                fed_rows.extend(range(off + nc, off + upto))  # this step's; [start, nc) waited
                kept.append(self._waiting.pop(req_id, None))
                if wanted > 0:
                    drafting.append(len(feeds) - 1)
            if upto < end:
                num_waiting += end - max(upto, nc)
                wait_spans.append((req_id, upto, off + max(upto, nc), end - max(upto, nc)))
        if wait_spans:
            self._wait(batch, num_waiting, wait_spans)
        plan = plan_passes(batch, feeds, drafting, self._chains)
        self.passes_run, self.rows_fed, self.pass_rows = plan.passes, plan.rows_fed, plan.pass_rows
        if plan.passes == 0:
            return drafts
        drafting, passes, chains = plan.drafting, plan.passes, plan.chained
        raw = self._raw(batch, fed_rows)
        if any(w is not None for w in kept):  # each caught-up request's waiting rows go first
            pieces, at = [], 0
            for f, w in zip(feeds, kept):
                n = len(f.token_ids)  # positions fed: the waiting ones, then this step's
                if w is not None:
                    pieces.extend(c.raw() for c in w.chunks)
                    n -= w.num_positions
                pieces.append(raw[at : at + n])
                at += n
            raw = torch.cat(pieces)
        features = self._fuse(raw)
        q = uniform_grid(feeds, drafting)
        if chains and q:  # all k passes in one C++ call: the [R, q] grid, then one token each
            return chain_grid(batch, feeds, drafts, lambda ids, start, table: self.head.draft_chain(
                ids, features, start, q, table, self.block_size, passes, self.kv_caches[0]))
        # Pass 1: the verified positions with the target's features; drafts token 1.
        p = drafter_pass(feeds, batch, self.block_size, pass_size(batch, 0))
        with batch.pass_context(1):
            for_logits, feed = self._run(p, features)
        pick = torch.tensor([p.last_rows[f] for f in drafting], dtype=torch.int64)
        rows = [feeds[f].row for f in drafting]
        n = len(rows)
        feed = feed[pick]  # [n, H]
        tokens = self.head.draft_token_ids(for_logits[pick]) if n else pick  # [n] draft 1
        positions = torch.tensor([feeds[f].start + len(feeds[f].token_ids) for f in drafting], dtype=torch.int64)

        # Passes 2..: (draft j-1, the head's own hidden state) at the next position; drafts token j.
        if chains and n and passes > 1:  # all of them in one C++ call
            return chain_rest(batch, drafts, rows, tokens, lambda table: self.head.draft_chain(
                tokens, feed, positions, 1, table, self.block_size, passes - 1, self.kv_caches[0]))

        def forward(p: DrafterPass, num_real: int) -> torch.Tensor:
            nonlocal feed
            for_logits, fed = self._run(p, feed[:num_real])
            feed = fed[:num_real]
            return for_logits

        return draft_rest(batch, drafts, rows, tokens, positions, self.block_size, passes, forward,
                          self.head.draft_token_ids)

    def _raw(self, batch: ProposeBatch, rows: list[int]) -> torch.Tensor:  # [len(rows), F]
        """The target's features at these rows, before the head's fc: EAGLE-3 its three aux layers
        side by side (F = 3 H), EAGLE-1 its final hidden state (F = H)."""
        index = torch.tensor(rows, dtype=torch.int64)
        if self.is_eagle3:
            return torch.cat([a[index] for a in batch.target_aux], dim=-1)
        assert batch.target_hidden is not None
        return batch.target_hidden[index]

    def _fuse(self, raw: torch.Tensor) -> torch.Tensor:  # [n, F] -> [n, H] the head's input features
        return self.head.fc(raw) if self.is_eagle3 else raw

    def _wait(self, batch: ProposeBatch, num_rows: int, spans: list[tuple[str, int, int, int]]) -> None:
        """Keep the raw features of the positions that wait, per request (`spans`: request, its first
        waiting position, its first row in the step's features, rows; `num_rows` in all). Where they
        are at least half of the step's rows the chunks are views of the step's own tensors (no
        copy: at low load, where most requests wait, copying cost more than the rest of the
        proposer's step); else copies of just those rows: for one or two requests a copy of each
        one's slice (~3 us a request on the demo's head, ~7 on SmolLM2's EAGLE-3), for more one
        gather of them all (~6-13 us, and ~2 us a request more)."""
        assert batch.target_hidden is not None
        step = tuple(batch.target_aux) if self.is_eagle3 else (batch.target_hidden,)
        gathered: torch.Tensor | None = None
        if 2 * num_rows < step[0].shape[0] and len(spans) > SLICED_WAITS:
            gathered = self._raw(batch, [r for _, _, row, n in spans for r in range(row, row + n)])
        at = 0
        for req_id, first, row, n in spans:
            waiting = self._waiting.get(req_id)
            if waiting is None:
                waiting = self._waiting[req_id] = Waiting(first, [])
            if gathered is not None:
                waiting.chunks.append(Chunk((gathered,), at, at + n))
                at += n
            elif 2 * num_rows >= step[0].shape[0]:
                waiting.chunks.append(Chunk(step, row, row + n))
            else:
                waiting.chunks.append(Chunk(tuple(t[row : row + n].clone() for t in step), 0, n))
