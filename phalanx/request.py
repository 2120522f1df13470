"""The engine-side request: token ids, progress and status. No text, no torch.

Owns: `Request`, `RequestStatus`, `FinishReason`.
Does not own: KV blocks (``core.kv_cache_manager`` maps req_id -> blocks), text (the front end).

The one progress counter is `num_computed_tokens`: tokens whose KV is in the cache. A request is
"caught up" when `num_computed_tokens == num_tokens`; the scheduler hands out budget until it is.
`spec_token_ids` are draft tokens proposed for the next step; they are scheduled like any token and
counted in `num_tokens_with_spec`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from phalanx.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @staticmethod
    def of(status: RequestStatus) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        }.get(status)


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    max_tokens: int = 16  # resolved against max_model_len by the engine
    # Samples of one n > 1 request share a group: siblings wait for the first one's prompt so
    # they reuse its KV blocks through the prefix cache.
    group_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling (-1: not scheduled yet)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id that ended the request, if any
    num_preemptions: int = 0
    # Speculative decoding bookkeeping (per request, returned on demand).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    # The most drafts a step its own parameters allow from the engine's k (0: opted out); set by
    # the scheduler when the request arrives.
    own_draft_cap: int = 0
    # Drafts own_draft_cap every step whatever the adaptive policy chooses for the others
    # (`SamplingParams.speculative_adaptive=False`); never parked.
    pinned: bool = False
    # Parked by the adaptive policy when it arrived (``spec_decode.adaptive.PARK_AFTER``): it runs as
    # opted out (own_draft_cap 0) for its whole life.
    parked: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def append_output(self, token_id: int) -> RequestStatus | None:
        """Append one sampled token; return the finished status it causes, if any.

        Checks, in order: stop tokens (EOS unless ignore_eos, and stop_token_ids) once min_tokens is
        reached, then max_tokens. The token is kept in the output either way (the front end hides
        EOS text by skipping special tokens, as vLLM does).
        """
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id  # like vLLM: the stop token id; None for EOS
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
