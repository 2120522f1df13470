"""User-facing sampling parameters, validated on construction.

Owns: the `SamplingParams` dataclass (field names mirror vLLM's) and its validation.
Does not own: how the parameters are applied to logits (``phalanx.sample.sampler``) or how stop
strings are matched against text (``phalanx.engine.detokenizer``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


class SamplingParamError(ValueError):
    """A sampling parameter outside what is valid; `param` names it (the server's 400 body carries
    it as OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:  # (a default: unpickling passes the message only)
        super().__init__(message)
        self.param = param


def _as_str_list(value: str | list[str] | None, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    out = list(value)
    for s in out:
        if not isinstance(s, str) or s == "":
            raise SamplingParamError(f"{name} must contain non-empty strings, got {s!r}", name)
    return out


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # every integer field crosses process boundaries as int64


def speculation_error(requested: int | None, engine_k: int) -> str | None:
    """Why a request's `num_speculative_tokens` does not fit an engine drafting up to `engine_k`
    tokens per step (None: it fits). One message for the offline API and the server's 400."""
    if requested is None or 0 <= requested <= engine_k:
        return None
    if engine_k == 0:
        return (
            f"num_speculative_tokens must be 0 or unset here: this engine runs without speculative "
            f"decoding (no speculative config), got {requested}"
        )
    return (
        f"num_speculative_tokens must be in [0, {engine_k}] (this engine's speculative "
        f"num_speculative_tokens is {engine_k}), got {requested}"
    )


def speculative_adaptive_error(requested: bool | None, engine_k: int, engine_adaptive: bool) -> str | None:
    """Why a request's `speculative_adaptive` does not fit the engine (None: it fits): true needs
    an engine whose speculative config has "adaptive": true; false (draft the cap every step) an
    engine with speculative decoding. One message for the offline API and the server's 400."""
    if requested is None or (requested and engine_adaptive) or (not requested and engine_k > 0):
        return None
    if engine_k == 0:
        return (
            f"speculative_adaptive must be unset here: this engine runs without speculative decoding "
            f"(no speculative config), got {requested}"
        )
    return (
        "speculative_adaptive must be false or unset here: this engine's speculative config has no "
        '"adaptive": true (every request drafts its cap every step), got True'
    )


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Validated in ``__post_init__``.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k (stored as 0).
    ``max_tokens=None`` means "up to the model's context length".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # token id -> value added to its logit before penalties and sampling (OpenAI's logit_bias; the
    # engine checks the ids against the model's vocabulary)
    logit_bias: dict[int, float] | None = None
    # Speculative decoding for this request (phalanx's extension; other requests in its batch are
    # not affected): False opts it out (it never gets drafts); `num_speculative_tokens` caps its
    # draft length at j (0 <= j <= the engine's k; None: up to k). The engine checks j against its
    # k (`check_speculation`). On an engine whose speculative config is adaptive,
    # `speculative_adaptive=False` takes the request out of the policy's hands: it drafts its cap
    # every step and is never parked (a request whose latency matters more than the batch's
    # throughput); None or True leave it to the policy. Outputs are the same either way: only the
    # speed changes.
    speculative: bool = True
    num_speculative_tokens: int | None = None
    speculative_adaptive: bool | None = None

    def __post_init__(self) -> None:
        self.stop = _as_str_list(self.stop, "stop")  # type: ignore[arg-type]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, valid: str) -> ValueError:
            return SamplingParamError(f"{name} must be {valid}, got {getattr(self, name)!r}", name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise bad("temperature", ">= 0 and finite (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0 (1 disables it)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for 'up to the context length')")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens"
            )
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "None or an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "None or an integer")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "true or false")
        j = self.num_speculative_tokens
        if j is not None and (isinstance(j, bool) or not isinstance(j, int) or not 0 <= j <= INT64_MAX):
            raise bad("num_speculative_tokens", "None or an integer >= 0 (at most the engine's k)")
        if not self.speculative and j:
            raise SamplingParamError(
                f"num_speculative_tokens={j} contradicts speculative=False (which means no drafts); "
                "give one or the other", "num_speculative_tokens"
            )
        if self.speculative_adaptive is not None and not isinstance(self.speculative_adaptive, bool):
            raise bad("speculative_adaptive", "None, true or false")
        if not self.speculative and self.speculative_adaptive is not None:
            raise SamplingParamError(
                f"speculative_adaptive={self.speculative_adaptive} contradicts speculative=False (which means "
                "no drafts); give one or the other", "speculative_adaptive"
            )
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t <= INT64_MAX:
                raise SamplingParamError(f"stop_token_ids must be non-negative 64-bit integers, got {t!r}",
                                         "stop_token_ids")
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise bad(name, f"a 64-bit integer (in [{INT64_MIN}, {INT64_MAX}])")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= INT64_MAX:
                raise SamplingParamError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}",
                                         "logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise SamplingParamError(
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token_id}", "logit_bias"
                )

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids that index the logits (`logit_bias` keys) or must be sampled to count
        (`stop_token_ids`: one outside the vocabulary could never stop anything) must be in the
        vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad_ids = [t for t in ids if t >= vocab_size]
            if bad_ids:
                raise SamplingParamError(
                    f"{name} token id {bad_ids[0]} is outside the vocabulary; valid ids are 0..{vocab_size - 1}", name
                )

    def check_room(self, prompt_len: int, max_model_len: int) -> int:
        """`min_tokens` must fit in what the context leaves after the prompt (without `max_tokens` the
        request would otherwise run to the context's end with EOS banned). Returns that room."""
        room = max_model_len - prompt_len
        if self.min_tokens > room:
            raise SamplingParamError(
                f"min_tokens is {self.min_tokens}, but max_model_len {max_model_len} leaves {room} tokens after "
                f"the prompt's {prompt_len}; reduce min_tokens", "min_tokens"
            )
        return room

    def check_speculation(self, num_speculative_tokens: int, adaptive: bool = False) -> None:
        """`num_speculative_tokens` must be within the engine's k (0: an engine without speculative
        decoding, where only 0 or None is valid), and `speculative_adaptive` fit the engine
        (`adaptive`: its speculative config is adaptive)."""
        error = speculation_error(self.num_speculative_tokens, num_speculative_tokens)
        if error is None:
            error = speculative_adaptive_error(self.speculative_adaptive, num_speculative_tokens, adaptive)
        if error is not None:
            raise ValueError(error)

    def draft_cap(self, num_speculative_tokens: int) -> int:
        """The most drafts this request may get per step from an engine drafting up to k."""
        if not self.speculative:
            return 0
        j = self.num_speculative_tokens
        return num_speculative_tokens if j is None else min(j, num_speculative_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
