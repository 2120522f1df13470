"""In-process checks of the server's building blocks: the engine wire protocol round-trips through
msgpack without pickle, and metrics turn per-rank cumulative stats into counters and a log line."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from phalanx.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from phalanx.engine.core_process import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    EngineFailed,
    EngineMessage,
    EngineOutputs,
    EngineProcessConfig,
    EngineReady,
    RequestFailed,
    Shutdown,
)
from phalanx.engine.metrics import ServingMetrics, StatLogger
from phalanx.engine.protocol import EngineCoreRequest
from phalanx.sampling_params import SamplingParams


def test_client_messages_round_trip() -> None:
    params = SamplingParams(n=1, temperature=0.5, stop=["x"], seed=3, max_tokens=None, logprobs=2)
    msgs = [
        AddRequest(EngineCoreRequest("r1", [1, 2, 3], params, 1.5)),
        AbortRequests(["r1", "r2"]),
        Shutdown(),
    ]
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    for msg in msgs:
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg


def test_engine_messages_round_trip() -> None:
    out = EngineCoreOutput(
        "r1", [5, 6], new_logprobs=[TokenLogprobs([5, 7], [-0.1, -2.0], 1)], finish_reason="stop", stop_reason=6,
        num_draft_tokens=4, num_accepted_tokens=3, num_verify_steps=2,
    )  # fmt: skip
    stats = SchedulerStats(
        num_running=1, kv_cache_usage=0.25, spec_num_drafts=2, spec_accepted_per_pos=[2, 1]
    )
    msgs = [
        EngineReady(0, 123, 64, 256, 320),
        EngineOutputs(1, [out], stats),
        EngineOutputs(0, [], None),
        RequestFailed(0, "r2", "too long"),
        EngineFailed(1, "boom"),
    ]
    decoder = msgspec.msgpack.Decoder(EngineMessage)
    for msg in msgs:
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg


def test_process_config_round_trip() -> None:
    cfg = EngineProcessConfig(
        {"model": "m", "speculative_config": {"method": "ngram"}}, 1, 2, "ipc://a", "ipc://b"
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineProcessConfig) == cfg


def test_metrics_from_cumulative_stats_and_log_line() -> None:
    m = ServingMetrics("tiny")
    logger = StatLogger(m)
    assert logger.summary() is None  # idle: no line
    m.on_prompt(10)
    m.on_tokens(1, ttft=0.05, itl=None)
    m.on_tokens(3, ttft=None, itl=0.03)
    m.on_finished(["stop", "length"], 0.2)
    m.on_stats(0, SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=32,
                                 prefix_cache_hits=16, spec_num_drafts=4, spec_num_draft_tokens=12,
                                 spec_num_accepted_tokens=6, spec_accepted_per_pos=[4, 2, 0]))  # fmt: skip
    m.on_stats(0, SchedulerStats(num_running=1, prefix_cache_queries=48, prefix_cache_hits=16, spec_num_drafts=6,
                                 spec_num_draft_tokens=18, spec_num_accepted_tokens=9,
                                 spec_accepted_per_pos=[6, 3, 0]))  # fmt: skip
    samples = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            key = (s.name, s.labels.get("position"), s.labels.get("finished_reason"))
            samples[key] = s.value
    assert samples[("phalanx:prefix_cache_queries_total", None, None)] == 48
    assert samples[("phalanx:prefix_cache_hits_total", None, None)] == 16
    assert samples[("phalanx:spec_decode_num_drafts_total", None, None)] == 6
    assert samples[("phalanx:spec_decode_num_accepted_tokens_per_pos_total", "1", None)] == 3
    assert samples[("phalanx:num_requests_running", None, None)] == 1
    assert samples[("phalanx:generation_tokens_total", None, None)] == 4
    assert samples[("phalanx:request_success_total", None, "stop")] == 1
    assert samples[("phalanx:inter_token_latency_seconds_count", None, None)] == 3
    line = logger.summary()
    assert line is not None
    assert "running: 1 reqs" in line and "prefix-cache hit rate: 33.3%" in line
    assert (
        "mean acceptance length 2.50" in line and "per-position acceptance rate 1.000, 0.500, 0.000" in line
    )
