"""Faults survived, nothing lost: `phalanx serve -dp 2` with a rank killed (SIGKILL) during
prefill, inside the drafter mid-decode, while idle, inside a lockstep collective of a drafter pass
and mid-decode from outside, for dense independent ranks with an EAGLE head and for MoE
expert-parallel (lockstep) ranks with an MoE draft model (the demo models, bf16 on the
batch-invariant kernels).

Every request — greedy and seeded sampled, streamed and not, n = 2, stop strings, logprobs —
completes with exactly the text (and finish reason) of an undisturbed run (the offline `LLM`
without speculation); the server keeps serving (`/health` 200 while a rank serves), counts the
deaths, restarts and replays in `/metrics`, returns every KV block (usage 0 when idle), and
leaves no process behind. A restart budget of 0 gives a rank up; when none is left the server
fails fast (503 `engine_dead`, exit 1).

Kill points inside a step come from PHALANX_DEBUG_KILL_AT (a rank's first process SIGKILLs itself
there); the others are `kill -9` by PID, on observed events. Deadlines are ceilings against a hang,
never the property.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from phalanx import LLM, SamplingParams
from phalanx.checkpoint import resolve_model_path
from phalanx.engine.core_process import STEP_DELAY_ENV
from phalanx.engine.fault_injection import KILL_AT_ENV
from phalanx.engine.tokenizer import load_tokenizer
from tests.dp.harness import process_alive
from tests.e2e.conftest import MODEL_NAME, ServerProcess, start_server
from tests.e2e.test_server_lifecycle import gauge_sum, metrics, wait_for
from tests.tiny_models import make_model

pytestmark = pytest.mark.slow  # servers with several engine processes, restarted under load


def _prompts(n: int, seed: int, long: bool) -> list[list[int]]:
    """Demo-style questions as token ids (so the server and the offline reference see the same ids);
    `long`: several questions in one prompt (~125 tokens: prefill spans many chunked steps)."""
    from phalanx.demo.tokenizer import prompt_text

    tok = load_tokenizer(resolve_model_path("phalanx-math"))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        qs = [f"What is {rng.randint(2, 99)} + {rng.randint(2, 99)}?" for _ in range(12 if long else 1)]
        out.append(tok(prompt_text(" ".join(qs)), add_special_tokens=False)["input_ids"])
    return out


def _requests(prompts: list[list[int]], seed: int, max_tokens: int) -> list[dict]:
    """A mix: greedy streams, greedy with stop strings, seeded n = 2 streams, seeded with logprobs."""
    rng = random.Random(seed)
    reqs = []
    for i, p in enumerate(prompts):
        kind = ["greedy", "stop", "seeded_n2", "seeded_logprobs"][i % 4]
        body: dict = {"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}
        if kind in ("greedy", "stop"):
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_k=50, seed=rng.randrange(2**31))
        if kind == "stop":
            body["stop"] = ["1", "= 9"]
            body["ignore_eos"] = False
        if kind == "seeded_n2":
            body["n"] = 2
        if kind == "seeded_logprobs":
            body["logprobs"] = 2
        body["stream"] = kind in ("greedy", "seeded_n2") or i % 3 == 0
        reqs.append(body)
    return reqs


def _reference(model: str, reqs: list[dict]) -> list[list[tuple[str, str]]]:
    """The undisturbed run: one rank, no speculation, each request's (text, finish reason) per choice."""
    llm = LLM(model, max_model_len=512, kv_cache_space=0.05)
    params = []
    for b in reqs:
        kw = {k: b[k] for k in ("max_tokens", "temperature", "top_k", "seed", "n", "ignore_eos", "logprobs") if k in b}
        params.append(SamplingParams(stop=b.get("stop", []), **kw))
    outs = llm.generate([{"prompt_token_ids": b["prompt"]} for b in reqs], params, use_tqdm=False)
    return [[(c.text, c.finish_reason) for c in o.outputs] for o in outs]


