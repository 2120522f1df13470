"""The OpenAI-compatible HTTP server (FastAPI app) and its lifecycle next to the engine processes.

Owns: routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`,
`/version`, `/tokenize`, `/detokenize`), the API-key check, the request body size limit
(`max_request_bytes`: a body is refused with 413 before it is parsed, whether or not it declares its
length), mapping every error to an OpenAI-style body (`{"error": {"message", "type", "param",
"code"}}`: 400 invalid values / malformed JSON / unsupported fields / prompts over the context length
/ sizes over the limits, 401 bad key, 404 unknown model or route, 413 body too large, 503 engine
gone or, while ranks restart, no rank serving: `/health` answers 200 while at least one rank serves).
Does not own: the request/response formats (``protocol``, ``serving``), the engine front end
(``entrypoints.async_llm``), process start-up and shutdown (``entrypoints.serve``).
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import phalanx
from phalanx.engine.core_client import EngineDeadError
from phalanx.engine.metrics import ServingMetrics
from phalanx.entrypoints.async_llm import AsyncLLM
from phalanx.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from phalanx.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    route_responses,
    without_validation_errors,
)
from phalanx.entrypoints.openai.serving import APIError, OpenAIServing, engine_error

logger = logging.getLogger("phalanx.server")

_MIB = 1 << 20


def max_request_bytes(max_model_len: int) -> int:
    """The largest request body accepted: 4 MiB, or 16 bytes per context token if that is more
    (a whole-context prompt sent as JSON token ids or as escaped text fits several times)."""
    return max(4 * _MIB, 16 * max_model_len)


@dataclass
class ServerState:
    engine: AsyncLLM
    tokenizer: Any | None
    metrics: ServingMetrics
    served_model_name: str
    model_path: str
    api_key: str | None = None
    created: int = 0


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _field_path(loc: tuple | list) -> str:
    """pydantic's error location without "body" and union-branch names: messages.0.content.0.type."""
    parts = [
        str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPE_NAMES))
    ]
    return ".".join(parts)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, naming the offending field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    for err in errors:
        if err.get("type") == "extra_forbidden":
            field = _field_path(err.get("loc", ()))
            return (
                f"unsupported field {field!r}: phalanx does not implement it (remove it from the request)",
                field,
            )
    err = errors[0]
    field = _field_path(err.get("loc", ())) or None
    if err.get("type") == "missing":
        if field is None:
            return "missing request body: send a JSON object", None
        return f"missing required field {field!r}", field
    where = f"{field}: " if field else ""
    return f"{where}{err.get('msg')} (got {err.get('input')!r})"[:2000], field


class APIKeyMiddleware:
    """Answers 401 (OpenAI-style body) to a /v1 request without ``Authorization: Bearer <key>``.

    Plain ASGI on purpose: Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) relays
    every streamed chunk through an extra task and memory stream, which was ~30 % of the API
    process's CPU time while streaming (py-spy, demo model, 16 concurrent chat streams)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(header, self.expected):
                error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request whose body exceeds `limit` bytes: at once when its Content-Length
    says so, else as soon as the streamed body passes the limit. The body is read here (as FastAPI
    would read it anyway before parsing) and handed on in one piece; later `receive` calls (the
    disconnect watch) go to the server. Bounds the API process's memory and event-loop time per
    request."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: dict[str, Any] | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict[str, Any]:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        error = APIError(
            413,
            f"the request body is larger than {self.limit} bytes, the most this server accepts",
            code="request_too_large",
        )
        await _error_response(error)(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="phalanx", version=phalanx.__version__)
    serving = OpenAIServing(state.engine, state.tokenizer, state.served_model_name)
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = without_validation_errors(default_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimitMiddleware, limit=max_request_bytes(state.engine.max_model_len))

    # ---- errors -----------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        # a prompt's or a sampling parameter's error names its field (`PromptError`, `SamplingParamError`)
        return _error_response(APIError(400, str(exc), param=getattr(exc, "param", None)))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_response(engine_error(exc))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    # ---- auth -------------------------------------------------------------------------------
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.served_model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {state.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_alive() -> None:
        if state.engine.dead_message is not None:
            raise EngineDeadError(state.engine.dead_message)

    # ---- routes -----------------------------------------------------------------------------
    generation = (400, 401, 404, 413, 503)

    @app.post("/v1/chat/completions", responses=route_responses(ChatCompletionResponse, generation, stream=True))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        check_alive()
        return await serving.chat(req, raw)

    @app.post("/v1/completions", responses=route_responses(CompletionResponse, generation, stream=True))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        check_alive()
        return await serving.completion(req, raw)

    @app.get("/v1/models", response_model=None, responses=route_responses(ModelList, (401,)))
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "phalanx",
                    "root": state.model_path,
                    "max_model_len": state.engine.max_model_len,
                }
            ],
        }

    @app.get("/health", responses={200: {"description": "At least one engine rank serves"},
                                   **route_responses(None, (503,))})
    async def health() -> Response:
        if state.engine.is_healthy:  # at least one rank serves
            return Response(status_code=200)
        code = "engine_dead" if state.engine.dead_message is not None else "engine_unavailable"
        return _error_response(APIError(503, state.engine.unavailable_reason(), "server_error", code=code))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": phalanx.__version__}

    @app.post("/tokenize", response_model=None, responses=route_responses(TokenizeResponse, (400, 404, 413)))
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            prompt = await serving.chat_prompt(req, add_special_tokens=req.special_tokens())
        else:
            assert req.prompt is not None
            for name in TokenizeRequest.CHAT_ONLY:  # (sent as null: not set, `protocol._Strict`)
                if name in req.model_fields_set:
                    raise APIError(400, f"{name} applies to 'messages' only, not to 'prompt'", param=name)
            prompt = await serving.prompts.encode(req.prompt, req.special_tokens())
        ids = prompt.token_ids
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=None, responses=route_responses(DetokenizeResponse, (400, 404, 413)))
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = state.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary; valid ids are 0..{vocab - 1}",
                param="tokens",
            )
        limit = state.engine.max_model_len
        if len(req.tokens) > limit:
            raise APIError(
                400, f"{len(req.tokens)} tokens is more than max_model_len ({limit}) allows", param="tokens"
            )
        return {"prompt": await serving.prompts.decode(req.tokens)}

    return app


def make_state(
    engine: AsyncLLM,
    tokenizer: Any | None,
    metrics: ServingMetrics,
    served_model_name: str,
    model_path: str,
    api_key: str | None,
) -> ServerState:
    return ServerState(engine, tokenizer, metrics, served_model_name, model_path, api_key, int(time.time()))
