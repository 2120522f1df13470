"""Draft-model proposer: a small LM of any architecture phalanx loads, with its own paged KV cache.

Owns: the draft model, its KV tensors (same block ids as the target, so the scheduler's blocks
cover both), each request's drafter progress (`_computed`: tokens whose draft KV is valid), and the
drafting loop.

Per step, pass 1 and one pass per draft position of the deepest request (see ``proposer``):
  pass 1   every scheduled request catches its draft KV up to the tokens the target has now
           (drafting: all tokens including the new one; otherwise those with target state), up to
           the drafter's context length even for requests too long to draft, so that every prefix-cache
           block within that length carries draft KV; the last position of each drafting request
           that still has room for k drafts drafts token 1. A request that does not draft feeds
           only its prompt positions; the rest wait until it drafts again (``proposer``: deferred
           catch-up).
  pass j   each request that wants a j-th draft feeds draft j-1 at the next position and drafts
           token j.
Draft-pass KV past the real tokens is speculative; the next catch-up overwrites it.
"""

from __future__ import annotations

import torch

from phalanx.attention.torch_paged import cache_block_size
from phalanx.config import ModelConfig
from phalanx.distributed.expert_parallel import install_expert_parallel
from phalanx.distributed.group import DPGroup
from phalanx.models.llama import CausalLM
from phalanx.models.registry import load_model
from phalanx.ops import cpu as cpu_ops
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.spec_decode.proposer import (
    MAX_DRAFT_MODEL_LAG,
    DrafterPass,
    Feed,
    ProposeBatch,
    chain_grid,
    chain_rest,
    draft_rest,
    drafter_pass,
    drafter_room,
    feed_range,
    pass_size,
    plan_passes,
    uniform_grid,
)


class DraftModelProposer:
    needs_target_hidden = False
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        spec: SpeculativeConfig,
        target_model: torch.nn.Module,
        target_cfg: ModelConfig,
        expert_shard: tuple[int, int] | None = None,
        group: DPGroup | None = None,
    ) -> None:
        """`expert_shard` (rank, size) and `group`: the target's expert parallelism, which an MoE
        draft joins (it loads only this rank's experts, once); a dense draft ignores them."""
        assert spec.model is not None
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.num_lookahead_slots = spec.num_speculative_tokens
        self.room = drafter_room(spec, target_cfg)
        self.max_lag = MAX_DRAFT_MODEL_LAG  # the longest wait (``proposer``)
        cfg = ModelConfig.from_hf(spec.model, target_cfg.dtype, max(self.room, 2))
        self.config = cfg
        shard = expert_shard if cfg.is_moe else None
        if shard is not None and group is None:
            raise ValueError("an expert-parallel MoE draft needs the data-parallel group")
        self.model: CausalLM = load_model(cfg, shard)
        if shard is not None:
            assert group is not None
            install_expert_parallel(self.model, group)
        self.argmax = cpu_ops.argmax_fn(cfg.dtype)  # greedy drafts over model-dtype logits
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 16
        self._computed: dict[str, int] = {}
        self._behind: set[str] = set()  # requests whose catch-up waits (their `_computed` is short)
        self.passes_run = 0
        self.rows_fed = 0
        self.pass_rows = 0

    def kv_cache_spec(self) -> list[tuple[int, int]]:
        return [(self.config.num_kv_heads, self.config.head_dim)] * self.config.num_layers

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.block_size = cache_block_size(kv_caches[0])

    def start_request(self, req_id: str, num_computed: int) -> None:
        self._computed[req_id] = num_computed
        self._behind.discard(req_id)

    def finish_request(self, req_id: str) -> None:
        self._computed.pop(req_id, None)
        self._behind.discard(req_id)

    def drafter_kv_ends(self) -> dict[str, int]:
        return {r: self._computed[r] for r in self._behind}

    def _run(self, p: DrafterPass) -> torch.Tensor:  # -> hidden [T_real + pad, H]
        hidden, _ = self.model(p.input_ids, self.kv_caches, p.meta)
        return hidden

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n] token ids
        return self.argmax(self.model.compute_logits(hidden, float32=False))

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        self.passes_run = 0
        self.rows_fed = 0
        self.pass_rows = 0
        k = self.num_speculative_tokens
        may_defer = batch.pass_sizes is None
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        feeds: list[Feed] = []
        drafting: list[int] = []  # indices into feeds of requests that get drafts
        for i, req_id in enumerate(batch.req_ids):
            tokens = batch.token_ids[i]
            # Past the drafter's context no more drafts, but its KV is still filled up to the
            # context's end, so every cached block below it holds draft KV (a later request hitting
            # those blocks in the prefix cache drafts as well as if it had computed them itself).
            drafts_now = batch.num_drafts[i] > 0 and len(tokens) + k <= self.room
            end = len(tokens) if batch.num_drafts[i] > 0 else batch.num_computed[i] + batch.num_valid[i]
            end = min(end, self.room)
            start = self._computed.get(req_id, batch.num_computed[i])
            upto = feed_range(start, end, batch.prompt_lens[i], batch.num_drafts[i] > 0, may_defer, self.max_lag)
            if upto < end:
                self._behind.add(req_id)
            else:
                self._behind.discard(req_id)
            if upto > start:
                feeds.append(Feed(i, tokens[start:upto], start))
                self._computed[req_id] = upto
                if drafts_now:
                    drafting.append(len(feeds) - 1)
        plan = plan_passes(batch, feeds, drafting, self._chains)
        self.passes_run, self.rows_fed, self.pass_rows = plan.passes, plan.rows_fed, plan.pass_rows
        if plan.passes == 0:
            return drafts
        drafting, passes, chains = plan.drafting, plan.passes, plan.chained
        q = uniform_grid(feeds, drafting)
        if chains and q:  # all k passes in one C++ call (bitwise the same)
            return chain_grid(batch, feeds, drafts, lambda ids, start, table: self.model.draft_chain(
                ids, start, q, table, self.block_size, passes, self.kv_caches))
        # Pass 1: catch up; each drafting request's last position drafts token 1.
        p = drafter_pass(feeds, batch, self.block_size, pass_size(batch, 0))
        with batch.pass_context(1):
            hidden = self._run(p)
        rows = [feeds[f].row for f in drafting]
        n = len(rows)
        pick = torch.tensor([p.last_rows[f] for f in drafting], dtype=torch.int64)
        tokens = self._greedy(hidden[pick]) if n else pick  # [n] draft 1 (pick is empty when n == 0)
        positions = torch.tensor([len(batch.token_ids[r]) for r in rows], dtype=torch.int64)
        # Passes 2..: feed draft j-1 at the next position, draft token j.
        if chains and n and passes > 1:  # all of them in one C++ call
            return chain_rest(batch, drafts, rows, tokens, lambda table: self.model.draft_chain(
                tokens, positions, 1, table, self.block_size, passes - 1, self.kv_caches))
        return draft_rest(batch, drafts, rows, tokens, positions, self.block_size, passes,
                          lambda p, _num_real: self._run(p), self._greedy)

    def _chains(self, batch: ProposeBatch) -> bool:
        """Drafting passes go through the C++ chain (``CausalLM.draft_chain``, bitwise the
        pass-by-pass path): a dense draft model on the fused kernels and no lockstep padding."""
        return (
            batch.pass_sizes is None
            and self.model.chain_form() is not None
            and cpu_ops.kernel_for(self.config.dtype) is not None
        )
