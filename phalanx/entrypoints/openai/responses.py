"""The response bodies of the OpenAI-compatible server, as pydantic models, for its OpenAPI schema.

Owns: the documented shape of every response the server sends — success bodies (completions, chat
completions, models, tokenize, detokenize), the SSE stream of a streamed completion, and the error
body (`{"error": {"message", "type", "param", "code"}}`) with the status codes each route answers —
and `route_responses`, what each route passes to FastAPI. The schema is tested against the real
server by fuzzing (`tests/e2e/test_fuzz_api.py`, `benchmarks/fuzz_api.py`: schemathesis checks every
response against it), so these models must match what ``serving`` and ``server`` build.
Does not own: building the responses (``serving``, ``server``), request schemas (``protocol``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Closed(BaseModel):
    """No field beyond those documented (the schema says `additionalProperties: false`)."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Closed):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Closed):
    error: ErrorDetail


class Usage(_Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecStats(_Closed):
    """`return_spec_stats`: speculative decoding figures of one sample."""

    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    mean_acceptance_length: float | None


class CompletionLogprobs(_Closed):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    spec_stats: SpecStats | None = None


class CompletionResponse(_Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Closed):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Closed):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Closed):
    content: list[ChatTokenLogprob]


class ChatMessageOut(_Closed):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Closed):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    spec_stats: SpecStats | None = None


class ChatCompletionResponse(_Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Closed):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Closed):
    prompt: str


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: a value out of range, a malformed body, an unsupported field, a prompt over the "
    "context length, a size over the limits (docs/api-limits.md)",
    401: "Missing or invalid API key (when the server has one)",
    404: "Unknown model",
    413: "Request body larger than the server accepts",
    503: "No engine rank can serve: failed (engine_dead) or restarting beyond the recovery timeout "
    "(engine_unavailable)",
}

# A streamed response is server-sent events; in OpenAPI 3.1 the media type's schema describes each
# event: its `data` is a JSON chunk (or an error body, then) and the last one is `[DONE]`.
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "One server-sent event: `data` is a JSON chunk (object `text_completion` or "
            "`chat.completion.chunk`; an error body if the engine failed), the last event's `data` is `[DONE]`",
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
            "required": ["data"],
        }
    }
}


def route_responses(success: type[BaseModel] | None, statuses: tuple[int, ...], stream: bool = False) -> dict:
    """FastAPI's `responses=` for a route: its success model (with the SSE alternative for routes
    that stream) and the error statuses it may answer, each with the error body."""
    out: dict[int | str, dict[str, Any]] = {}
    if success is not None:
        out[200] = {"model": success, "description": "Success"}
        if stream:
            out[200]["content"] = dict(_SSE)
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
    return out


def without_validation_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents a 422 for every route with a body; phalanx answers invalid bodies with a 400
    and the error body instead (OpenAI's convention), which each route documents itself."""
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
