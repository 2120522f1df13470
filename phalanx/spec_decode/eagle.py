"""EAGLE-1 / EAGLE-3 proposer: a one-layer head over the target's hidden states.

Owns: the head, its one-layer KV cache (same block ids as the target), and the drafting loop.
The head at position t consumes (next token x_{t+1}, target feature at t), so its KV stays exactly
in step with the target's: after each step it covers the positions whose target state is valid.

Per step, exactly k forwards (see ``proposer``):
  pass 1   every scheduled request runs its valid positions [nc, nc + num_valid) with the tokens
           one to the right and this step's target features (EAGLE-3: three aux layers fused by
           fc); the last position of each sampled request drafts token 1.
  pass j   each sampled request feeds (draft j-1, the head's own previous hidden state) at the
           next position and drafts token j.
"""

from __future__ import annotations

import torch

from phalanx.attention.metadata import build_attention_metadata
from phalanx.config import ModelConfig
from phalanx.models.eagle import Eagle3Head, load_eagle_head
from phalanx.models.llama import CausalLM
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.spec_decode.proposer import ProposeBatch, drafter_room


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
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 16

    def kv_cache_spec(self) -> list[tuple[int, int]]:
        cfg = self.head.config
        return [(cfg.num_kv_heads, cfg.head_dim)]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0].shape[2]

    def start_request(self, req_id: str, num_computed: int) -> None:
        pass  # the head's progress is the target's num_computed

    def finish_request(self, req_id: str) -> None:
        pass

    def _run(
        self, rows: list[int], ids: list[list[int]], starts: list[int], hidden: torch.Tensor, block_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        q_lens = torch.tensor([len(x) for x in ids])
        meta = build_attention_metadata(q_lens, torch.tensor(starts), block_table[torch.tensor(rows)], self.block_size)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.int64)
        for_logits, feed = self.head(flat, hidden, self.kv_caches, meta)
        return for_logits, feed, (torch.cumsum(q_lens, 0) - 1).tolist()

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        assert batch.target_hidden is not None
        k = self.num_speculative_tokens
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        rows, ids, starts, hidden_rows, drafting = [], [], [], [], []
        for i in range(len(batch.req_ids)):
            nc, nv = batch.num_computed[i], batch.num_valid[i]
            tokens = batch.token_ids[i]
            if nv == 0 or nc + nv + k > self.room:
                continue
            # position t consumes token t + 1: [nc, nc + nv) -> tokens [nc + 1, nc + nv + 1)
            rows.append(i)
            ids.append(tokens[nc + 1 : nc + nv + 1])
            starts.append(nc)
            off = batch.token_offsets[i]
            hidden_rows.extend(range(off, off + nv))
            if batch.sampled[i]:
                drafting.append(len(rows) - 1)
        if not rows:
            return drafts
        index = torch.tensor(hidden_rows)
        if self.is_eagle3:
            assert isinstance(self.head, Eagle3Head)
            features = self.head.fuse([a[index] for a in batch.target_aux])
        else:
            features = batch.target_hidden[index]
        for_logits, feed, last = self._run(rows, ids, starts, features, batch.block_table)
        if not drafting:
            return drafts
        pick = torch.tensor([last[d] for d in drafting])
        tokens_j = self.head.draft_token_ids(for_logits[pick]).tolist()
        feed = feed[pick]
        d_rows = [rows[d] for d in drafting]
        positions = [starts[d] + len(ids[d]) for d in drafting]  # next position after pass 1
        for j in range(1, k + 1):
            for row, tok in zip(d_rows, tokens_j):
                drafts[row].append(tok)
            if j == k:
                break
            for_logits, feed, _ = self._run(
                d_rows, [[t] for t in tokens_j], [p + j - 1 for p in positions], feed, batch.block_table
            )
            tokens_j = self.head.draft_token_ids(for_logits).tolist()
        return drafts
