"""Chat and text completions: OpenAI request -> prompt token ids -> engine -> OpenAI response.

Owns: the checks of a request against the model (token counts against the context length, token
ids against the vocabulary), the OpenAI response and SSE chunk formats (incl. logprobs, echo,
usage, phalanx's `spec_stats`), diffing the engine's cumulative outputs into stream deltas per
choice, and aborting work whose client went away.
Does not own: routing, auth and error bodies (``server``), request schemas and size limits
(``protocol``), chat templates and tokenization (``prompts``, off the event loop), text
detokenization and stop strings (the engine front end's ``OutputProcessor``).

Streams: chat and completions share one generator (`OpenAIServing._stream`: opening chunk, one
chunk per engine update, usage, ``[DONE]``) and one per-choice diff (`_delta`); the two formats
differ only in what `_ChatFormat` / `_CompletionFormat` say (role chunk, echo prefix, delta vs
text field, the two logprobs layouts).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from phalanx.engine.core_client import EngineDeadError, EngineUnavailableError
from phalanx.entrypoints.async_llm import AsyncLLM, RequestRejectedError
from phalanx.entrypoints.openai.prompts import Prompt, PromptPreparer
from phalanx.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from phalanx.outputs import CompletionOutput, Logprob, RequestOutput
from phalanx.sampling_params import SamplingParams, speculation_error, speculative_adaptive_error


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(e: Exception) -> APIError:
    if isinstance(e, RequestRejectedError):
        return APIError(400, str(e))
    if isinstance(e, EngineUnavailableError):  # ranks restarting; the server goes on
        return APIError(503, f"the engine is not available: {e}", "server_error", code="engine_unavailable")
    return APIError(503, f"the engine is not available: {e}", "server_error", code="engine_dead")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, tokenizer: Any | None, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.prompts = PromptPreparer(tokenizer, engine.max_model_len)

    # ---- prompts ----------------------------------------------------------------------------
    async def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool = False) -> Prompt:
        assert req.messages is not None
        return await self.prompts.chat_prompt(
            [m.as_template_dict() for m in req.messages],
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            add_special_tokens,
        )

    def _params(self, req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        """Validate the sampling fields and their token ids (before any prompt work); ValueError -> 400."""
        error = speculation_error(req.num_speculative_tokens, self.engine.num_speculative_tokens)
        if error is not None:  # the range this server accepts, with the field named
            raise APIError(400, error, param="num_speculative_tokens")
        if not req.speculative and req.num_speculative_tokens:
            raise APIError(
                400,
                f"num_speculative_tokens={req.num_speculative_tokens} contradicts speculative=false (no "
                "drafts); give one or the other",
                param="num_speculative_tokens",
            )
        error = speculative_adaptive_error(req.speculative_adaptive, self.engine.num_speculative_tokens,
                                           self.engine.adaptive_speculation)
        if error is not None:
            raise APIError(400, error, param="speculative_adaptive")
        if not req.speculative and req.speculative_adaptive is not None:
            raise APIError(
                400,
                f"speculative_adaptive={str(req.speculative_adaptive).lower()} contradicts speculative=false (no "
                "drafts); give one or the other",
                param="speculative_adaptive",
            )
        params = req.sampling_params(req.requested_max_tokens())
        params.check_token_ids(self.engine.vocab_size)
        return params

    def _check_prompts(self, req: ChatCompletionRequest | CompletionRequest, params: SamplingParams,
                       prompts: list[Prompt]) -> None:
        """Every prompt's tokens: in the vocabulary, and room for the completion; ValueError -> 400."""
        requested = req.requested_max_tokens()
        limit = self.engine.max_model_len
        for p in prompts:
            self.engine.validate_prompt(p.token_ids)
            if requested is not None and len(p.token_ids) + requested > limit:
                raise ValueError(
                    f"this model's maximum context length is {limit} tokens, but {len(p.token_ids) + requested} "
                    f"were requested ({len(p.token_ids)} in the prompt, {requested} in the completion); reduce "
                    "the prompt or max_tokens"
                )
            params.check_room(len(p.token_ids), limit)

    # ---- chat -------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        params = self._params(req)
        prompt = await self.chat_prompt(req)
        self._check_prompts(req, params, [prompt])
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gen = self.engine.generate(request_id, prompt.text, prompt.token_ids, params)
        if req.stream:
            return _sse(self._stream(_ChatFormat(self, req), req, request_id, created, [gen], [prompt]))
        outputs = await _collect([gen], raw)
        if outputs is None:
            return Response(status_code=499)
        final = outputs[0]
        choices = []
        for c in final.outputs:
            choice: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None
                if c.logprobs is None
                else {"content": self._chat_logprobs(c, 0, req.top_logprobs or 0)},
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_spec_stats:
                choice["spec_stats"] = _spec_stats(c)
            choices.append(choice)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(len(prompt.token_ids), [final]),
            }
        )

    # ---- streaming (chat and completions alike) ---------------------------------------------
    async def _stream(
        self,
        fmt: _StreamFormat,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        created: int,
        gens: list[AsyncIterator[RequestOutput]],
        prompts: list[Prompt],
    ) -> AsyncIterator[str]:
        """SSE events: `fmt`'s opening chunk, then one chunk per engine update that shows something
        new (the changed choices only), the usage chunk if asked for, and ``[DONE]``. Engine errors
        become an error event before ``[DONE]``."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": request_id, "object": fmt.object, "created": created, "model": self.model_name}
        choices = [_StreamedChoice(pi * req.n + i, p) for pi, p in enumerate(prompts) for i in range(req.n)]
        finals: list[RequestOutput | None] = [None] * len(prompts)

        def chunk(deltas: list[dict[str, Any]]) -> str:
            return _event({**base, "choices": deltas, **({"usage": None} if include_usage else {})})

        try:
            opening = fmt.opening(choices)
            if opening:
                yield chunk(opening)
            async for pi, out in _merge(gens):
                finals[pi] = out
                deltas = [
                    d
                    for c in out.outputs
                    if (d := self._delta(fmt, req, choices[pi * req.n + c.index], out, c)) is not None
                ]
                if deltas:
                    yield chunk(deltas)
            if include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                yield _event({**base, "choices": [], "usage": _usage(num_prompt, [f for f in finals if f])})
        except (EngineDeadError, RequestRejectedError) as e:
            yield _event(engine_error(e).body())
        yield "data: [DONE]\n\n"

    def _delta(
        self,
        fmt: _StreamFormat,
        req: ChatCompletionRequest | CompletionRequest,
        choice: _StreamedChoice,
        out: RequestOutput,
        c: CompletionOutput,
    ) -> dict[str, Any] | None:
        """What is new in one choice since the last chunk, or None when nothing is to show yet
        (e.g. half a UTF-8 character held back). Advances the choice's sent counters."""
        if choice.done:
            return None
        text = c.text[choice.sent_chars :]
        if not choice.started:
            text = fmt.prefix(choice) + text
        choice.started = True
        new_tokens = len(c.token_ids) - choice.sent_tokens
        if not text and c.finish_reason is None and (new_tokens == 0 or not fmt.wants_logprobs(c)):
            return None
        delta: dict[str, Any] = {
            "index": choice.index,
            **fmt.content(text),
            "logprobs": fmt.logprobs(choice, out, c, new_tokens),
            "finish_reason": c.finish_reason,
        }
        if c.finish_reason is not None:
            delta["stop_reason"] = c.stop_reason
            if req.return_spec_stats:
                delta["spec_stats"] = _spec_stats(c)
            choice.done = True
        choice.sent_chars, choice.sent_tokens = len(c.text), len(c.token_ids)
        return delta

    def _chat_logprobs(self, c: CompletionOutput, start: int, top_n: int) -> list[dict[str, Any]]:
        """OpenAI chat format for tokens [start:]. Each position's dict holds the chosen token (with its
        true rank) and the top-n (ranks 1..n; the chosen one appears once), so ranks 1..n are the top."""
        assert c.logprobs is not None
        content = []
        for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = entry.get(token_id)
            token = self._token_text(token_id, chosen)
            top = sorted(
                ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= top_n),
                key=lambda kv: kv[1].rank or 0,
            )
            content.append(
                {
                    "token": token,
                    "logprob": _finite(chosen.logprob if chosen else float("-inf")),
                    "bytes": _token_bytes(token),
                    "top_logprobs": [
                        {
                            "token": (t := self._token_text(tid, lp)),
                            "logprob": _finite(lp.logprob),
                            "bytes": _token_bytes(t),
                        }
                        for tid, lp in top
                    ],
                }
            )
        return content

    def _token_text(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return f"token_id:{token_id}"

    # ---- completions ------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        params = self._params(req)
        prompts = [await self.prompts.encode(p) for p in req.prompts()]
        self._check_prompts(req, params, prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = [
            self.engine.generate(f"{request_id}-{i}", p.text, p.token_ids, params)
            for i, p in enumerate(prompts)
        ]
        if req.stream:
            return _sse(self._stream(_CompletionFormat(self, req), req, request_id, created, gens, prompts))
        finals = await _collect(gens, raw)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for pi, (p, final) in enumerate(zip(prompts, finals)):
            prefix = self._prompt_text(p) if req.echo else ""
            for c in final.outputs:
                choice: dict[str, Any] = {
                    "index": pi * req.n + c.index,
                    "text": prefix + c.text,
                    "logprobs": self._completion_logprobs(p, final, c, req.echo)[0]
                    if req.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.return_spec_stats:
                    choice["spec_stats"] = _spec_stats(c)
                choices.append(choice)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(sum(len(p.token_ids) for p in prompts), finals),
            }
        )

    def _prompt_text(self, p: Prompt) -> str:
        if p.text is not None:
            return p.text
        return self.tokenizer.decode(p.token_ids) if self.tokenizer is not None else ""

    def _completion_logprobs(
        self,
        p: Prompt,
        out: RequestOutput,
        c: CompletionOutput,
        echo: bool,
        start: int = 0,
        offset: int = 0,
    ) -> tuple[dict[str, Any], int]:
        """OpenAI legacy format (tokens, token_logprobs, top_logprobs, text_offset) for the prompt
        (echo) and output tokens [start:], plus the offset after the last one. Offsets add up the token
        strings' lengths, as vLLM does, so streamed and whole responses agree."""
        entries: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo:
            prompt_lps = out.prompt_logprobs or [None] * len(p.token_ids)
            entries.extend(zip(p.token_ids, prompt_lps))
        entries.extend(zip(c.token_ids[start:], (c.logprobs or [])[start:]))
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in entries:
            chosen = entry.get(token_id) if entry else None
            token = self._token_text(token_id, chosen)
            tokens.append(token)
            token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
            top_logprobs.append(
                None
                if entry is None
                else {self._token_text(t, lp): _finite(lp.logprob) for t, lp in entry.items()}
            )
            offsets.append(offset)
            offset += len(token)
        logprobs = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
        return logprobs, offset


# ---- the two stream formats ---------------------------------------------------------------------


@dataclass
class _StreamedChoice:
    """How much of one choice a stream has sent."""

    index: int  # the choice's index in the response (completions: prompt index x n + sample index)
    prompt: Prompt
    started: bool = False
    sent_chars: int = 0
    sent_tokens: int = 0
    text_offset: int = 0  # completions logprobs: text_offset of the next token
    done: bool = False


class _StreamFormat(Protocol):
    """What differs between a chat and a completions stream; `OpenAIServing._stream` does the rest."""

    object: str

    def opening(self, choices: list[_StreamedChoice]) -> list[dict[str, Any]]:
        """The first chunk's choices (none: no opening chunk)."""
        ...

    def prefix(self, choice: _StreamedChoice) -> str:
        """Text sent before the choice's first output text."""
        ...

    def content(self, text: str) -> dict[str, Any]:
        """The choice's text field(s) for new text."""
        ...

    def wants_logprobs(self, c: CompletionOutput) -> bool: ...

    def logprobs(self, choice: _StreamedChoice, out: RequestOutput, c: CompletionOutput, new_tokens: int) -> Any:
        """The logprobs of the tokens since the last chunk (updates `choice.text_offset`)."""
        ...


class _ChatFormat:
    object = "chat.completion.chunk"

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest) -> None:
        self.serving, self.top_logprobs = serving, req.top_logprobs or 0

    def opening(self, choices: list[_StreamedChoice]) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None} for c in choices]

    def prefix(self, choice: _StreamedChoice) -> str:
        return ""

    def content(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text} if text else {}}

    def wants_logprobs(self, c: CompletionOutput) -> bool:
        return c.logprobs is not None

    def logprobs(self, choice: _StreamedChoice, out: RequestOutput, c: CompletionOutput, new_tokens: int) -> Any:
        if c.logprobs is None or not new_tokens:
            return None
        return {"content": self.serving._chat_logprobs(c, choice.sent_tokens, self.top_logprobs)}


