"""The small messages between scheduler, model runner and engine front end.

Owns: `SchedulerOutput` (what to run this step: only diffs for requests the runner already knows),
`ModelRunnerOutput` (what came out), `EngineCoreOutput` (per-request progress for the front end,
a msgspec Struct because it crosses process boundaries).
Does not own: any behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from phalanx.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has never seen: everything it needs to hold its own state."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens the request produced before it reached this engine (a request replayed after the rank
    # that ran it died): they follow the prompt and count as output (penalties, min/max_tokens).
    output_token_ids: list[int] = field(default_factory=list)
    # The scheduler's verdict: it may be drafted for (its own cap above 0: neither opted out by its
    # parameters nor parked by the adaptive policy). A request that may not never reaches the drafter.
    may_draft: bool = False


@dataclass
class CachedRequestData:
    """A request the runner already holds. `resumed` = back from preemption: `block_ids` then
    replaces the block table instead of extending it."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to run this step (including scheduled draft tokens), in batch order.
    num_scheduled_tokens: dict[str, int]
    # req_id -> draft tokens to verify this step (the tail of its scheduled tokens).
    scheduled_spec_tokens: dict[str, list[int]]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the previous step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests whose scheduled tokens reach their last token: they produce tokens (and drafts) this
    # step. The one source of this fact for the runner and for the lockstep vote.
    reaching_end: set[str] = field(default_factory=set)
    # req_id -> drafts to propose after this step (0: none), for each request in `reaching_end` when
    # speculative decoding is on (scheduler `_draft_lengths`: the request's cap, the batch's
    # disable_by_batch_size, the adaptive policy). Read by the runner and by the lockstep vote.
    draft_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-n (ids, logprobs, rank of chosen)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request, tokens produced this step: [] for a partial prefill chunk, 1 for plain decode,
    # up to k + 1 after verifying k drafts.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Draft tokens proposed for the next step (speculative decoding), per request.
    spec_token_ids: list[list[int]] | None = None
    # Drafter forwards this step ran (pass 1 + one per draft position; the voted ones in lockstep).
    num_drafter_passes: int = 0
    drafter_rows_fed: int = 0  # positions the drafter's first pass fed
    drafter_pass_rows: int = 0  # positions its later passes fed
    drafting_reqs: int = 0  # requests the drafter was asked to draft for
    # Requests whose drafter catch-up waits, or that never feed the drafter (opted out; 0)
    # (``spec_decode.proposer``): the first position without drafter KV; their blocks from there on
    # go to the prefix cache marked without it.
    drafter_kv_end: dict[str, int] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Speculative decoding, cumulative for this request.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding counters (cumulative).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # How many times a request reaching its end was given each draft length 0..k (cumulative).
    spec_draft_lengths: list[int] = field(default_factory=list)
    spec_num_parked: int = 0  # requests the adaptive policy parked (cumulative)
