"""Benchmark tooling: metric math, arrivals, prompt sources, Prometheus parsing. No model, no server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from phalanx.bench.datasets import load_jsonl, random_prompts, sample_lengths
from phalanx.bench.metrics import (
    RequestResult,
    describe,
    parse_prometheus,
    percentile,
    spec_acceptance,
    spec_counters,
    summarize,
)
from phalanx.bench.serve import _chunk_text, arrival_delays, base_url_of, request_body


def _req(start: float, chunks: list[float], end: float, tokens: int, prompt_len: int = 10) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=tokens, start=start,
                         chunk_times=chunks, end=end)


# ---- metric math ---------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    d = describe([1.0, 2.0, 3.0], (50, 99))
    assert d["mean"] == 2.0 and d["median"] == 2.0 and d["p50"] == 2.0 and d["p99"] == pytest.approx(2.98)


def test_ttft_tpot_itl_from_timestamps() -> None:
    # start 0, chunks at 0.1, 0.3, 0.6, end 0.6, 4 tokens (one chunk carried 2, as with speculation)
    r = _req(0.0, [0.1, 0.3, 0.6], 0.6, tokens=4)
    assert r.ttft == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.1) / 3)
    assert r.itls == pytest.approx([0.2, 0.3])
    assert _req(0.0, [0.2], 0.2, tokens=1).tpot is None  # TPOT needs >= 2 tokens
    assert RequestResult().ttft is None


def test_summarize_aggregates_and_counts_failures() -> None:
    ok1 = _req(0.0, [0.1, 0.2, 0.3], 0.3, tokens=3)
    ok2 = _req(1.0, [1.3, 1.5], 1.5, tokens=2, prompt_len=20)
    bad = RequestResult(success=False, error="HTTP 500: boom")
    s = summarize([ok1, ok2, bad], duration_s=2.0, percentiles=(50, 99))
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["total_output_tokens"] == 5 and s["total_input_tokens"] == 30
    assert s["output_throughput"] == 2.5 and s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == 17.5
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 200.0) / 2)  # ok1: 200/2, ok2: 200/1
    assert s["itl_ms"]["median"] == pytest.approx(100.0)  # pooled ITLs [100, 100, 200]
    assert s["itl_ms"]["mean"] == pytest.approx(400.0 / 3)
    assert s["e2el_ms"]["p50"] == pytest.approx(400.0)


def test_summarize_with_nothing_successful_is_nan_not_an_error() -> None:
    s = summarize([RequestResult(error="x")], duration_s=1.0)
    assert s["completed"] == 0 and math.isnan(s["ttft_ms"]["mean"])


# ---- arrivals --------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_and_have_the_right_mean() -> None:
    a = arrival_delays(20000, request_rate=4.0, seed=7)
    assert a == arrival_delays(20000, request_rate=4.0, seed=7)
    assert a != arrival_delays(20000, request_rate=4.0, seed=8)
    assert np.mean(a) == pytest.approx(0.25, rel=0.03)
    assert np.std(a) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert min(a) >= 0.0


def test_infinite_rate_sends_everything_at_once_and_bad_rate_is_rejected() -> None:
    assert arrival_delays(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        arrival_delays(5, 0.0)


# ---- prompts -------------------------------------------------------------------------------------
def test_random_prompts_lengths_and_seed() -> None:
    rng = np.random.default_rng(0)
    lens = sample_lengths(100, 0.5, 1000, rng)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 50
    assert sample_lengths(64, 0.0, 3, rng) == [64, 64, 64]
    with pytest.raises(ValueError, match="range_ratio"):
        sample_lengths(10, 1.5, 1, rng)
    p = random_prompts(4, 32, 8, seed=1, vocab_size=50)
    assert [len(x.prompt) for x in p] == [32] * 4 and all(x.output_len == 8 for x in p)
    assert all(0 <= t < 50 for x in p for t in x.prompt)
    assert p == random_prompts(4, 32, 8, seed=1, vocab_size=50)
    text = random_prompts(2, 16, 8, seed=1, as_ids=False)
    assert all(isinstance(x.prompt, str) and len(x.prompt.split()) == 16 for x in text)


def test_jsonl_loader_fields_cycling_and_errors(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"question": "What is 2 + 2?", "answer": "4"}, {"prompt": "Say hi"}, {"text": "three words here"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_jsonl(path)
    assert [p.prompt for p in got] == ["What is 2 + 2?", "Say hi", "three words here"]
    assert got[2].prompt_len == 3 and got[0].output_len is None
    cycled = load_jsonl(path, num_prompts=5, output_len=32)
    assert [p.prompt for p in cycled][3:] == ["What is 2 + 2?", "Say hi"] and cycled[0].output_len == 32
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{"answer": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no string field"):
        load_jsonl(bad)
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not valid JSON"):
        load_jsonl(tmp_path / "broken.jsonl")


def test_jsonl_chat_conversations_are_sent_whole(tmp_path) -> None:
    import argparse

    from phalanx.bench.offline import _engine_inputs
    from phalanx.engine.tokenizer import load_tokenizer, render_chat

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 * 7 - 5?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"prompt": "Say hi"}) + "\n")
    got = load_jsonl(path, num_prompts=3)
    assert got[0].messages == tuple(conv) and got[1].messages is None and got[2].messages == tuple(conv)
    assert got[0].prompt == "Be brief.\nWhat is 12 * 7 - 5?"  # no tokenizer: the contents, for the estimate
    args = argparse.Namespace(model="m", temperature=0.0, ignore_eos=False, request_seed=None, endpoint="chat")
    assert request_body(args, got[0])["messages"] == conv
    assert request_body(args, got[1])["messages"] == [{"role": "user", "content": "Say hi"}]
    args.endpoint = "completions"
    with pytest.raises(ValueError, match="--endpoint chat"):
        request_body(args, got[0])

    # With a tokenizer: the prompt is the chat template's rendering, counted and fed as LLM.chat feeds it.
    tok = load_tokenizer("phalanx-math")
    text = render_chat(tok, conv)
    with_tok = load_jsonl(path, tokenizer=tok)
    ids = list(tok(text, add_special_tokens=False).input_ids)
    assert with_tok[0].prompt == ids and with_tok[0].prompt_len == len(ids)
    assert request_body(argparse.Namespace(**{**vars(args), "endpoint": "chat"}), with_tok[0])["messages"] == conv
    inputs, _ = _engine_inputs(with_tok)
    assert inputs == [{"prompt_token_ids": ids}, {"prompt": "Say hi"}]
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"chat.jsonl:1: .*no chat template"):
        load_jsonl(path, tokenizer=tok)

    for bad_messages, match in (([], "non-empty list"), ([{"role": "robot", "content": "x"}], r"messages\[0\]"),
                                ([{"role": "user", "content": 3}], r"messages\[0\]"), ("hi", "non-empty list")):
        bad = tmp_path / "bad_chat.jsonl"
        bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": bad_messages}) + "\n")
        with pytest.raises(ValueError, match=rf"bad_chat.jsonl:2: .*{match}"):
            load_jsonl(bad)


def test_demo_eval_split_loads() -> None:
    got = load_jsonl("evals/phalanx-math/phalanx_math_test.jsonl", num_prompts=3)
    assert len(got) == 3 and all(p.prompt for p in got)


# ---- Prometheus ------------------------------------------------------------------------------------
PHALANX_METRICS = """\
# HELP phalanx:spec_decode_num_drafts_total Speculative drafts.
# TYPE phalanx:spec_decode_num_drafts_total counter
phalanx:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
phalanx:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0
# TYPE phalanx:spec_decode_num_draft_tokens_total counter
phalanx:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
phalanx:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 18.0
# TYPE phalanx:spec_decode_num_accepted_tokens_total counter
phalanx:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
phalanx:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 4.0
# TYPE phalanx:num_requests_running gauge
phalanx:num_requests_running{engine="0",model_name="m"} 2.0
"""

VLLM_METRICS = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
"""