class _CompletionFormat:
    object = "text_completion"

    def __init__(self, serving: OpenAIServing, req: CompletionRequest) -> None:
        self.serving, self.echo, self.num_logprobs = serving, req.echo, req.logprobs

    def opening(self, choices: list[_StreamedChoice]) -> list[dict[str, Any]]:
        return []

    def prefix(self, choice: _StreamedChoice) -> str:
        return self.serving._prompt_text(choice.prompt) if self.echo else ""

    def content(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def wants_logprobs(self, c: CompletionOutput) -> bool:
        return self.num_logprobs is not None

    def logprobs(self, choice: _StreamedChoice, out: RequestOutput, c: CompletionOutput, new_tokens: int) -> Any:
        if self.num_logprobs is None:
            return None
        echo = self.echo and choice.sent_tokens == 0
        logprobs, choice.text_offset = self.serving._completion_logprobs(
            choice.prompt, out, c, echo, choice.sent_tokens, choice.text_offset
        )
        return logprobs


# ---- helpers ------------------------------------------------------------------------------------


def _token_bytes(token: str) -> list[int]:
    """The token's UTF-8 bytes; a partial character shown as "bytes:\\xe4\\xbd" gives its raw bytes."""
    if token.startswith("bytes:"):
        hex_digits = token[len("bytes:") :].split("\\x")[1:]
        if hex_digits and all(len(h) == 2 for h in hex_digits):
            try:
                return [int(h, 16) for h in hex_digits]
            except ValueError:
                pass
    return list(token.encode("utf-8"))


def _finite(x: float) -> float:
    """JSON has no -inf; OpenAI clients expect a number."""
    return max(x, -9999.0)


def _usage(num_prompt_tokens: int, finals: list[RequestOutput]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
    }


def _spec_stats(c: CompletionOutput) -> dict[str, Any]:
    return {
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "num_verify_steps": c.num_verify_steps,
        "mean_acceptance_length": c.mean_acceptance_length,
    }


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams, tagging each item with its stream's index."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    sentinel = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(sentinel)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is sentinel:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(gens: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput] | None:
    """Run the streams to their final outputs; None (and every request aborted) if the client left."""

    async def last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for out in gen:
            final = out
        assert final is not None
        return final

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(last(g) for g in gens)))
    watch = asyncio.create_task(disconnected())
    client_left = False
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client left (or this handler was cancelled): abort everything
            client_left = True
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    # A cancelled gather ends with a CancelledError *exception* (not in the cancelled state), so
    # work.result() would raise it out of the handler.
    return None if client_left else work.result()
