"""Process-level behaviour: disconnects free KV blocks, metrics, a dead engine fails fast and loudly,
start-up errors exit non-zero with a clear message, the CLI documents its flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.engine.core_process import STEP_DELAY_ENV, step_delay_s
from tests.dp.harness import process_alive
from tests.e2e.conftest import API_KEY, MODEL_NAME, REPO, ServerProcess, serve_command, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0.0}


def metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    return parse_metrics(httpx.get(f"{base_url}/metrics").text)


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def gauge_sum(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """Polls until `predicate()` holds; the timeout is a ceiling against a hang, never the property."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _explicit_threads() -> int:
    """A --num-threads value that differs from the default on this machine, so its effect shows."""
    from phalanx.engine.core_client import local_threads

    return 2 if local_threads(1) != 2 else 1


@pytest.fixture(scope="module")
def slow_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model generates 200 tokens in ~0.3 s, faster than a client can poll /metrics: every
    step sleeps 20 ms here so a request is reliably still running when the client walks away. Its
    engine runs an explicit --num-threads."""
    log_path = tmp_path_factory.mktemp("slow_server") / "server.log"
    srv = start_server(tiny_model, log_path, "--api-key", API_KEY, "--max-model-len", "256",
                       "--num-threads", str(_explicit_threads()), env={STEP_DELAY_ENV: "20"})  # fmt: skip
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code}:\n{srv.log()[-3000:]}"


def test_step_delay_setting() -> None:
    assert step_delay_s({}) == 0.0 and step_delay_s({STEP_DELAY_ENV: " "}) == 0.0
    assert step_delay_s({STEP_DELAY_ENV: "20"}) == pytest.approx(0.02)
    for bad in ("-1", "fast", "nan", "1e9"):
        with pytest.raises(ValueError, match=STEP_DELAY_ENV):
            step_delay_s({STEP_DELAY_ENV: bad})


def test_engine_threads_leave_a_core_for_the_front_end(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.engine import core_client

    for cores, ranks, reserved, want in [(2, 1, 1, 1), (16, 1, 1, 15), (16, 2, 1, 7), (2, 2, 1, 1), (1, 1, 1, 1),
                                         (16, 2, 0, 8), (2, 1, 0, 2)]:
        monkeypatch.setattr(core_client, "usable_cores", lambda c=cores: c)
        assert core_client.local_threads(ranks, None, reserved) == want, (cores, ranks, reserved)
        assert core_client.local_threads(ranks, 3, reserved) == 3  # --num-threads wins
    assert core_client.local_threads(1) == max(1, core_client.usable_cores() - 1)


def test_front_end_keeps_a_core_on_big_machines_and_for_small_models() -> None:
    from phalanx.checkpoint import resolve_model_path
    from phalanx.config import ModelConfig
    from phalanx.engine.core_client import SMALL_MODEL_PARAMS, front_end_cores

    small, big = SMALL_MODEL_PARAMS - 1, 135_000_000
    assert [front_end_cores(p, c) for p in (small, big, None) for c in (2, 3)] == [1, 1, 0, 0, 1, 1]
    assert [front_end_cores(p, c) for p in (small, big, None) for c in (4, 64)] == [1] * 6
    # the demo is small, SmolLM2-135M is not (attention + MLP of 30 layers + its 49152 x 576 lm_head)
    assert ModelConfig.from_hf(resolve_model_path("phalanx-math")).active_parameters() < SMALL_MODEL_PARAMS
    cfg = ModelConfig.from_hf(resolve_model_path("phalanx-math-moe"))
    assert cfg.active_parameters() < sum(3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts
                                         for _ in cfg.moe_layer_ids)  # only the routed experts count


def test_served_engine_logs_its_threads(server: ServerProcess) -> None:
    from phalanx.engine.core_client import local_threads

    assert f"engine rank 0: {local_threads(1)} torch thread(s)" in server.log()


def test_served_engine_freezes_its_start_up_heap(server: ServerProcess) -> None:
    """The engine process moves its start-up heap (torch, the model: ~10^5 objects) out of the
    collector's reach before serving (`core_process.freeze_start_up_heap`)."""
    line = next(ln for ln in server.log().splitlines() if "start-up objects frozen" in ln)
    assert int(line.split("engine rank 0: ")[1].split()[0]) > 10_000