def test_prometheus_parser_sums_over_labels_and_reads_both_prefixes() -> None:
    m = parse_prometheus(PHALANX_METRICS)
    assert m["phalanx:num_requests_running"] == 2.0
    assert spec_counters(m) == {"num_drafts": 16.0, "num_draft_tokens": 48.0, "num_accepted_tokens": 24.0}
    assert spec_counters(parse_prometheus(VLLM_METRICS)) == {
        "num_drafts": 4.0, "num_draft_tokens": 12.0, "num_accepted_tokens": 12.0}
    assert spec_counters(parse_prometheus("# TYPE x counter\nx_total 1.0\n")) is None


def test_spec_acceptance_is_the_difference_over_the_run() -> None:
    before = {"num_drafts": 6.0, "num_draft_tokens": 18.0, "num_accepted_tokens": 4.0}
    after = spec_counters(parse_prometheus(PHALANX_METRICS))
    acc = spec_acceptance(before, after)
    assert acc["num_drafts"] == 10.0 and acc["mean_acceptance_length"] == pytest.approx(3.0)
    assert acc["acceptance_rate"] == pytest.approx(20.0 / 30.0)
    assert spec_acceptance(after, after) is None  # no drafts during the run
    assert spec_acceptance(None, None) is None


# ---- request bodies and SSE chunks --------------------------------------------------------------------
def test_request_body_and_chunks() -> None:
    import argparse

    from phalanx.bench.datasets import BenchPrompt

    args = argparse.Namespace(model="m", temperature=0.0, ignore_eos=True, request_seed=None, endpoint="chat")
    body = request_body(args, BenchPrompt("hi", 1, 8))
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    args.endpoint, args.ignore_eos = "completions", False
    body = request_body(args, BenchPrompt([1, 2], 2, None))
    assert body["prompt"] == [1, 2] and "max_tokens" not in body and "ignore_eos" not in body
    assert _chunk_text({"choices": [{"delta": {"content": "a"}}]}) == "a"
    assert _chunk_text({"choices": [{"text": "b"}]}) == "b"
    assert _chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert base_url_of("http://h:1/v1/") == "http://h:1" and base_url_of("http://h:1") == "http://h:1"


