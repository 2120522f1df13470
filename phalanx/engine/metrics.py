"""Serving metrics: Prometheus collectors (``/metrics``) and the periodic "engine is busy" log line.

Owns: a private `CollectorRegistry` with vLLM's metric names under the ``phalanx:`` prefix, fed
from two sources -- per-request events seen by the API server (finish reasons, token counts,
time to first token, inter-token latency, end-to-end latency) and the `SchedulerStats` each engine
rank reports (running / waiting, KV-cache usage, prefix-cache and speculative-decoding counters,
which are cumulative per rank and turned into counter increments here; a rank's replacement
process starts its counters from zero: `on_rank_restart`) -- the recovery figures (rank deaths,
restarts, lockstep group re-formations, replayed requests, ranks given up, ranks serving, the time
from a rank's death to the first token of a request it held), and `StatLogger`, which summarises the
same figures every few seconds while there is work.
Does not own: collecting the stats inside the engine (``core.scheduler``), HTTP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from phalanx.core.outputs import SchedulerStats

logger = logging.getLogger("phalanx.metrics")

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


@dataclass
class _RankCounters:
    """The last cumulative counters seen from one rank (to turn them into increments)."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_per_pos: list[int] = field(default_factory=list)
    preemptions: int = 0
    spec_draft_lengths: list[int] = field(default_factory=list)
    spec_parked: int = 0


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.request_success = Counter(
            "phalanx:request_success",
            "Finished requests by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "phalanx:prompt_tokens",
            "Prompt tokens processed: each prompt once (whatever its n), when its prefill ends (its first token).",
            m,
            registry=r,
        )
        self.generation_tokens = Counter("phalanx:generation_tokens", "Generated tokens.", m, registry=r)
        self.ttft = Histogram(
            "phalanx:time_to_first_token_seconds",
            "Time to first token.",
            m,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "phalanx:inter_token_latency_seconds",
            "Time between output chunks, per token.",
            m,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "phalanx:e2e_request_latency_seconds",
            "End-to-end request latency.",
            m,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        e = m + ["engine"]
        self.num_running = Gauge("phalanx:num_requests_running", "Requests running.", e, registry=r)
        self.num_waiting = Gauge("phalanx:num_requests_waiting", "Requests waiting.", e, registry=r)
        self.kv_usage = Gauge("phalanx:kv_cache_usage_perc", "KV-cache usage (1 = full).", e, registry=r)
        self.prefix_queries = Counter(
            "phalanx:prefix_cache_queries", "Prefix-cache queries, in tokens.", e, registry=r
        )
        self.prefix_hits = Counter(
            "phalanx:prefix_cache_hits", "Prefix-cache hits, in tokens.", e, registry=r
        )
        self.num_preemptions = Counter("phalanx:num_preemptions", "Preempted requests.", e, registry=r)
        self.spec_drafts = Counter("phalanx:spec_decode_num_drafts", "Speculative drafts.", e, registry=r)
        self.spec_draft_tokens = Counter(
            "phalanx:spec_decode_num_draft_tokens", "Speculative draft tokens.", e, registry=r
        )
        self.spec_accepted = Counter(
            "phalanx:spec_decode_num_accepted_tokens", "Accepted speculative tokens.", e, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "phalanx:spec_decode_num_accepted_tokens_per_pos",
            "Accepted speculative tokens by draft position.",
            e + ["position"],
            registry=r,
        )
        self.spec_draft_length = Counter(
            "phalanx:spec_decode_draft_length",
            "Requests reaching their end given this draft length for the next step (0..k: the request's "
            "cap, disable_by_batch_size or the adaptive policy).",
            e + ["length"],
            registry=r,
        )
        self.spec_parked = Counter(
            "phalanx:spec_decode_num_parked_requests",
            "Requests the adaptive policy parked on arrival (run without drafts: it had drafted nothing "
            "for a while).",
            e,
            registry=r,
        )
        self.rank_deaths = Counter(
            "phalanx:engine_rank_deaths", "Engine rank processes that died or failed while serving.", e, registry=r
        )
        self.rank_restarts = Counter(
            "phalanx:engine_rank_restarts", "Replacement engine rank processes started.", e, registry=r
        )
        self.group_reformations = Counter(
            "phalanx:engine_group_reformations", "Lockstep groups re-formed after a rank died.", m, registry=r
        )
        self.replayed_requests = Counter(
            "phalanx:replayed_requests",
            "Engine requests (samples) resubmitted to another rank, with the tokens produced so far, after "
            "their rank died.",
            m,
            registry=r,
        )
        self.ranks_given_up = Gauge(
            "phalanx:engine_ranks_given_up", "Ranks that died more often than the restart budget allows.", m,
            registry=r,
        )
        self.rank_up = Gauge("phalanx:engine_rank_up", "1 while the rank serves, 0 otherwise.", e, registry=r)
        self.recovery_time = Histogram(
            "phalanx:engine_recovery_seconds",
            "From a rank's death (as noticed) to the first token of a request it held, produced by another "
            "rank or by the re-formed group.",
            m,
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self._last: dict[int, _RankCounters] = {}
        self.latest_stats: dict[int, SchedulerStats] = {}
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    # ---- per-request events (API server) ----------------------------------------------------
    def on_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)
        self.total_prompt_tokens += num_tokens

    def on_tokens(self, num_tokens: int, ttft: float | None, itl: float | None) -> None:
        """`num_tokens` new tokens arrived for one sample; `ttft` if they are its first."""
        if num_tokens <= 0:
            return
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        self.total_generation_tokens += num_tokens
        if ttft is not None:
            self.ttft.labels(self.model_name).observe(ttft)
        elif itl is not None:
            per_token = itl / num_tokens
            for _ in range(num_tokens):
                self.itl.labels(self.model_name).observe(per_token)

    def on_finished(self, finish_reasons: list[str], e2e: float) -> None:
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e)

    # ---- engine stats -----------------------------------------------------------------------
    def on_stats(self, rank: int, s: SchedulerStats, restart: bool = False) -> None:
        """A rank's latest scheduler stats. `restart`: its process was replaced, so its cumulative
        counters start again from `s` (zeros) instead of being compared with the old process's."""
        if restart:
            self._last[rank] = _RankCounters()
        self.latest_stats[rank] = s
        labels = (self.model_name, str(rank))
        self.num_running.labels(*labels).set(s.num_running)
        self.num_waiting.labels(*labels).set(s.num_waiting)
        self.kv_usage.labels(*labels).set(s.kv_cache_usage)
        last = self._last.setdefault(rank, _RankCounters())
        _inc(self.num_preemptions.labels(*labels), s.num_preemptions - last.preemptions)
        _inc(self.prefix_queries.labels(*labels), s.prefix_cache_queries - last.prefix_queries)
        _inc(self.prefix_hits.labels(*labels), s.prefix_cache_hits - last.prefix_hits)
        _inc(self.spec_drafts.labels(*labels), s.spec_num_drafts - last.spec_drafts)
        _inc(self.spec_draft_tokens.labels(*labels), s.spec_num_draft_tokens - last.spec_draft_tokens)
        _inc(self.spec_accepted.labels(*labels), s.spec_num_accepted_tokens - last.spec_accepted)
        for pos, count in enumerate(s.spec_accepted_per_pos):
            before = last.spec_per_pos[pos] if pos < len(last.spec_per_pos) else 0
            _inc(self.spec_accepted_per_pos.labels(*labels, str(pos)), count - before)
        for length, count in enumerate(s.spec_draft_lengths):
            before = last.spec_draft_lengths[length] if length < len(last.spec_draft_lengths) else 0
            _inc(self.spec_draft_length.labels(*labels, str(length)), count - before)
        _inc(self.spec_parked.labels(*labels), s.spec_num_parked - last.spec_parked)
        self._last[rank] = _RankCounters(
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.spec_num_drafts,
            s.spec_num_draft_tokens,
            s.spec_num_accepted_tokens,
            list(s.spec_accepted_per_pos),
            s.num_preemptions,
            list(s.spec_draft_lengths),
            s.spec_num_parked,
        )

    # ---- recovery ---------------------------------------------------------------------------
    def on_rank_up(self, rank: int, up: bool) -> None:
        self.rank_up.labels(self.model_name, str(rank)).set(1 if up else 0)

    def on_rank_death(self, rank: int) -> None:
        self.rank_deaths.labels(self.model_name, str(rank)).inc()
        self.on_rank_down(rank)

    def on_rank_down(self, rank: int) -> None:
        """The rank's process is gone (dead, or taken down with its lockstep group): nothing runs or
        waits there and it holds no KV blocks."""
        self.on_rank_up(rank, False)
        self.on_stats(rank, SchedulerStats(), restart=True)

    def on_rank_restart(self, rank: int) -> None:
        self.rank_restarts.labels(self.model_name, str(rank)).inc()

    def on_group_reformed(self) -> None:
        self.group_reformations.labels(self.model_name).inc()

    def on_replayed(self, num_requests: int) -> None:
        self.replayed_requests.labels(self.model_name).inc(num_requests)

    def on_given_up(self, num_ranks: int) -> None:
        self.ranks_given_up.labels(self.model_name).set(num_ranks)

    def on_recovered(self, seconds: float) -> None:
        self.recovery_time.labels(self.model_name).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _inc(counter: Counter, amount: float) -> None:
    if amount > 0:
        counter.inc(amount)