def _torch_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "libtorch" in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_api_process_never_loads_torch(server: ServerProcess, http: httpx.Client) -> None:
    """The API process serves without torch (~240 MB resident); its engine ranks load it. Checked
    after requests went through, so nothing on a request's way imports it either
    (tests/unit/test_front_end_imports.py checks the same in-process)."""
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 4, "stream": True,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert _torch_libraries(server.proc.pid) == set()
    engines = server.engine_pids()
    assert engines and all(_torch_libraries(pid) for pid in engines)


def test_num_threads_flag_sets_the_engine_threads(slow_server: ServerProcess) -> None:
    """--num-threads reaches the engine process (its log line reports torch.get_num_threads())."""
    assert f"engine rank 0: {_explicit_threads()} torch thread(s)" in slow_server.log()


def test_stream_disconnect_frees_blocks(slow_server: ServerProcess) -> None:
    """A client that drops a stream mid-way aborts its request; its KV blocks come back."""
    url = slow_server.base_url
    abort_key = ("phalanx:request_success_total", (("finished_reason", "abort"),))
    aborts_before = metrics(url).get(abort_key, 0.0)
    generated_before = gauge_sum(metrics(url), "phalanx:generation_tokens_total")
    with (
        httpx.Client(base_url=url, headers=AUTH, timeout=30) as c,
        c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        wait_for(lambda: gauge_sum(metrics(url), "phalanx:kv_cache_usage_perc") > 0, what="KV blocks in use")
        assert gauge_sum(metrics(url), "phalanx:num_requests_running") == 1
    # Leaving the block closes the connection long before the 200 tokens (>= 4 s here) are done.
    wait_for(
        lambda: (
            gauge_sum(metrics(url), "phalanx:num_requests_running") == 0
            and gauge_sum(metrics(url), "phalanx:kv_cache_usage_perc") == 0.0
        ),
        what="the aborted request's blocks to be freed",
    )
    m = metrics(url)
    assert m[abort_key] == aborts_before + 1
    assert gauge_sum(m, "phalanx:generation_tokens_total") - generated_before < 200


def test_non_streaming_disconnect_frees_blocks(slow_server: ServerProcess) -> None:
    """A client that gives up on a non-streaming request aborts it too (not run to completion)."""
    import asyncio

    url = slow_server.base_url
    abort_key = ("phalanx:request_success_total", (("finished_reason", "abort"),))
    aborts_before = metrics(url).get(abort_key, 0.0)
    generated_before = gauge_sum(metrics(url), "phalanx:generation_tokens_total")

    async def give_up_once_running() -> None:
        # 16 samples of 240 tokens keep the engine busy (>= 4.8 s of 20 ms steps); the client walks away
        # as soon as the server reports them running.
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={**LONG, "max_tokens": 240, "n": 16}))
            deadline = time.monotonic() + 60  # a ceiling against a hang
            while gauge_sum(parse_metrics((await c.get("/metrics")).text), "phalanx:num_requests_running") == 0:
                assert time.monotonic() < deadline and not task.done(), "the request never showed as running"
                await asyncio.sleep(0.05)
            assert not task.done()
            task.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(give_up_once_running())
    wait_for(
        lambda: (
            gauge_sum(metrics(url), "phalanx:num_requests_running") == 0
            and gauge_sum(metrics(url), "phalanx:kv_cache_usage_perc") == 0.0
        ),
        what="the aborted request's blocks to be freed",
    )
    m = metrics(url)
    assert m[abort_key] == aborts_before + 1
    assert gauge_sum(m, "phalanx:generation_tokens_total") - generated_before < 240 * 16


