"""The asyncio front end of the engine for the API server: prompts in, cumulative outputs out.

Owns: per-request async streams (`generate` yields cumulative `RequestOutput`s), the output loop
that turns engine messages into text through the shared `OutputProcessor` (the same one the
offline `LLM` uses, so served and offline text match), aborting requests whose consumer went away,
feeding `ServingMetrics`, and what happens when an engine rank dies (docs/dp-protocol.md,
"Failure model and recovery"):

* recovery on (the default): the dead rank's unfinished requests are replayed at once — the same
  prompt plus the tokens already produced, on a serving rank, or held until one serves — so every
  client's stream simply continues; the rank is restarted after its budget's backoff (`recovery`),
  or, for lockstep ranks, the whole group is re-formed; a rank that keeps dying is given up.
* fail-fast (recovery off, ranks on other nodes, or every rank given up): every waiting request
  gets `EngineDeadError`, and one `on_dead` callback fires (the server then exits non-zero).

Does not own: processes and sockets (``engine.core_client``), the restart budget
(``engine.recovery``), forming replays (``engine.output_processor``), HTTP and OpenAI formats
(``entrypoints.openai``), tokenization and chat templates (the server calls the tokenizer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.engine.core_client import EngineCoreClient, EngineDeadError, EngineUnavailableError
from phalanx.engine.core_process import EngineFailed, EngineOutputs, EngineReady, RequestFailed
from phalanx.engine.metrics import ServingMetrics, StatLogger
from phalanx.engine.output_processor import OutputProcessor
from phalanx.engine.protocol import EngineCoreRequest, validate_prompt_tokens
from phalanx.engine.recovery import RankState, RecoveryConfig, RestartBudget
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
    num_prompt_tokens: int  # counted as processed at the request's first token (its prefill done)
    first_token: dict[str, float] = field(default_factory=dict)  # child id -> time of its first token
    last_token: dict[str, float] = field(default_factory=dict)


@dataclass
class _Recovery:
    """One death being recovered from: done at the first token of any request the rank held."""

    what: str  # "engine rank 1" / "the lockstep group"
    since: float  # monotonic time the death was noticed
    req_ids: set[str]


class AsyncLLM:
    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Any | None,
        metrics: ServingMetrics,
        on_dead: Callable[[str], None] | None = None,
        watch_interval_s: float = 0.1,
        recovery: RecoveryConfig | None = None,
    ) -> None:
        self.client = client
        self.processor = OutputProcessor(tokenizer)
        self.metrics = metrics
        self.stat_logger = StatLogger(metrics)
        self.on_dead = on_dead
        self.watch_interval_s = watch_interval_s
        self.recovery = recovery if recovery is not None else RecoveryConfig()
        self.dead_message: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._child_to_parent: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._restarts: set[asyncio.Task] = set()
        self._budgets: dict[int, RestartBudget] = {}
        self._group_budget = RestartBudget(self.recovery)
        self._recoveries: list[_Recovery] = []
        self._reforming_since: float | None = None

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    @property
    def num_speculative_tokens(self) -> int:
        return self.client.num_speculative_tokens

    @property
    def adaptive_speculation(self) -> bool:
        return self.client.adaptive_speculation

    @property
    def is_healthy(self) -> bool:
        """At least one rank serves (and the server is not failing fast)."""
        return self.dead_message is None and self.client.serving

    def unavailable_reason(self) -> str:
        if self.dead_message is not None:
            return self.dead_message
        states = ", ".join(f"rank {r.rank} {r.state.value}" for r in self.client.ranks)
        return f"no engine rank is serving right now ({states}); requests wait up to {self.recovery.request_timeout_s:.0f} s"

    def start(self, log_stats_interval_s: float | None) -> None:
        """Start the output loop and the liveness watcher (call inside the running event loop)."""
        self._tasks.append(asyncio.create_task(self._output_loop(), name="phalanx-output-loop"))
        self._tasks.append(asyncio.create_task(self._watch_engine(), name="phalanx-engine-watcher"))
        if log_stats_interval_s and log_stats_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._log_stats(log_stats_interval_s)))
        for r in self.client.ranks:
            self.metrics.on_rank_up(r.rank, r.state is RankState.READY)
        if self.recovery.enabled and self.client.has_remote_ranks:
            logger.warning("ranks on other nodes cannot be restarted from here: a rank's death stops the server")

    async def stop(self) -> None:
        for t in [*self._tasks, *self._restarts]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._restarts, return_exceptions=True)
        self._tasks.clear()
        self._restarts.clear()

    # ---- requests ---------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt_tokens(prompt_token_ids, self.client.vocab_size, self.max_model_len)

    @property
    def _wait_s(self) -> float | None:
        """How long a request may wait for a serving rank (None: it may not; fail-fast)."""
        return self.recovery.request_timeout_s if self.recovery.enabled else None

    async def generate(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until finished. Leaving early (client gone) aborts the request."""
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        self.validate_prompt(prompt_token_ids)
        engine_reqs = self.processor.add_request(request_id, prompt, prompt_token_ids, params)
        stream = _Stream(asyncio.Queue(), time.monotonic(), {cid for cid, _ in engine_reqs}, len(prompt_token_ids))
        self._streams[request_id] = stream
        for cid, _ in engine_reqs:
            self._child_to_parent[cid] = request_id
        finished = False
        # The samples of an n > 1 request share its prompt: one computes it, the others wait for its
        # cached blocks (the scheduler's group rule), as offline.
        group = request_id if len(engine_reqs) > 1 else None
        try:
            self.client.add_requests(
                [EngineCoreRequest(cid, list(prompt_token_ids), p, stream.arrival, group) for cid, p in engine_reqs],
                self._wait_s,
            )
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

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End one parent request with `error` (its samples aborted wherever they are)."""
        self.client.abort_requests(self.processor.abort_request(request_id))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(error)

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
                    self._fail(parent, RequestRejectedError(msg.message))
            elif isinstance(msg, EngineFailed):
                self._on_rank_failure(msg.rank, f"engine rank {msg.rank} failed: {msg.message}")
            elif isinstance(msg, EngineReady):
                self._on_rank_ready(msg)

    def _handle_outputs(self, outputs: list) -> None:  # list[EngineCoreOutput]
        now = time.monotonic()
        for out in outputs:
            if out.finish_reason is not None:
                self.client.mark_finished(out.req_id)
            if self._recoveries and out.new_token_ids:
                self._check_recovered(out.req_id, now)
            parent = self._child_to_parent.get(out.req_id)
            stream = self._streams.get(parent) if parent is not None else None
            if stream is None or not out.new_token_ids:
                continue
            first = out.req_id not in stream.first_token
            if first:
                if not stream.first_token:  # the prompt's prefill is done: counted once, whatever its n
                    self.metrics.on_prompt(stream.num_prompt_tokens)
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

    # ---- rank deaths and recovery -----------------------------------------------------------
    async def _watch_engine(self) -> None:
        while self.dead_message is None:
            now = time.monotonic()
            for r in self.client.newly_dead():
                self._on_rank_failure(
                    r.rank, f"engine rank {r.rank} (pid {r.process.pid}) exited with code {r.exitcode}"
                )
            for r in self.client.overdue(now):
                self._on_rank_failure(
                    r.rank,
                    f"engine rank {r.rank}'s replacement (pid {r.process.pid}) did not report ready within "
                    f"{self.client.config.startup_timeout_s:.0f} s",
                )
            expired = self.client.expire_pending(now)
            if expired:
                parents = dict.fromkeys(p for rid in expired if (p := self._child_to_parent.get(rid)) is not None)
                error = EngineUnavailableError(
                    f"no engine rank could take the request within {self.recovery.request_timeout_s:.0f} s "
                    "(ranks restarting after a failure)"
                )
                for parent in parents:
                    self._fail(parent, error)
            await asyncio.sleep(self.watch_interval_s)

    def _on_rank_failure(self, rank: int, message: str) -> None:
        """A rank died (its process exited) or reported a fatal error: replay what it held and
        restart it, or re-form its lockstep group, or fail fast."""
        if self.dead_message is not None:
            return
        handle = self.client.ranks[rank]
        if handle.state in (RankState.DEAD, RankState.GIVEN_UP):
            return  # already being handled (a lockstep peer's failure after the group went down)
        if not self.recovery.enabled or self.client.has_remote_ranks:
            self._mark_dead(message)
            return
        now = time.monotonic()
        logger.error("%s", message)
        held: list[str] = []
        if self.client.lockstep:
            for h in self.client.ranks:
                if h.state not in (RankState.DEAD, RankState.GIVEN_UP):
                    held += self.client.retire(h.rank)
                    self.metrics.on_rank_down(h.rank)
            self.metrics.on_rank_death(rank)
            delay = self._group_budget.on_death(now)
            if delay is None:
                for h in self.client.ranks:
                    self.client.give_up(h.rank)
                self.metrics.on_given_up(len(self.client.ranks))
                self._mark_dead(f"{message}; the lockstep group failed {len(self._group_budget.deaths)} times "
                                f"within {self.recovery.restart_window_s:.0f} s and is not re-formed again")
                return
            logger.warning("re-forming the lockstep group (all %d ranks) in %.1f s; %d request(s) wait for it",
                           len(self.client.ranks), delay, len(held))
            self._later(delay, self._reform)
            self._replay(held, "the lockstep group", now)
            return
        held = self.client.retire(rank)
        self.metrics.on_rank_death(rank)
        delay = self._budgets.setdefault(rank, RestartBudget(self.recovery)).on_death(now)
        if delay is None:
            self.client.give_up(rank)
            given_up = sum(h.state is RankState.GIVEN_UP for h in self.client.ranks)
            self.metrics.on_given_up(given_up)
            logger.error("engine rank %d failed %d times within %.0f s: it is not restarted again", rank,
                         len(self._budgets[rank].deaths), self.recovery.restart_window_s)
            if given_up == len(self.client.ranks):
                self._mark_dead(f"{message}; every engine rank failed more often than the restart budget allows")
                return
        else:
            logger.warning("engine rank %d: restarting in %.1f s", rank, delay)
            self._later(delay, lambda: self._respawn(rank))
        self._replay(held, f"engine rank {rank}", now)

    def _later(self, delay_s: float, action: Callable[[], None]) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            if self.dead_message is None:
                action()

        task = asyncio.create_task(run())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def _respawn(self, rank: int) -> None:
        self.client.respawn(rank)
        self.metrics.on_rank_restart(rank)

    def _reform(self) -> None:
        self._reforming_since = time.monotonic()
        self.client.reform()
        for h in self.client.ranks:
            self.metrics.on_rank_restart(h.rank)

    def _replay(self, engine_ids: list[str], what: str, since: float) -> None:
        """Resubmit the unfinished samples among `engine_ids` with the tokens they produced so far."""
        if not engine_ids:
            return
        event = _Recovery(what, since, set())
        num_tokens = 0
        for parent, replays in self.processor.replays(engine_ids).items():
            stream = self._streams.get(parent)
            if stream is None:
                continue
            if self.processor.num_replays(parent) > self.recovery.max_replays:
                self._fail(parent, EngineUnavailableError(
                    f"the request was in flight on engine ranks that failed {self.recovery.max_replays + 1} "
                    "times; it is not replayed again"))
                continue
            group = parent if len(replays) > 1 else None
            requests = [
                EngineCoreRequest(r.engine_id, r.prompt_token_ids, r.params, stream.arrival, group,
                                  output_token_ids=r.output_token_ids)
                for r in replays
            ]
            self.client.add_requests(requests, self.recovery.request_timeout_s)
            self.metrics.on_replayed(len(requests))
            event.req_ids.update(r.req_id for r in requests)
            num_tokens += sum(len(r.output_token_ids) for r in requests)
        if event.req_ids:
            self._recoveries.append(event)
            logger.warning("replaying %d request(s) of %s (%d tokens already produced carried over)%s",
                           len(event.req_ids), what, num_tokens,
                           "" if self.client.serving else "; they wait for a serving rank")

    def _check_recovered(self, req_id: str, now: float) -> None:
        done = [e for e in self._recoveries if req_id in e.req_ids]
        for e in done:
            self._recoveries.remove(e)
            seconds = now - e.since
            self.metrics.on_recovered(seconds)
            logger.warning("recovered from the failure of %s: first token of a replayed request %.2f s after it",
                           e.what, seconds)

    def _on_rank_ready(self, msg: EngineReady) -> None:
        self.metrics.on_rank_up(msg.rank, True)
        if self._reforming_since is not None and self.client.serving:
            logger.warning("lockstep group re-formed in %.1f s", time.monotonic() - self._reforming_since)
            self.metrics.on_group_reformed()
            self._reforming_since = None
        sent = self.client.flush_pending()
        if sent:
            logger.info("sent %d waiting request(s) to the engine", sent)

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
