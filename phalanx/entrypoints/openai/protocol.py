"""OpenAI-compatible request bodies (pydantic) and their conversion into `SamplingParams`.

Owns: which request fields phalanx accepts (every model forbids unknown fields, so `tools`,
`response_format`, ... are rejected with a 400 naming the field instead of being silently
ignored), their defaults (chat: `max_tokens` up to the context length; completions: 16, as in
OpenAI and vLLM), the size limits a client cannot exceed (below; docs/api-limits.md), and
`sampling_params(...)`.
Does not own: response formats (``serving``), HTTP routing and errors (``server``), the limits
that depend on the model (prompt length, token ids in the vocabulary: ``serving``).

Limits (a 400 naming the field, before any work is queued): `n` <= MAX_N, a completions
request's prompts x n <= MAX_SAMPLES, <= MAX_STOP_STRINGS stop strings of <= MAX_STOP_STRING_CHARS
characters, <= MAX_STOP_TOKEN_IDS stop token ids, <= MAX_LOGIT_BIAS logit_bias entries (values in
[-100, 100]), logprobs / top_logprobs <= MAX_LOGPROBS, every integer within 64 bits, no NaN or
infinite numbers.

`logit_bias` (OpenAI): token id (a JSON object key, so a string of digits) -> a bias in [-100, 100]
added to that token's logit before sampling, by the target and by speculative verification alike.
Extension fields (vLLM's names): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`; and phalanx's own `return_spec_stats`: each choice
then carries `spec_stats` = {num_draft_tokens, num_accepted_tokens, num_verify_steps,
mean_acceptance_length} for its sample; `speculative` (false: this request never gets drafts, the
others in its batch keep drafting) and `num_speculative_tokens` (at most j drafts per step,
0 <= j <= the server's k, checked against the server by ``serving``; on a server without
speculative decoding only 0 is valid); `speculative_adaptive` (false: on a server whose draft length
is adaptive, this request drafts its cap every step and is never parked; true or unset: the
policy's choice; only unset on a server without speculative decoding, and not true on a static
one). None of them changes the output, only its speed.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from phalanx.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

MAX_N = 128  # samples of one prompt (OpenAI's cap)
MAX_SAMPLES = 128  # samples of one request: a completions request's prompts x n
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 128  # each stop string is matched against every step's text
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS = 1024  # entries of the logit_bias map
MAX_LOGPROBS = 20  # logprobs (completions) and top_logprobs (chat), as vLLM's default max_logprobs

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


def _check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for s in strings:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}: {s[:40]!r}...")
    return stop


def _null_kept(field: FieldInfo) -> bool:
    """Whether a null sent for this field means something besides its default: a required field's
    (refused with the type it needs) and a nullable one's whose default is not None (completions'
    `max_tokens`: up to the context length, not 16)."""
    return field.is_required() or (type(None) in get_args(field.annotation) and field.get_default() is not None)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A field sent as null is a field not sent (`"stream": null`, `"tools": null`: OpenAI's
        optional parameters are nullable, and clients send them so): it takes its default, is not
        among the fields set, and one phalanx does not support asks for nothing, so it is not
        refused; except where the null means something else (`_null_kept`)."""
        if not isinstance(data, dict) or not any(v is None for v in data.values()):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or (k in fields and _null_kept(fields[k]))}


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "".join(p.text for p in self.content)
        else:
            content = self.content or ""
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class _SamplingFields(_Strict):
    """Fields shared by chat and completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    n: int = Field(1, le=MAX_N)  # >= 1: SamplingParams says so
    seed: Int64 | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(_check_stop)] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    logit_bias: Annotated[dict[int, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    user: str | None = None  # OpenAI's end-user tag: accepted and not used, as in vLLM (docs/api-limits.md)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_spec_stats: bool = False
    speculative: bool = True
    num_speculative_tokens: Int64 | None = None
    speculative_adaptive: bool | None = None

    def _common_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) with SamplingParams' own message for invalid values."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        kw: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "logit_bias": self.logit_bias,
            "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens,
            "speculative_adaptive": self.speculative_adaptive,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._common_params(max_tokens, logprobs, None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: int | None = None
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._common_params(max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty; give a string, a list of strings or token ids")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) * self.n > MAX_SAMPLES:
            raise ValueError(
                f"{len(p)} prompts x n={self.n} would be {len(p) * self.n} samples; one request may ask "
                f"for at most {MAX_SAMPLES} (split the prompts over several requests)"
            )
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Strict):
    """vLLM's two forms in one body: `prompt` (special tokens added by default, as a completions
    prompt is) or `messages` (rendered by the chat template, which carries its special tokens: none
    added by default, as a chat request's prompt). The template's fields belong to `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True with `prompt`, False with `messages`
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    CHAT_ONLY: ClassVar[tuple[str, ...]] = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")

    def special_tokens(self) -> bool:
        """`add_special_tokens` as given, else the form's default (True for `prompt`, False for `messages`)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]