async def _one(client: httpx.AsyncClient, body: dict, first_text: asyncio.Event) -> list[tuple[str, str]]:
    if not body["stream"]:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return [(c["text"], c["finish_reason"]) for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
    texts = [""] * body.get("n", 1)
    finish: list[str | None] = [None] * len(texts)
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk  # a stream simply continues: never an error event
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
                if c["text"]:
                    first_text.set()
    return list(zip(texts, finish))


async def _run(base_url: str, reqs: list[dict], when_text=None):  # noqa: ANN001, ANN202
    """Send every request at once; `when_text()` runs once some stream has shown text."""
    first_text = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        tasks = [asyncio.create_task(_one(client, b, first_text)) for b in reqs]
        if when_text is not None:
            await asyncio.wait_for(first_text.wait(), 120)  # a ceiling against a hang
            when_text()
        return await asyncio.wait_for(asyncio.gather(*tasks), 150)


def _assert_same(got: list, want: list, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"{what}: request {i} differs from the undisturbed run:\n got {g}\nwant {w}"


def _pid_of(server: ServerProcess, rank: int) -> int:
    """The rank's current process (the last 'ready' line for it)."""
    return int(re.findall(rf"engine rank {rank} ready \(pid (\d+)", server.log())[-1])


def _value(base_url: str, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, lab), v in metrics(base_url).items() if n == name and all(x in lab for x in want))


def _idle_and_clean(base_url: str) -> None:
    """Every block returned and nothing running on any rank (the ceiling guards a hang)."""
    def clean() -> bool:
        m = metrics(base_url)
        usage = [v for (n, _), v in m.items() if n == "phalanx:kv_cache_usage_perc"]
        return bool(usage) and all(u == 0 for u in usage) and gauge_sum(m, "phalanx:num_requests_running") == 0
    wait_for(clean, timeout=60, what="KV usage 0 and nothing running")


def _both_ready(base_url: str) -> None:
    wait_for(lambda: gauge_sum(metrics(base_url), "phalanx:engine_rank_up") == 2, timeout=120,
             what="both ranks serving")


def _stop_and_check_no_orphans(server: ServerProcess) -> None:
    pids = server.engine_pids()  # every process any rank ever had
    assert server.stop() == 0, server.log()[-3000:]
    wait_for(lambda: not any(process_alive(p) for p in pids), timeout=30, what="every engine process gone")


def test_dense_ranks_with_eagle_survive_kills_in_prefill_drafter_and_idle(tmp_path: Path) -> None:
    """Rank 0 dies at its 4th step (of 32 tokens: its 8 requests of ~125 prompt tokens are still in
    prefill); its requests move to rank 1, which later dies inside the EAGLE drafter (step 40: the
    16 requests' prefills alone take >= 60 steps, so some decode and some still prefill); then rank
    0's replacement is killed while idle and a second batch arrives while it restarts. Every text
    equals the undisturbed run.

    Regression: requests that arrived while rank 0 was down got a 500 (the server read the context
    length from rank 0's ready report, which a dead rank no longer has)."""
    prompts = _prompts(16, seed=1, long=True)
    batch1 = _requests(prompts, seed=1, max_tokens=40)
    batch2 = _requests(_prompts(8, seed=2, long=False), seed=2, max_tokens=24)
    ref1, ref2 = _reference("phalanx-math", batch1), _reference("phalanx-math", batch2)
    spec = json.dumps({"method": "eagle", "model": "phalanx-math-eagle", "num_speculative_tokens": 3})
    server = start_server(Path("phalanx-math"), tmp_path / "s.log", "-dp", "2", "--speculative-config", spec,
                          "--max-model-len", "512", "--max-num-batched-tokens", "32", "--kv-cache-space", "0.05",
                          env={STEP_DELAY_ENV: "2", KILL_AT_ENV: "0:4:step,1:40:drafter"})
    try:
        base = server.base_url
        _assert_same(asyncio.run(_run(base, batch1)), ref1, "prefill + drafter kills")
        assert _value(base, "phalanx:engine_rank_deaths_total", engine="0") == 1
        assert _value(base, "phalanx:engine_rank_deaths_total", engine="1") == 1
        assert _value(base, "phalanx:replayed_requests_total") > 0
        assert _value(base, "phalanx:engine_recovery_seconds_count") >= 1
        _idle_and_clean(base)

        _both_ready(base)
        os.kill(_pid_of(server, 0), signal.SIGKILL)  # idle: nothing in flight
        wait_for(lambda: _value(base, "phalanx:engine_rank_deaths_total", engine="0") == 2, what="the death seen")
        assert httpx.get(f"{base}/health").status_code == 200  # rank 1 serves while rank 0 restarts
        _assert_same(asyncio.run(_run(base, batch2)), ref2, "requests while rank 0 restarts")
        _idle_and_clean(base)
        assert ") again after" in server.log() and "recovered from the failure of engine rank" in server.log()
    finally:
        _stop_and_check_no_orphans(server)


def test_moe_expert_parallel_with_moe_draft_survives_kills_in_a_collective_and_mid_decode(tmp_path: Path) -> None:
    """Lockstep: rank 1 dies inside a collective of drafter pass 2 (step 8, mid-decode); the group is
    re-formed and every rank's requests replayed; then rank 0's replacement is killed from outside
    once the second batch streams text; the group re-forms again. Every text equals one rank's."""
    batch1 = _requests(_prompts(8, seed=3, long=False), seed=3, max_tokens=32)
    batch2 = _requests(_prompts(8, seed=4, long=False), seed=4, max_tokens=32)
    ref1, ref2 = _reference("phalanx-math-moe", batch1), _reference("phalanx-math-moe", batch2)
    spec = json.dumps({"method": "draft_model", "model": "phalanx-math-moe-draft", "num_speculative_tokens": 3})
    server = start_server(Path("phalanx-math-moe"), tmp_path / "s.log", "-dp", "2", "--enable-expert-parallel",
                          "--speculative-config", spec, "--max-model-len", "512", "--kv-cache-space", "0.05",
                          "--dp-timeout", "30",
                          env={STEP_DELAY_ENV: "5", KILL_AT_ENV: "1:8:collective:drafter pass 2"})
    try:
        base = server.base_url
        _assert_same(asyncio.run(_run(base, batch1)), ref1, "kill in a drafter collective")
        assert _value(base, "phalanx:engine_group_reformations_total") == 1
        _both_ready(base)

        def kill_rank_0() -> None:
            os.kill(_pid_of(server, 0), signal.SIGKILL)

        _assert_same(asyncio.run(_run(base, batch2, when_text=kill_rank_0)), ref2, "kill mid-decode")
        assert _value(base, "phalanx:engine_group_reformations_total") == 2
        assert _value(base, "phalanx:engine_rank_deaths_total") == 2
        assert "re-forming the lockstep group" in server.log()
        _idle_and_clean(base)
    finally:
        _stop_and_check_no_orphans(server)


def test_a_rank_past_its_budget_is_given_up_then_the_last_one_fails_fast(tmp_path: Path) -> None:
    """--max-rank-restarts 0: rank 1's death gives it up (its requests finish on rank 0, /health stays
    200); rank 0's death then leaves no rank: in-flight requests get 503 engine_dead and the server
    exits 1."""
    model = make_model("LlamaForCausalLM", tmp_path / "tiny")
    server = start_server(model, tmp_path / "s.log", "-dp", "2", "--max-rank-restarts", "0",
                          "--max-model-len", "256", env={STEP_DELAY_ENV: "10"})
    try:
        base = server.base_url
        body = {"model": MODEL_NAME, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        reqs = [{**body, "prompt": [3 + i, 40 + i, 7]} for i in range(6)]
        llm = LLM(str(model), dtype="float32", max_model_len=256, kv_cache_space=0.02)
        want = [[(o.outputs[0].text, "length")] for o in llm.generate(
            [{"prompt_token_ids": r["prompt"]} for r in reqs],
            SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)]
        pid1 = _pid_of(server, 1)
        got = asyncio.run(_run(base, reqs, when_text=lambda: os.kill(pid1, signal.SIGKILL)))
        _assert_same(got, want, "requests of a given-up rank")
        assert _value(base, "phalanx:engine_ranks_given_up") == 1
        assert httpx.get(f"{base}/health").status_code == 200
        assert "not restarted again" in server.log()

        async def last_rank_dies() -> httpx.Response:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                task = asyncio.create_task(client.post("/v1/completions", json={
                    **body, "stream": False, "prompt": [5, 6, 7], "max_tokens": 200}))
                wait = time.monotonic() + 60  # a ceiling against a hang
                while gauge_sum(metrics(base), "phalanx:num_requests_running") < 1:
                    assert time.monotonic() < wait
                    await asyncio.sleep(0.05)
                os.kill(_pid_of(server, 0), signal.SIGKILL)
                return await task

        resp = asyncio.run(last_rank_dies())
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
        assert server.proc.wait(60) == 1  # fail-fast (the ceiling guards a hang)
        assert "every engine rank failed more often than the restart budget allows" in server.log()
    finally:
        pids = server.engine_pids()
        server.stop()
        wait_for(lambda: not any(process_alive(p) for p in pids), timeout=30, what="every engine process gone")
