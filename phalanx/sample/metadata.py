"""Per-row sampling metadata: the tensor form of a batch's `SamplingParams`.

Owns: `SamplingMetadata` — one row per logits row — built from the requests' `SamplingParams`
(`from_params`) and expanded to one row per verified position for speculative decoding
(`expand_for_verification`).
Does not own: applying the metadata to logits (``phalanx.sample.sampler``), the rejection rule
(``phalanx.sample.rejection``), or creating the per-request generators (the model runner makes one
``torch.Generator`` per seeded request, seeds it once with ``SamplingParams.seed`` and keeps it for
the request's lifetime).

Optional tensors are ``None`` when no row uses the feature, so the sampler can skip the work.
Greedy rows carry the "disabled" value for every random-only option (top-k/top-p/min-p).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from phalanx.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """What the sampler needs to know about each logits row."""

    temperature: torch.Tensor  # [B] float32; 0.0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, 0 = disabled; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 = disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 = disabled
    # row index -> the request's own generator (seeded random rows only)
    generators: dict[int, torch.Generator]
    presence_penalty: torch.Tensor | None  # [B] float32, 0.0 = disabled
    frequency_penalty: torch.Tensor | None  # [B] float32, 0.0 = disabled
    repetition_penalty: torch.Tensor | None  # [B] float32, 1.0 = disabled
    prompt_token_ids: list[list[int]] | None  # per row; None when no row uses a penalty
    output_token_ids: list[list[int]]  # per row: tokens generated so far
    # row -> token ids forbidden at this row (EOS unless ignore_eos, plus stop_token_ids) because
    # the row's output is still shorter than min_tokens
    min_tokens_stop_ids: dict[int, list[int]]
    max_num_logprobs: int | None  # max requested top-n logprobs; None = nobody wants logprobs
    # per row: token id -> bias added to its raw logit (None for rows without); None when no row has one
    logit_bias: list[dict[int, float] | None] | None = None
    # Bookkeeping so expand_for_verification can recompute the bans for longer histories.
    min_tokens: list[int] = dataclasses.field(default_factory=list)  # [B]
    stop_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [B] ids banned by min_tokens

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def is_greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature <= 0.0

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: set[int],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build one row per request. ``generators[i]`` is request i's own generator (None if unseeded)."""
        num_rows = len(params)
        if not (len(generators) == len(prompt_token_ids) == len(output_token_ids) == num_rows):
            raise ValueError(
                "params, generators, prompt_token_ids and output_token_ids must have one entry per row, "
                f"got {num_rows}, {len(generators)}, {len(prompt_token_ids)}, {len(output_token_ids)}"
            )
        greedy = [p.greedy for p in params]
        temperature = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        presence = [float(p.presence_penalty) for p in params]
        frequency = [float(p.frequency_penalty) for p in params]
        repetition = [float(p.repetition_penalty) for p in params]

        def tensor_or_none(values: list, disabled: float, dtype: torch.dtype) -> torch.Tensor | None:
            if all(v == disabled for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        presence_t = tensor_or_none(presence, 0.0, torch.float32)
        frequency_t = tensor_or_none(frequency, 0.0, torch.float32)
        repetition_t = tensor_or_none(repetition, 1.0, torch.float32)
        any_penalty = presence_t is not None or frequency_t is not None or repetition_t is not None

        stop_ids = [
            sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))) for p in params
        ]
        min_tokens = [p.min_tokens for p in params]
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        logit_bias = [p.logit_bias for p in params]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=tensor_or_none(top_k, 0, torch.int64),
            top_p=tensor_or_none(top_p, 1.0, torch.float32),
            min_p=tensor_or_none(min_p, 0.0, torch.float32),
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            presence_penalty=presence_t,
            frequency_penalty=frequency_t,
            repetition_penalty=repetition_t,
            prompt_token_ids=[list(t) for t in prompt_token_ids] if any_penalty else None,
            output_token_ids=[list(t) for t in output_token_ids],
            min_tokens_stop_ids=_min_tokens_bans(min_tokens, stop_ids, output_token_ids),
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            logit_bias=logit_bias if any(logit_bias) else None,
            min_tokens=min_tokens,
            stop_ids=stop_ids,
        )

    def expand_for_verification(
        self, num_rows_per_req: list[int], draft_token_ids: list[list[int]]
    ) -> SamplingMetadata:
        """One row per verified position: request i gets ``len(drafts_i) + 1`` consecutive rows.

        Row j of request i sees the output history ``output_token_ids[i] + drafts_i[:j]``, so
        penalties and min_tokens bans are exactly what sequential decoding would apply. Rows of one
        request share the request's generator object.
        Example: drafts [[a1], [b1, b2]] -> rows [r0: out0, r1: out0+a1, r2: out1, r3: out1+b1, r4: out1+b1+b2].
        """
        if len(num_rows_per_req) != self.num_rows or len(draft_token_ids) != self.num_rows:
            raise ValueError(
                f"expected {self.num_rows} requests, got num_rows_per_req={num_rows_per_req!r} and "
                f"{len(draft_token_ids)} draft lists"
            )
        for n, drafts in zip(num_rows_per_req, draft_token_ids):
            if n != len(drafts) + 1:
                raise ValueError(
                    f"num_rows_per_req must be len(drafts) + 1, got {n} rows for drafts {drafts!r}"
                )
        device = self.temperature.device
        repeats = torch.tensor(num_rows_per_req, dtype=torch.int64, device=device)

        def expand(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat_interleave(repeats)

        def expand_list(values: list) -> list:
            return [v for v, n in zip(values, num_rows_per_req) for _ in range(n)]

        outputs = [
            self.output_token_ids[i] + drafts[:j]
            for i, drafts in enumerate(draft_token_ids)
            for j in range(len(drafts) + 1)
        ]
        starts = [0]
        for n in num_rows_per_req[:-1]:
            starts.append(starts[-1] + n)
        generators = {
            starts[i] + j: gen for i, gen in self.generators.items() for j in range(num_rows_per_req[i])
        }
        min_tokens = expand_list(self.min_tokens)
        stop_ids = expand_list(self.stop_ids)
        return dataclasses.replace(
            self,
            temperature=expand(self.temperature),
            top_k=expand(self.top_k),
            top_p=expand(self.top_p),
            min_p=expand(self.min_p),
            generators=generators,
            presence_penalty=expand(self.presence_penalty),
            frequency_penalty=expand(self.frequency_penalty),
            repetition_penalty=expand(self.repetition_penalty),
            prompt_token_ids=None if self.prompt_token_ids is None else expand_list(self.prompt_token_ids),
            output_token_ids=outputs,
            min_tokens_stop_ids=_min_tokens_bans(min_tokens, stop_ids, outputs),
            logit_bias=None if self.logit_bias is None else expand_list(self.logit_bias),
            min_tokens=min_tokens,
            stop_ids=stop_ids,
        )


def _min_tokens_bans(
    min_tokens: list[int], stop_ids: list[list[int]], output_token_ids: list[list[int]]
) -> dict[int, list[int]]:
    # vLLM's rule: while len(output) < min_tokens, the next token may not be a stop token.
    return {
        row: ids
        for row, (m, ids, out) in enumerate(zip(min_tokens, stop_ids, output_token_ids))
        if ids and len(out) < m
    }
