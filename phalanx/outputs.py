"""User-facing results of the offline API, mirroring vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-n).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Speculative decoding (a phalanx extension): drafts proposed / accepted for this sample.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted drafts per verification step (None without speculation)."""
        if not self.num_verify_steps:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    # Wall-clock times (time.time(), as vLLM's RequestMetrics) of the request's arrival, its first and
    # its latest output token, and its finish: "arrival_time", "first_token_time", "last_token_time",
    # "finished_time" (each present once it happened).
    metrics: dict[str, float] = field(default_factory=dict)
