"""Benchmark metric math: per-request timings -> TTFT / TPOT / ITL / E2E summaries, and /metrics parsing.

Owns: `RequestResult` (what one streamed request measured), `summarize` (the aggregate report, with
vLLM's definitions so figures compare with `vllm bench serve`), percentiles, and reading the
speculative-decoding counters (phalanx's and vLLM's names) from Prometheus text.
Does not own: sending requests (``serve``) or running the engine (``offline``).

Definitions (as in vLLM's serving benchmark):
* TTFT = first content chunk arrival - request start.
* TPOT = (E2E - TTFT) / (output_tokens - 1), per request with > 1 output token.
* ITL  = gaps between consecutive content chunks, pooled over all requests. With speculative
  decoding one chunk may carry several tokens, so ITL can exceed TPOT.
* Mean acceptance length = 1 + accepted / drafts (tokens produced per verification step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SPEC_PREFIXES: tuple[str, ...] = ("phalanx", "vllm")
SPEC_COUNTERS: tuple[str, ...] = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class RequestResult:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        # chunks at [0.10, 0.13, 0.17] -> ITLs [0.03, 0.04]
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as vLLM uses); NaN for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def describe(values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean, median, std and the given percentiles of `values`, keys like 'mean', 'p50', 'p99.9'."""
    arr = np.asarray(values, dtype=np.float64)
    out = {
        "mean": float(arr.mean()) if arr.size else math.nan,
        "median": float(np.median(arr)) if arr.size else math.nan,
        "std": float(arr.std()) if arr.size else math.nan,
    }
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Aggregate report over `results` measured in `duration_s` wall seconds. Latencies in ms."""
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    duration_s = max(duration_s, 1e-9)

    def ms(values: Iterable[float | None]) -> dict[str, float]:
        return {k: v * 1000.0 for k, v in describe([v for v in values if v is not None], percentiles).items()}

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success and r.error})[:10],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": ms(r.ttft for r in ok),
        "tpot_ms": ms(r.tpot for r in ok),
        "itl_ms": ms(x for r in ok for x in r.itls),
        "e2el_ms": ms(r.e2e for r in ok),
    }


def result_to_dict(r: RequestResult) -> dict[str, Any]:
    d = asdict(r)
    d.update(ttft=r.ttft, tpot=r.tpot, e2e=r.e2e)
    return d


# ---- Prometheus ---------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (e.g. over engine ranks).

    `phalanx:spec_decode_num_drafts_total{engine="0"} 3` and `{engine="1"} 4` -> {...: 7.0}.
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def spec_counters(metrics: dict[str, float]) -> dict[str, float] | None:
    """The three speculative counters under phalanx's or vLLM's prefix, or None when absent."""
    for prefix in SPEC_PREFIXES:
        names = {c: f"{prefix}:spec_decode_{c}_total" for c in SPEC_COUNTERS}
        if all(n in metrics for n in names.values()):
            return {c: metrics[n] for c, n in names.items()}
    return None


def spec_acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Acceptance over the run from counters read before and after it; None without speculation."""
    if after is None:
        return None
    before = before or {c: 0.0 for c in SPEC_COUNTERS}
    delta = {c: after[c] - before.get(c, 0.0) for c in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    if drafts <= 0:
        return None
    return {
        **delta,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else math.nan,
    }
