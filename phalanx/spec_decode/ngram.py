"""Model-free n-gram (prompt lookup) proposer.

Owns: finding, for each drafting request, the longest suffix n-gram (prompt_lookup_max down to
prompt_lookup_min tokens) that occurred earlier in its own tokens, and proposing the tokens (up to
its draft length) that followed its most recent earlier occurrence. No KV cache, no forward passes.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from phalanx.config import ModelConfig
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.spec_decode.proposer import ProposeBatch, drafter_room


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """[.., a b c .., a b] with max_n 2 -> the tokens after the last earlier "a b": [c, ..] (<= k)."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start early enough to be followed by at least one token before the suffix.
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    needs_target_hidden = False
    aux_layer_ids: tuple[int, ...] = ()
    num_lookahead_slots = 0
    passes_run = 0  # a lookup, no drafter forwards
    rows_fed = 0
    pass_rows = 0

    def __init__(self, spec: SpeculativeConfig, target_model: torch.nn.Module, target_cfg: ModelConfig) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self.room = drafter_room(spec, target_cfg)

    def kv_cache_spec(self) -> list[tuple[int, int]]:
        return []

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        assert not kv_caches

    def start_request(self, req_id: str, num_computed: int) -> None:
        pass

    def finish_request(self, req_id: str) -> None:
        pass

    def drafter_kv_ends(self) -> dict[str, int]:
        return {}  # no drafter KV

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        k = self.num_speculative_tokens
        drafts: list[list[int]] = []
        for tokens, wanted in zip(batch.token_ids, batch.num_drafts):
            if wanted == 0 or len(tokens) + k > self.room:
                drafts.append([])
                continue
            drafts.append(ngram_lookup(np.asarray(tokens, dtype=np.int64), self.min_n, self.max_n, wanted))
        return drafts