def test_metrics_names(server: ServerProcess) -> None:
    url = server.base_url
    body = {**LONG, "prompt": "hello world " * 12, "max_tokens": 4}  # > 2 KV blocks of prompt
    for _ in range(2):  # the second one hits the prefix cache
        assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    wait_for(
        lambda: gauge_sum(metrics(url), "phalanx:prefix_cache_hits_total") > 0, what="a prefix-cache hit"
    )
    m = metrics(url)
    names = {n for n, _ in m}
    for name in (
        "phalanx:request_success_total",
        "phalanx:prompt_tokens_total",
        "phalanx:generation_tokens_total",
        "phalanx:time_to_first_token_seconds_count",
        "phalanx:inter_token_latency_seconds_count",
        "phalanx:e2e_request_latency_seconds_count",
        "phalanx:num_requests_running",
        "phalanx:num_requests_waiting",
        "phalanx:kv_cache_usage_perc",
        "phalanx:prefix_cache_queries_total",
        "phalanx:prefix_cache_hits_total",
    ):
        assert name in names, name
    assert m[("phalanx:request_success_total", (("finished_reason", "length"),))] >= 2
    assert gauge_sum(m, "phalanx:generation_tokens_total") >= 8
    assert gauge_sum(m, "phalanx:prefix_cache_hits_total") > 0
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    ):
        assert f"# TYPE phalanx:{name}_total counter" in text, name
    # The periodic stats line (every 1 s in these tests) reports throughput and cache state.
    wait_for(lambda: "generation throughput" in server.log(), what="the stats log line")
    line = next(ln for ln in server.log().splitlines() if "generation throughput" in ln)
    for part in ("prompt throughput", "running:", "waiting:", "KV-cache usage", "prefix-cache hit rate"):
        assert part in line


