"""Lossless speculative verification: which draft tokens a request keeps, and the token after them.

Owns: `rejection_sample` and `RejectionOutput`. The rule (gpt-fast / Leviathan et al.), per request
with drafts x_1..x_k, target distributions p_1..p_{k+1} and draft distributions q_1..q_k:
  * random rows accept x_j with probability min(1, p_j(x_j) / q_j(x_j)) (one-hot q_j when the
    drafter is deterministic); at the first rejection a recovered token is sampled from
    normalise(max(p_j - q_j, 0)) and verification stops; if all k are accepted a bonus token is
    sampled from p_{k+1}. The emitted tokens are then distributed exactly as the target's.
  * greedy rows accept x_j while it equals argmax p_j, then emit the target argmax (recovered or bonus).
p_j is the fully processed target distribution (penalties with the history extended by the
accepted-so-far drafts, temperature, top-k/top-p/min-p), so spec decoding equals plain decoding.
Does not own: proposing drafts (``phalanx.spec_decode``), KV bookkeeping of rejected positions
(the scheduler simply does not advance ``num_computed_tokens`` past them), stop conditions.

Everything is vectorised across the batch; Python loops only slice the per-request result lists
and draw from seeded requests' generators.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from phalanx.ops import cpu as cpu_ops
from phalanx.sample.metadata import SamplingMetadata
from phalanx.sample.sampler import (
    _MIN_EXPONENTIAL,
    LogprobsTensors,
    Sampler,
    apply_penalties_and_bans,
    apply_temperature_and_truncation,
    compute_token_logprobs,
)


@dataclass
class RejectionOutput:
    output_token_ids: list[list[int]]  # per request: accepted drafts, then one recovered/bonus token
    num_accepted: list[int]  # per request: how many drafts were accepted (len(output) - 1)
    # One row per emitted token, requests concatenated in order: request i owns rows
    # [sum(len(out_j) for j < i), ... + len(out_i)). None when nobody asked for logprobs.
    logprobs: LogprobsTensors | None

    def logprobs_for(self, req_index: int) -> LogprobsTensors | None:
        if self.logprobs is None:
            return None
        start = sum(len(out) for out in self.output_token_ids[:req_index])
        return self.logprobs.slice_rows(start, start + len(self.output_token_ids[req_index]))


@dataclass
class _DraftLayout:
    """Index tensors locating every draft in the flat target rows.

    drafts [[a1], [b1, b2], []] -> num_drafts [1, 2, 0], row_start [0, 2, 5], draft_start [0, 1, 3],
    padded [[a1, 0], [b1, b2], [0, 0]], valid [[T, F], [T, T], [F, F]], flat_target_rows [0, 2, 3].
    """

    num_drafts: torch.Tensor  # [B] int64
    row_start: torch.Tensor  # [B] first target row of each request
    draft_start: torch.Tensor  # [B] first draft_probs row of each request
    valid: torch.Tensor  # [B, K] bool, K = max drafts per request
    target_rows: torch.Tensor  # [B, K] target row of each (padded) draft
    padded_drafts: torch.Tensor  # [B, K] int64, 0 where not valid
    flat_drafts: torch.Tensor  # [num_drafts] int64
    flat_target_rows: torch.Tensor  # [num_drafts]

    @classmethod
    def build(cls, draft_token_ids: list[list[int]], device: torch.device) -> _DraftLayout:
        counts = [len(d) for d in draft_token_ids]
        num_drafts = torch.tensor(counts, dtype=torch.int64, device=device)
        row_start = torch.cumsum(num_drafts + 1, dim=0) - (num_drafts + 1)
        position = torch.arange(max(counts, default=0), device=device)  # [K]
        valid = position.unsqueeze(0) < num_drafts.unsqueeze(1)
        target_rows = row_start.unsqueeze(1) + position
        flat_drafts = torch.tensor(
            list(itertools.chain.from_iterable(draft_token_ids)), dtype=torch.int64, device=device
        )
        padded_drafts = torch.zeros(valid.shape, dtype=torch.int64, device=device)
        padded_drafts[valid] = flat_drafts  # boolean indexing is row-major, matching the flat order
        return cls(
            num_drafts=num_drafts,
            row_start=row_start,
            draft_start=torch.cumsum(num_drafts, dim=0) - num_drafts,
            valid=valid,
            target_rows=target_rows,
            padded_drafts=padded_drafts,
            flat_drafts=flat_drafts,
            flat_target_rows=target_rows[valid],
        )


def rejection_sample(
    draft_token_ids: list[list[int]],  # per request, possibly empty (then it is a plain sample)
    draft_probs: torch.Tensor | None,  # [num_drafts, V] drafter's probabilities; None = one-hot drafts
    target_logits: torch.Tensor,  # [num_drafts + B, V] raw target logits, rows per request consecutive
    meta: SamplingMetadata,  # one row per REQUEST
    sampler: Sampler,
) -> RejectionOutput:
    """Verify each request's drafts against the target in one vectorised pass.

    Request i owns target rows ``[row_start_i, row_start_i + len(drafts_i)]``: row j holds the target
    logits after the context extended by ``drafts_i[:j]``; the last row yields the bonus token.
    Draws: a seeded random request with one-hot drafts samples the target position by position from
    its own generator, V exponentials per position exactly as plain decoding draws them, accepting a
    draft while the sample equals it and emitting the first sample that differs (or the bonus):
    P(accept) = p(x) = min(1, p / q) for one-hot q, and a rejected position's sample is distributed as
    normalise(p - q)+, so this is the same lossless rule, and the request's tokens are those plain
    decoding samples with the same seed (`_sample_seeded_in_order`). Other random rows draw
    ``len(drafts_i)`` uniforms, then V exponentials. With no drafts this is exactly
    ``Sampler.__call__`` (same draws, same token).
    """
    num_rows = [len(d) + 1 for d in draft_token_ids]
    total_drafts = sum(num_rows) - len(num_rows)
    if len(draft_token_ids) != meta.num_rows or target_logits.shape[0] != sum(num_rows):
        raise ValueError(
            f"expected {meta.num_rows} draft lists and {sum(num_rows)} target rows "
            f"(sum of len(drafts) + 1), got {len(draft_token_ids)} draft lists and "
            f"{target_logits.shape[0]} target rows"
        )
    if draft_probs is not None and draft_probs.shape[0] != total_drafts:
        raise ValueError(
            f"draft_probs must have {total_drafts} rows (one per draft), got {draft_probs.shape[0]}"
        )
    layout = _DraftLayout.build(draft_token_ids, target_logits.device)
    expanded = meta.expand_for_verification(num_rows, draft_token_ids)
    penalised = apply_penalties_and_bans(target_logits, expanded)  # [T, V]
    target_argmax = cpu_ops.argmax(penalised)  # [T]; taken before temperature is applied in place
    probs = None  # [T, V] processed target distribution; only random rows need it
    if not meta.all_greedy:
        probs = torch.softmax(apply_temperature_and_truncation(penalised, expanded), dim=-1)

    seeded: dict[int, tuple[int, int]] = {}  # row -> (accepted drafts, final token)
    if probs is not None and draft_probs is None and meta.generators:
        seeded = _sample_seeded_in_order(layout, probs, draft_token_ids, meta, sampler)
        meta = dataclasses.replace(meta, generators={r: g for r, g in meta.generators.items() if r not in seeded})
    accepted = _accept_mask(layout, target_argmax, probs, draft_probs, meta, sampler)  # [B, K]
    for row, (n, _) in seeded.items():
        accepted[row] = layout.valid[row] & (torch.arange(accepted.shape[1], device=accepted.device) < n)
    # Accepted prefix length = index of the first rejection: [T, T, F, T] -> cumprod [1, 1, 0, 0] -> 2.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    final_rows = layout.row_start + num_accepted  # [B] row of the recovered / bonus token
    final_tokens = target_argmax[final_rows]  # [B]; right for greedy rows
    if probs is not None:
        random_final = _sample_recovered_or_bonus(
            layout, num_accepted, probs[final_rows], draft_probs, meta, sampler
        )
        final_tokens = (
            random_final if meta.all_random else torch.where(meta.is_greedy, final_tokens, random_final)
        )
        for row, (_, token) in seeded.items():
            final_tokens[row] = token

    accepted_list = num_accepted.tolist()
    outputs = [d[:n] + [t] for d, n, t in zip(draft_token_ids, accepted_list, final_tokens.tolist())]
    logprobs = None
    if meta.max_num_logprobs is not None:
        logprobs = _emitted_logprobs(
            layout, target_logits, num_accepted, final_rows, final_tokens, meta.max_num_logprobs
        )
    return RejectionOutput(output_token_ids=outputs, num_accepted=accepted_list, logprobs=logprobs)


def _sample_seeded_in_order(
    layout: _DraftLayout,
    probs: torch.Tensor,  # [T, V] processed target distributions
    draft_token_ids: list[list[int]],
    meta: SamplingMetadata,
    sampler: Sampler,
) -> dict[int, tuple[int, int]]:  # row -> (accepted drafts, final token)
    """Seeded random rows with one-hot drafts: sample position j of the target with the request's
    generator as plain decoding would (``sample_from_probs``: V exponentials), accept draft j while
    the sample equals it, stop at the first sample that differs or at the bonus position. Only the
    request's generator draws (the engine's is left as plain decoding leaves it)."""
    out = {}
    starts = layout.row_start.tolist()
    greedy = meta.is_greedy.tolist()
    for row, gen in meta.generators.items():
        if greedy[row]:
            continue
        drafts = draft_token_ids[row]
        for j in range(len(drafts) + 1):
            p = probs[starts[row] + j]  # [V]
            q = torch.empty_like(p).exponential_(generator=gen)  # the V draws plain decoding makes
            token = int((p / q.clamp_min_(_MIN_EXPONENTIAL)).argmax())
            if j == len(drafts) or token != drafts[j]:
                out[row] = (j, token)
                break
    return out


def _accept_mask(
    layout: _DraftLayout,
    target_argmax: torch.Tensor,  # [T]
    probs: torch.Tensor | None,  # [T, V]; None when every request is greedy
    draft_probs: torch.Tensor | None,  # [num_drafts, V]
    meta: SamplingMetadata,
    sampler: Sampler,
) -> torch.Tensor:  # [B, K] bool: draft j of request i passes its own test (ignoring earlier ones)
    is_greedy = meta.is_greedy.unsqueeze(1)  # [B, 1]
    accepted = torch.zeros_like(layout.valid)
    if not meta.all_random:
        safe_rows = layout.target_rows.clamp(max=target_argmax.shape[0] - 1)  # padding stays in range
        accepted |= (layout.padded_drafts == target_argmax[safe_rows]) & is_greedy
    if probs is not None:
        target_p = probs[layout.flat_target_rows, layout.flat_drafts]  # [num_drafts]
        if draft_probs is None:
            draft_q = torch.ones_like(target_p)
        else:
            draft_rows = torch.arange(layout.flat_drafts.shape[0], device=draft_probs.device)
            draft_q = draft_probs.float()[draft_rows, layout.flat_drafts]
        uniform = sampler.uniform(layout.num_drafts.tolist(), meta.generators, probs.device)
        # P(u * q < p) = min(1, p / q) for u ~ U[0, 1); a token the target forbids (p = 0) never passes.
        random_accept = torch.zeros_like(accepted)
        random_accept[layout.valid] = uniform * draft_q < target_p
        accepted |= random_accept & ~is_greedy
    return accepted & layout.valid


def _sample_recovered_or_bonus(
    layout: _DraftLayout,
    num_accepted: torch.Tensor,  # [B]
    target_final: torch.Tensor,  # [B, V] target p at each request's final row
    draft_probs: torch.Tensor | None,  # [num_drafts, V]
    meta: SamplingMetadata,
    sampler: Sampler,
) -> torch.Tensor:  # [B] int64
    """Recovered token from normalise(max(p - q, 0)) after a rejection, bonus token from p otherwise."""
    total_drafts = layout.flat_drafts.shape[0]
    if total_drafts > 0:
        rejected = num_accepted < layout.num_drafts  # [B]; False: all accepted -> bonus from p itself
        rejected_draft = (layout.draft_start + num_accepted).clamp(max=total_drafts - 1)  # [B]
        if draft_probs is None:
            vocab_size = target_final.shape[1]
            draft_final = torch.nn.functional.one_hot(layout.flat_drafts[rejected_draft], vocab_size)
        else:
            draft_final = draft_probs[rejected_draft]  # [B, V]
        residual = (target_final - draft_final.float() * rejected.unsqueeze(1)).clamp_min(0.0)  # [B, V]
        # Rounding can leave no positive mass where p and q coincide; fall back to p there.
        has_mass = residual.sum(dim=-1, keepdim=True) > 0
        target_final = torch.where(has_mass, residual, target_final)
    # The exponential race is scale invariant, so the residual needs no normalisation.
    return sampler.sample_from_probs(target_final, meta.generators)


def _emitted_logprobs(
    layout: _DraftLayout,
    target_logits: torch.Tensor,  # [T, V] raw
    num_accepted: torch.Tensor,  # [B]
    final_rows: torch.Tensor,  # [B]
    final_tokens: torch.Tensor,  # [B]
    num_top: int,
) -> LogprobsTensors:  # one row per emitted token, requests in order
    # Token at every target row: the draft there, overwritten by the final token on final rows;
    # emitted rows are those at offset <= num_accepted within their request.
    total_rows = target_logits.shape[0]
    row_tokens = torch.zeros(total_rows, dtype=torch.int64, device=target_logits.device)
    row_tokens[layout.flat_target_rows] = layout.flat_drafts
    row_tokens[final_rows] = final_tokens
    repeats = layout.num_drafts + 1
    offset = torch.arange(total_rows, device=target_logits.device) - layout.row_start.repeat_interleave(
        repeats
    )
    emitted = offset <= num_accepted.repeat_interleave(repeats)  # [T]
    return compute_token_logprobs(target_logits[emitted], row_tokens[emitted], num_top)