@dataclass
class _Snapshot:
    time: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_per_pos: list[int] = field(default_factory=list)


class StatLogger:
    """Logs one summary line per interval while the engine is busy (or was since the last line)."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics
        self._prev = self._snapshot()

    def _snapshot(self) -> _Snapshot:
        m = self.metrics
        snap = _Snapshot(time.monotonic(), m.total_prompt_tokens, m.total_generation_tokens)
        for s in m.latest_stats.values():
            snap.prefix_queries += s.prefix_cache_queries
            snap.prefix_hits += s.prefix_cache_hits
            snap.spec_drafts += s.spec_num_drafts
            snap.spec_accepted += s.spec_num_accepted_tokens
            for pos, count in enumerate(s.spec_accepted_per_pos):
                if pos >= len(snap.spec_per_pos):
                    snap.spec_per_pos.append(0)
                snap.spec_per_pos[pos] += count
        return snap

    def summary(self) -> str | None:
        """The line for the interval since the previous call, or None when nothing happened."""
        now, prev = self._snapshot(), self._prev
        stats = list(self.metrics.latest_stats.values())
        running = sum(s.num_running for s in stats)
        waiting = sum(s.num_waiting for s in stats)
        idle = (
            running == 0
            and waiting == 0
            and now.prompt_tokens == prev.prompt_tokens
            and now.generation_tokens == prev.generation_tokens
        )
        self._prev = now
        if idle:
            return None
        dt = max(now.time - prev.time, 1e-9)
        kv = max((s.kv_cache_usage for s in stats), default=0.0)
        # A replaced rank's counters restart from zero: an interval with a restart can go negative.
        queries = max(now.prefix_queries - prev.prefix_queries, 0)
        hits = max(now.prefix_hits - prev.prefix_hits, 0)
        line = (
            f"prompt throughput: {(now.prompt_tokens - prev.prompt_tokens) / dt:.1f} tok/s, "
            f"generation throughput: {(now.generation_tokens - prev.generation_tokens) / dt:.1f} tok/s, "
            f"running: {running} reqs, waiting: {waiting} reqs, KV-cache usage: {kv * 100:.1f}%, "
            f"prefix-cache hit rate: {(hits / queries * 100) if queries else 0.0:.1f}%"
        )
        drafts = now.spec_drafts - prev.spec_drafts
        if drafts > 0:
            accepted = now.spec_accepted - prev.spec_accepted
            per_pos = [
                (c - (prev.spec_per_pos[i] if i < len(prev.spec_per_pos) else 0)) / drafts
                for i, c in enumerate(now.spec_per_pos)
            ]
            line += (
                f", spec decode: mean acceptance length {1 + accepted / drafts:.2f}, "
                f"per-position acceptance rate {', '.join(f'{r:.3f}' for r in per_pos)}"
            )
        return line

    def log(self) -> None:
        line = self.summary()
        if line is not None:
            logger.info("%s", line)
