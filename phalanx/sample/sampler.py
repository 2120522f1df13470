"""Turning one row of logits into one token: penalties, temperature, truncation, sampling, logprobs.

Owns: `apply_penalties_and_bans`, `process_logits`, `Sampler` (greedy argmax and the exponential-race
random sample, with per-request generators for seeded rows), and `compute_token_logprobs` (also used
for prompt logprobs).
Does not own: building `SamplingMetadata` (``phalanx.sample.metadata``), the speculative accept /
reject rule (``phalanx.sample.rejection``), stop conditions or detokenisation.

Order of operations (every step vectorised over the batch; no per-token Python):
    raw logits ─► logit_bias ─► penalties + min_tokens bans ─► (greedy rows: argmax here)
               ─► / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► argmax(probs / Exp(1))
Logprobs are "raw": log_softmax of the model's logits before any of the above (vLLM v1's default).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from phalanx.ops import cpu as cpu_ops
from phalanx.sample.metadata import SamplingMetadata

# Exponential draws are clamped away from 0 so probs / q never divides by zero; the bias (a draw
# below 1e-20 has probability ~1e-20) is far below anything observable.
_MIN_EXPONENTIAL = 1e-20


@dataclass
class LogprobsTensors:
    """Logprobs of N emitted tokens. Column 0 is the emitted token, columns 1..n the top-n."""

    token_ids: torch.Tensor  # [N, n + 1] int64
    logprobs: torch.Tensor  # [N, n + 1] float32
    ranks: torch.Tensor  # [N] int64: 1 + number of tokens with strictly greater logprob

    def slice_rows(self, start: int, end: int) -> LogprobsTensors:
        return LogprobsTensors(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # one row per sampled token; None if nobody asked


def compute_token_logprobs(
    logits: torch.Tensor,  # [N, V] raw model logits
    token_ids: torch.Tensor,  # [N] int64
    num_top: int,
) -> LogprobsTensors:
    """Logprob and rank of ``token_ids[i]`` under ``log_softmax(logits[i])``, plus the top ``num_top``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_ids = token_ids.to(torch.int64)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [N]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [N, num_top]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def apply_penalties_and_bans(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logit bias, repetition / presence / frequency penalties and min_tokens bans. Returns a new
    float32 tensor.

    Logit bias (OpenAI): each row's bias values are added to their tokens' logits first (as vLLM
    does). Repetition (HF / vLLM): for tokens seen in prompt or output, positive logits are divided
    by the penalty and negative ones multiplied. Presence and frequency (OpenAI): subtract
    ``presence * [count > 0] + frequency * count`` over output tokens only.
    Verification runs the same function on every verified row, so a biased target stays lossless.
    """
    logits = logits.to(torch.float32, copy=True)  # [B, V]; the caller's raw logits stay intact for logprobs
    num_rows, vocab_size = logits.shape
    if meta.logit_bias is not None:
        _add_logit_bias(logits, meta.logit_bias)
    any_penalty = (
        meta.presence_penalty is not None
        or meta.frequency_penalty is not None
        or meta.repetition_penalty is not None
    )
    if any_penalty:
        output_counts = _token_counts(meta.output_token_ids, num_rows, vocab_size, logits.device)  # [B, V]
        output_seen = output_counts > 0
        if meta.repetition_penalty is not None:
            assert meta.prompt_token_ids is not None, "repetition penalty needs prompt_token_ids"
            prompt_seen = _token_counts(meta.prompt_token_ids, num_rows, vocab_size, logits.device) > 0
            penalty = torch.where(
                prompt_seen | output_seen, meta.repetition_penalty.unsqueeze(1), 1.0
            )  # [B, V]
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if meta.frequency_penalty is not None:
            logits -= meta.frequency_penalty.unsqueeze(1) * output_counts
        if meta.presence_penalty is not None:
            logits -= meta.presence_penalty.unsqueeze(1) * output_seen
    if meta.min_tokens_stop_ids:
        rows = [row for row, ids in meta.min_tokens_stop_ids.items() for t in ids if t < vocab_size]
        cols = [t for ids in meta.min_tokens_stop_ids.values() for t in ids if t < vocab_size]
        index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)  # [2, num_bans]
        logits[index[0], index[1]] = float("-inf")
    return logits


def _add_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    """logits[row, token] += bias for every (token, bias) of every row's map, in place."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))  # [N] int64 each
    logits.index_put_(index, torch.tensor(values, dtype=torch.float32, device=device), accumulate=True)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalties, then temperature (greedy rows untouched), then top-k, top-p and min-p masking."""
    return apply_temperature_and_truncation(apply_penalties_and_bans(logits, meta), meta)


def apply_temperature_and_truncation(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature and -inf masking on already-penalised float32 logits (modified in place)."""
    if not meta.all_greedy:
        temperature = torch.where(meta.is_greedy, 1.0, meta.temperature)  # [B]
        logits.div_(temperature.unsqueeze(1))
    if meta.top_k is not None or meta.top_p is not None:
        logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    if meta.min_p is not None:
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values  # [B, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64, 0 = disabled
    top_p: torch.Tensor | None,  # [B] float32, 1.0 = disabled
) -> torch.Tensor:
    """Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary survive).
    Top-p then keeps the smallest set of most likely tokens whose (renormalised) mass reaches p:
    a token is dropped when the mass of the tokens sorted before it is already >= p.
    One descending sort serves both; the result is scattered back to vocabulary order."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V] each
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [B]
        kth_largest = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive prefix sum
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _token_counts(
    token_ids: list[list[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:  # [B, V] float32: how often each token occurs in each row's list
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(t) for t in token_ids], dtype=torch.int64, device=device)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    if flat.numel() == 0:
        return counts
    # [[5, 7], [], [7]] -> rows [0, 0, 2], cols [5, 7, 7]
    rows = torch.arange(num_rows, device=device).repeat_interleave(lengths)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


class Sampler:
    """Samples one token per logits row. Holds the engine-level generator for unseeded rows."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The engine-seeded generator used for every row without its own seed."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """``logits``: [B, V] raw model logits, one row per ``meta`` row."""
        penalised = apply_penalties_and_bans(logits, meta)  # [B, V]
        greedy_ids = cpu_ops.argmax(penalised)  # [B]; computed before the in-place temperature
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            probs = torch.softmax(apply_temperature_and_truncation(penalised, meta), dim=-1)  # [B, V]
            random_ids = self.sample_from_probs(probs, meta.generators)
            sampled = random_ids if meta.all_random else torch.where(meta.is_greedy, greedy_ids, random_ids)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_token_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample_from_probs(
        self,
        probs: torch.Tensor,  # [B, V], rows sum to 1
        generators: dict[int, torch.Generator],
    ) -> torch.Tensor:  # [B] int64
        """Exponential race: ``argmax(probs / q)`` with q ~ Exp(1) is an exact sample from ``probs``.

        Seeded rows draw their V exponentials from their own generator, so a seeded request's token
        depends neither on the rest of the batch nor on its row position.
        """
        q = torch.empty_like(probs).exponential_(generator=self.generator(probs.device))  # [B, V]
        for row, gen in generators.items():
            q[row].exponential_(generator=gen)
        return (probs / q.clamp_min_(_MIN_EXPONENTIAL)).argmax(dim=-1)

    @staticmethod
    def skip_draws(generator: torch.Generator, num_positions: int, vocab_size: int) -> None:
        """Advance a seeded request's generator past ``num_positions`` sampled positions, as if it had
        sampled them: every sampled position of a seeded random request draws exactly V float32
        exponentials (``sample_from_probs``, and ``rejection._sample_seeded_in_order`` under
        speculation), whatever the batch. A request resumed from tokens it already produced
        (replayed after an engine rank died) then samples what it would have sampled."""
        if num_positions <= 0:
            return
        buf = torch.empty(vocab_size, dtype=torch.float32)  # [V]
        for _ in range(num_positions):
            buf.exponential_(generator=generator)

    def uniform(
        self,
        num_per_row: list[int],
        generators: dict[int, torch.Generator],
        device: torch.device,
    ) -> torch.Tensor:  # [sum(num_per_row)] float32 in [0, 1)
        """Uniform draws, ``num_per_row[i]`` of them for row i, concatenated; seeded rows use their own."""
        total = sum(num_per_row)
        if total == 0:  # draw nothing, so generator states stay as plain sampling leaves them
            return torch.empty(0, device=device)
        u = torch.rand(total, generator=self.generator(device), device=device)
        if generators:
            starts = list(itertools.accumulate([0] + num_per_row))
            for row, gen in generators.items():
                if num_per_row[row]:
                    u[starts[row] : starts[row + 1]] = torch.rand(
                        num_per_row[row], generator=gen, device=device
                    )
        return u