def test_dp2_spec_decode_then_engine_killed(tiny_model: Path, tmp_path: Path) -> None:
    """Two engine ranks (with n-gram speculative decoding) share the load and report per-rank and
    speculative stats. Killing one rank makes /health 503, fails in-flight requests promptly, shuts the
    other rank down, and the server exits non-zero within seconds (never a hang)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    # 10 ms per step: the 8 x 500-token request below runs >= 5 s, and the rank dies once it is running.
    srv = start_server(tiny_model, tmp_path / "dp.log", "-dp", "2", "--max-model-len", "512", "--no-recover",
                       "--speculative-config", spec, env={STEP_DELAY_ENV: "10"})  # fmt: skip
    try:
        pids = srv.engine_pids()
        assert len(pids) == 2
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            body = {**LONG, "prompt": "a b c " * 8, "max_tokens": 24, "return_spec_stats": True}
            for _ in range(4):
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                stats = r.json()["choices"][0]["spec_stats"]
                assert stats["num_draft_tokens"] > 0 and stats["num_verify_steps"] > 0
                assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
                assert 1.0 <= stats["mean_acceptance_length"] <= 3.0
            wait_for(
                lambda: (
                    {k for (n, k) in metrics(srv.base_url) if n == "phalanx:num_requests_running"}
                    == {(("engine", "0"),), (("engine", "1"),)}
                ),
                what="both ranks to report",
            )
            m = metrics(srv.base_url)
            assert gauge_sum(m, "phalanx:spec_decode_num_drafts_total") > 0
            assert gauge_sum(m, "phalanx:spec_decode_num_draft_tokens_total") >= gauge_sum(
                m, "phalanx:spec_decode_num_accepted_tokens_total"
            )
            assert gauge_sum(m, "phalanx:spec_decode_num_accepted_tokens_per_pos_total") == gauge_sum(
                m, "phalanx:spec_decode_num_accepted_tokens_total"
            )
            wait_for(lambda: "mean acceptance length" in srv.log(), what="the speculative stats log line")
            pool = ThreadPoolExecutor(1)
            blocking = pool.submit(c.post, "/v1/completions", json={**LONG, "max_tokens": 500, "n": 8})
            with c.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 500, "stream": True, "n": 2}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                wait_for(lambda: gauge_sum(metrics(srv.base_url), "phalanx:num_requests_running") == 10,
                         what="both requests' 10 samples to run")  # fmt: skip
                assert not blocking.done()
                os.kill(pids[1], signal.SIGKILL)
                rest = list(lines)  # the stream ends (the client's 30 s read timeout guards a hang)
            # The non-streaming request fails too instead of waiting for a rank that is gone (the
            # ceiling guards a hang; its 4000 tokens would take >= 5 s of steps on a live server).
            in_flight = blocking.result(timeout=120)
            pool.shutdown()
            assert in_flight.status_code == 503 and in_flight.json()["error"]["code"] == "engine_dead"
            assert any('"engine_dead"' in line for line in rest), rest[-3:]
            assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
            health = c.get("/health")
            assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
            try:
                r = c.post("/v1/completions", json={**LONG, "max_tokens": 3})
                assert r.status_code >= 500
            except httpx.TransportError:
                pass  # already shutting down
        assert srv.proc.wait(120) != 0  # exits on its own (the ceiling guards a hang)
        assert "exited with code -9" in srv.log()
        wait_for(lambda: not process_alive(pids[0]), what="the surviving rank to be shut down")
    finally:
        srv.stop()


def _cli(capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture, *args: str) -> tuple[int, str]:
    """Run `phalanx ARGS` in this process (fast: no interpreter start); returns (exit code, output)."""
    from phalanx.entrypoints.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse: --help, bad values
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err + caplog.text


def test_startup_errors_exit_nonzero(tmp_path: Path, tiny_model: Path, capsys, caplog) -> None:
    code, out = _cli(capsys, caplog, "serve", str(tmp_path / "missing"), "--port", "1")
    assert code == 2 and "does not exist" in out
    code, out = _cli(capsys, caplog, "serve", str(tiny_model), "--max-model-len", "100000", "--port", "1")
    assert code == 2 and "max_model_len" in out
    code, out = _cli(capsys, caplog, "serve", str(tiny_model), "-dp", "2", "--enable-expert-parallel", "--port", "1")
    assert code == 2 and "(--enable-expert-parallel) needs an MoE model; this one is dense" in out  # never silently ignored
    code, out = _cli(capsys, caplog, "serve", str(tiny_model), "--dp-lockstep", "--port", "1")
    assert code == 2 and "--dp-lockstep" in out and "-dp) > 1" in out  # one rank: nothing to step with
    code, out = _cli(capsys, caplog, "serve", str(tiny_model), "-dp", "2", "--dp-check-collectives", "--port", "1")
    assert code == 2 and "--dp-check-collectives" in out and "--dp-lockstep" in out  # independent ranks: none
    code, out = _cli(capsys, caplog, "serve", str(tiny_model), "--log-stats-interval", "-1", "--port", "1")
    assert code == 2 and "--log-stats-interval" in out and ">= 0" in out  # it used to mean "off", silently
    # Only the engine process finds this one (the KV cache cannot hold one full-length request):
    # the message travels back and the server exits 1 instead of hanging.
    r = subprocess.run(
        serve_command(tiny_model, "--port", "1", "--num-gpu-blocks-override", "2"),
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "failed to start" in r.stderr and "KV cache" in r.stderr


def test_cli_help_documents_every_flag(capsys, caplog) -> None:
    code, top = _cli(capsys, caplog, "--help")
    assert code == 0 and "serve" in top and "bench" in top
    code, serve = _cli(capsys, caplog, "serve", "--help")
    assert code == 0
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--dtype",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-space",
        "--block-size",
        "--seed",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--speculative-config",
        "--data-parallel-size",
        "-dp",
        "--log-level",
        "--log-stats-interval",
        "PHALANX_API_KEY",
    ):
        assert flag in serve, flag


def test_speculative_flag_errors(tiny_model: Path, capsys, caplog) -> None:
    """A malformed --speculative-config, or one the engine rejects, is a usage error (exit 2)."""
    code, out = _cli(
        capsys, caplog, "serve", str(tiny_model), "--speculative-config", "{not json", "--port", "1"
    )
    assert code == 2 and "JSON" in out
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    code, out = _cli(capsys, caplog, "serve", str(tiny_model), "--speculative-config", spec, "--port", "1")
    assert code == 2 and "num_speculative_tokens" in out


@pytest.mark.slow
def test_builtin_demo_serves_with_its_eagle_head(tmp_path: Path) -> None:
    """`phalanx serve phalanx-math` with the built-in EAGLE head (k = 3), both by name: it answers a
    held-out question correctly and its drafts are accepted."""
    import re

    from phalanx.demo.data import extract_answer

    row = json.loads((REPO / "evals/phalanx-math/phalanx_math_test.jsonl").open().readline())
    spec = json.dumps({"model": "phalanx-math-eagle", "num_speculative_tokens": 3})
    server = start_server("phalanx-math", tmp_path / "s.log", "--served-model-name", "phalanx-math",
                          "--speculative-config", spec, timeout=180)  # fmt: skip
    try:
        body = {"model": "phalanx-math", "messages": [{"role": "user", "content": row["question"]}],
                "temperature": 0, "max_tokens": 96}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert extract_answer(r.json()["choices"][0]["message"]["content"]) == extract_answer(row["answer"])
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        accepted = re.findall(r"^phalanx:spec_decode_num_accepted_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", metrics, re.M)
        assert accepted and sum(float(a) for a in accepted) > 0, metrics[-2000:]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
