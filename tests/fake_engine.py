"""An in-process stand-in for the engine processes, for tests of the API server's front end.

`FakeEngineClient` has the surface `AsyncLLM` uses of `EngineCoreClient` (add / abort requests,
`recv`, liveness, vocabulary size, context length, speculative k). It records every engine request it is sent and
answers each with a fixed list of tokens, then finish reason "length" (with `hold`, only once `release()` is called:
a request still in its prefill). `fake_app` builds the real
FastAPI app around it, so HTTP tests run without spawning processes and can assert how much work
reached the engine (none, for a request rejected with a 400).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from phalanx.core.outputs import EngineCoreOutput
from phalanx.engine.core_process import EngineMessage, EngineOutputs
from phalanx.engine.metrics import ServingMetrics
from phalanx.engine.protocol import EngineCoreRequest
from phalanx.entrypoints.async_llm import AsyncLLM


class FakeEngineClient:
    def __init__(
        self, vocab_size: int, max_model_len: int, tokens: tuple[int, ...] = (65, 66, 67), num_speculative_tokens: int = 0,
        adaptive_speculation: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens  # the engine's speculative k (0: none)
        self.adaptive_speculation = adaptive_speculation  # its draft length is the adaptive policy's
        self.tokens = tokens
        self.hold = False  # keep the answers until release()
        self._held: list[EngineOutputs] = []
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.dead_message: str | None = None
        self._queue: asyncio.Queue[EngineMessage] = asyncio.Queue()

    ranks: list = []  # no rank processes: nothing dies, nothing restarts
    serving = True
    has_remote_ranks = False

    def add_requests(self, requests: list[EngineCoreRequest], timeout_s: float | None = None) -> int:
        self.added.extend(requests)
        for r in requests:
            n = min(len(self.tokens), r.sampling_params.max_tokens or len(self.tokens))
            out = EngineOutputs(0, [EngineCoreOutput(r.req_id, list(self.tokens[:n]), finish_reason="length")])
            if self.hold:
                self._held.append(out)
            else:
                self._queue.put_nowait(out)
        return 0

    def release(self) -> None:
        """Send the answers held so far."""
        for out in self._held:
            self._queue.put_nowait(out)
        self._held.clear()

    def abort_requests(self, req_ids: list[str]) -> None:
        self.aborted.extend(req_ids)

    def mark_finished(self, req_id: str) -> None:
        pass

    async def recv(self) -> EngineMessage:
        return await self._queue.get()

    def newly_dead(self) -> list:
        return []

    def overdue(self, now: float) -> list:
        return []

    def expire_pending(self, now: float) -> list[str]:
        return []


@asynccontextmanager
async def fake_app(
    tokenizer: Any | None, vocab_size: int, max_model_len: int = 256, num_speculative_tokens: int = 0,
    adaptive_speculation: bool = False,
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngineClient, AsyncLLM]]:
    """The real server app on a fake engine: (HTTP client, fake engine client, AsyncLLM)."""
    from phalanx.entrypoints.openai.server import build_app, make_state

    client = FakeEngineClient(vocab_size, max_model_len, num_speculative_tokens=num_speculative_tokens,
                              adaptive_speculation=adaptive_speculation)
    metrics = ServingMetrics("tiny")
    engine = AsyncLLM(client, tokenizer, metrics)  # type: ignore[arg-type]
    engine.start(None)
    app = build_app(make_state(engine, tokenizer, metrics, "tiny", "/nowhere", None))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http, client, engine
    finally:
        await engine.stop()
