"""Draft-model proposer: a small LM of any architecture phalanx loads, with its own paged KV cache.

Owns: the draft model, its KV tensors (same block ids as the target, so the scheduler's blocks
cover both), each request's drafter progress (`_computed`: tokens whose draft KV is valid), and the
drafting loop.

Per step, exactly k forwards (see ``proposer``):
  pass 1   every scheduled request catches its draft KV up to the tokens the target has now
           (sampled: all tokens including the new one; a prefill chunk: the chunk); the last
           position of each sampled request drafts token 1.
  pass j   each sampled request feeds draft j-1 at the next position and drafts token j.
Draft-pass KV past the real tokens is speculative; the next catch-up overwrites it.
"""

from __future__ import annotations

import torch

from phalanx.attention.metadata import build_attention_metadata
from phalanx.config import ModelConfig
from phalanx.models.llama import CausalLM
from phalanx.models.registry import load_model
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.spec_decode.proposer import ProposeBatch, drafter_room


def run_pass(
    forward,  # noqa: ANN001 - callable(input_ids, meta) -> hidden rows [T, H]
    feeds: list[tuple[int, list[int], int]],  # (batch row, input token ids, first position)
    block_table: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, list[int]]:
    """One drafter forward over the given feeds; returns hidden [T, H] and each feed's last row."""
    if not feeds:
        return torch.empty(0), []
    rows = torch.tensor([f[0] for f in feeds])
    q_lens = torch.tensor([len(f[1]) for f in feeds])
    starts = torch.tensor([f[2] for f in feeds])
    meta = build_attention_metadata(q_lens, starts, block_table[rows], block_size)
    ids = torch.tensor([t for f in feeds for t in f[1]], dtype=torch.int64)
    hidden = forward(ids, meta)
    last_rows = (torch.cumsum(q_lens, 0) - 1).tolist()
    return hidden, last_rows


class DraftModelProposer:
    needs_target_hidden = False
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, spec: SpeculativeConfig, target_model: torch.nn.Module, target_cfg: ModelConfig) -> None:
        assert spec.model is not None
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.num_lookahead_slots = spec.num_speculative_tokens
        self.room = drafter_room(spec, target_cfg)
        cfg = ModelConfig.from_hf(spec.model, target_cfg.dtype, max(self.room, 2))
        self.config = cfg
        self.model: CausalLM = load_model(cfg)
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 16
        self._computed: dict[str, int] = {}

    def kv_cache_spec(self) -> list[tuple[int, int]]:
        return [(self.config.num_kv_heads, self.config.head_dim)] * self.config.num_layers

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0].shape[2]

    def start_request(self, req_id: str, num_computed: int) -> None:
        self._computed[req_id] = num_computed

    def finish_request(self, req_id: str) -> None:
        self._computed.pop(req_id, None)

    def _forward(self, ids: torch.Tensor, meta) -> torch.Tensor:  # noqa: ANN001
        hidden, _ = self.model(ids, self.kv_caches, meta)
        return hidden

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        k = self.num_speculative_tokens
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        feeds: list[tuple[int, list[int], int]] = []
        drafting: list[int] = []  # batch rows that get drafts
        for i, req_id in enumerate(batch.req_ids):
            tokens = batch.token_ids[i]
            if len(tokens) + k > self.room:
                continue  # past the drafter's context: no drafts for this request any more
            upto = len(tokens) if batch.sampled[i] else batch.num_computed[i] + batch.num_valid[i]
            start = self._computed.get(req_id, batch.num_computed[i])
            if upto > start:
                feeds.append((i, tokens[start:upto], start))
                self._computed[req_id] = upto
                if batch.sampled[i]:
                    drafting.append(len(feeds) - 1)
        hidden, last_rows = run_pass(self._forward, feeds, batch.block_table, self.block_size)
        feeds = [feeds[f] for f in drafting]
        if feeds:
            tokens_j = self.model.compute_logits(hidden[[last_rows[f] for f in drafting]]).argmax(-1).tolist()
        for j in range(1, k + 1):
            if not feeds:
                # Nothing to draft: later passes still run (empty), keeping the pass count fixed.
                continue
            for (row, _, _), tok in zip(feeds, tokens_j):
                drafts[row].append(tok)
            if j == k:
                break
            next_feeds = [
                (row, [tok], len(batch.token_ids[row]) + j - 1) for (row, _, _), tok in zip(feeds, tokens_j)
            ]
            hidden, last_rows = run_pass(self._forward, next_feeds, batch.block_table, self.block_size)
            tokens_j = self.model.compute_logits(hidden).argmax(-1).tolist()
            feeds = next_feeds
        return drafts
