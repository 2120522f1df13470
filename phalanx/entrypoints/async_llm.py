"""The asyncio front end of the engine for the API server: prompts in, cumulative outputs out.

Owns: per-request async streams (`generate` yields cumulative `RequestOutput`s), the output loop
that turns engine messages into text through the shared `OutputProcessor` (the same one the
offline `LLM` uses, so served and offline text match), aborting requests whose consumer went away,
feeding `ServingMetrics`, and turning a dead or failed engine rank into `EngineDeadError` for every
waiting request plus one `on_dead` callback (the server then exits non-zero).
Does not own: processes and sockets (``engine.core_client``), HTTP and OpenAI formats
(``entrypoints.openai``), tokenization and chat templates (the server calls the tokenizer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.engine.core_client import EngineCoreClient, EngineDeadError
from phalanx.engine.core_process import EngineFailed, EngineOutputs, RequestFailed
from phalanx.engine.engine_core import EngineCoreRequest, validate_prompt_tokens
from phalanx.engine.metrics import ServingMetrics, StatLogger
from phalanx.engine.output_processor import OutputProcessor
from phalanx.outputs import RequestOutput
from phalanx.sampling_params import SamplingParams

logger = logging.getLogger("phalanx.server")


class RequestRejectedError(ValueError):
    """The engine refused a request (it validates prompts again); maps to HTTP 400."""


@dataclass
class _Stream:
    """One parent request in flight: its queue of cumulative outputs and timing for metrics."""

    queue: asyncio.Queue
    arrival: float
    child_ids: set[str]
    first_token: dict[str, float] = field(default_factory=dict)  # child id -> time of its first token
    last_token: dict[str, float] = field(default_factory=dict)


class AsyncLLM:
    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Any | None,
        metrics: ServingMetrics,
        on_dead: Callable[[str], None] | None = None,
        watch_interval_s: float = 0.2,
    ) -> None:
        self.client = client
        self.processor = OutputProcessor(tokenizer)
        self.metrics = metrics
        self.stat_logger = StatLogger(metrics)
        self.on_dead = on_dead
        self.watch_interval_s = watch_interval_s
        self.dead_message: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._child_to_parent: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    @property
    def is_healthy(self) -> bool:
        return self.dead_message is None and self.client.dead_rank() is None

    def start(self, log_stats_interval_s: float | None) -> None:
        """Start the output loop and the liveness watcher (call inside the running event loop)."""
        self._tasks.append(asyncio.create_task(self._output_loop(), name="phalanx-output-loop"))
        self._tasks.append(asyncio.create_task(self._watch_engine(), name="phalanx-engine-watcher"))
        if log_stats_interval_s and log_stats_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._log_stats(log_stats_interval_s)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # ---- requests ---------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt_tokens(prompt_token_ids, self.client.vocab_size, self.max_model_len)

    async def generate(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until finished. Leaving early (client gone) aborts the request."""
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        self.validate_prompt(prompt_token_ids)
        engine_reqs = self.processor.add_request(request_id, prompt, prompt_token_ids, params)
        stream = _Stream(asyncio.Queue(), time.monotonic(), {cid for cid, _ in engine_reqs})
        self._streams[request_id] = stream
        for cid, _ in engine_reqs:
            self._child_to_parent[cid] = request_id
        finished = False
        try:
            self.client.add_requests(
                [EngineCoreRequest(cid, list(prompt_token_ids), p, stream.arrival) for cid, p in engine_reqs]
            )
            self.metrics.on_prompt(len(prompt_token_ids))  # one prompt, however many samples share it
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: when the consumer fell behind, only the newest matters.
                while not stream.queue.empty() and not isinstance(item, BaseException):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._forget(request_id)
            if not finished:
                engine_ids = self.processor.abort_request(request_id)
                if engine_ids:
                    self.client.abort_requests(engine_ids)
                self.metrics.on_finished(["abort"], time.monotonic() - stream.arrival)

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for cid in stream.child_ids:
                self._child_to_parent.pop(cid, None)

    # ---- engine messages --------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = await self.client.recv()
            if isinstance(msg, EngineOutputs):
                if msg.outputs:
                    self._handle_outputs(msg.outputs)
                if msg.stats is not None:
                    self.metrics.on_stats(msg.rank, msg.stats)
            elif isinstance(msg, RequestFailed):
                self.client.mark_finished(msg.req_id)
                parent = self._child_to_parent.get(msg.req_id)
                if parent is not None:
                    # Abort the sibling samples too; the request as a whole is rejected.
                    self.client.abort_requests(self.processor.abort_request(parent))
                    self._streams[parent].queue.put_nowait(RequestRejectedError(msg.message))
            elif isinstance(msg, EngineFailed):
                self._mark_dead(f"engine rank {msg.rank} failed: {msg.message}")

    def _handle_outputs(self, outputs: list) -> None:  # list[EngineCoreOutput]
        now = time.monotonic()
        for out in outputs:
            if out.finish_reason is not None:
                self.client.mark_finished(out.req_id)
            parent = self._child_to_parent.get(out.req_id)
            stream = self._streams.get(parent) if parent is not None else None
            if stream is None or not out.new_token_ids:
                continue
            first = out.req_id not in stream.first_token
            if first:
                stream.first_token[out.req_id] = now
            last = stream.last_token.get(out.req_id)
            stream.last_token[out.req_id] = now
            self.metrics.on_tokens(
                len(out.new_token_ids),
                ttft=now - stream.arrival if first else None,
                itl=None if last is None else now - last,
            )
        processed = self.processor.process(outputs)
        if processed.abort_ids:  # stop strings ended these samples; the engine need not go on
            self.client.abort_requests(processed.abort_ids)
        for ro in processed.request_outputs:
            stream = self._streams.get(ro.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(ro)
            if ro.finished:
                self.metrics.on_finished(
                    [c.finish_reason or "abort" for c in ro.outputs], now - stream.arrival
                )

    async def _watch_engine(self) -> None:
        while self.dead_message is None:
            dead = self.client.dead_rank()
            if dead is not None:
                self._mark_dead(
                    f"engine rank {dead.rank} (pid {dead.process.pid}) exited with code "
                    f"{dead.process.exitcode}"
                )
                return
            await asyncio.sleep(self.watch_interval_s)

    def _mark_dead(self, message: str) -> None:
        if self.dead_message is not None:
            return
        logger.error("%s; failing all requests and shutting down", message)
        self.dead_message = message
        self.client.dead_message = message
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(message))
        if self.on_dead is not None:
            self.on_dead(message)

    async def _log_stats(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.stat_logger.log()