def test_bench_cli_parses_all_three_subcommands() -> None:
    import argparse

    from phalanx.bench.cli import add_bench_subparser

    parser = argparse.ArgumentParser()
    add_bench_subparser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["bench", "serve", "--model", "m", "--request-rate", "inf", "--max-concurrency", "4"])
    assert a.bench_command == "serve" and math.isinf(a.request_rate) and a.max_concurrency == 4
    a = parser.parse_args(["bench", "latency", "--model", "m", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert a.speculative_config["method"] == "ngram"
    a = parser.parse_args(["bench", "throughput", "--model", "m", "--num-prompts", "8"])
    assert a.num_prompts == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--model", "m", "--request-rate", "0"])


async def _serve_once(handler, go):  # noqa: ANN001, ANN202
    """Run `go(base_url)` against a loopback aiohttp server answering every request with `handler`."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port the OS chose
    try:
        return await go(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_send_request_parses_sse_usage_and_http_errors() -> None:
    import asyncio

    from aiohttp import web

    from phalanx.bench.serve import client_session, send_request

    chunks = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "bc"}]},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({"body": await request.json(), "auth": request.headers.get("Authorization")})
        if request.path == "/fail":
            return web.json_response({"error": {"message": "bad"}}, status=400)
        return web.Response(text=sse, content_type="text/event-stream")

    async def go(base: str) -> tuple:
        async with client_session(30.0, api_key="k") as client:
            ok = await send_request(client, f"{base}/v1/completions", {"n": 1}, 5)
            bad = await send_request(client, f"{base}/fail", {}, 5)
        return ok, bad

    ok, bad = asyncio.run(_serve_once(handler, go))
    assert ok.success and ok.output_tokens == 3 and ok.prompt_len == 7 and len(ok.chunk_times) == 2
    assert ok.start <= ok.chunk_times[0] <= ok.end
    assert not bad.success and bad.error.startswith("HTTP 400") and "bad" in bad.error
    assert seen[0] == {"body": {"n": 1}, "auth": "Bearer k"}


def test_send_request_reads_the_stream_to_its_end_in_any_pieces() -> None:
    """Lines split across network writes (and one longer than aiohttp's line limit) are put back
    together; after [DONE] the client drains the body (an unread response closes its connection,
    so every request would open a new one) and parses nothing more."""
    import asyncio

    from aiohttp import web

    from phalanx.bench.serve import client_session, send_request

    long_text = "x" * 300_000
    drained = []
    client_ports = []

    async def handler(request: web.Request) -> web.StreamResponse:
        client_ports.append(request.transport.get_extra_info("peername")[1])
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        whole = (f'data: {{"choices": [{{"index": 0, "text": "{long_text}"}}]}}\n\n'
                 'data: {"choices": [{"index": 0, "text": "b"}]}\n\n').encode()
        for i in range(0, len(whole), 7001):
            await response.write(whole[i:i + 7001])
            await asyncio.sleep(0)
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05)  # the client has read [DONE] before the rest comes
        await response.write(b"data: {not json after the end\n\n")
        drained.append(True)
        await response.write_eof()
        return response

    async def go(base: str):  # noqa: ANN202
        async with client_session(30.0) as client:
            first = await send_request(client, f"{base}/v1/completions", {}, 5)
            second = await send_request(client, f"{base}/v1/completions", {}, 5)
            return first, second

    for result in asyncio.run(_serve_once(handler, go)):
        assert result.success and not result.error and result.output_tokens == 2 and len(result.chunk_times) == 2
    assert drained == [True, True]
    assert client_ports[0] == client_ports[1]  # the second request reused the first's connection
