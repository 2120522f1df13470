"""`phalanx serve -dp N` end to end: lockstep ranks behind the real API server.

* randomized concurrent load (>= 200 requests, bursts, dropped streams, client aborts) on MoE
  expert-parallel ranks with an MoE draft model, and on dense ranks forced into lockstep with an
  EAGLE head: every completed greedy request equals a single rank without speculation, token id
  for token id (read back from the completions' logprobs, whose token strings are one per id);
* two "nodes" on loopback: a head with rank 0 and a --headless node with rank 1;
* a rank killed mid-load: /health turns 503, in-flight requests fail, every process exits
  non-zero, nothing is left behind.

Deadlines here are ceilings against a hang (each test stays below pytest's 300 s), never the property.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from phalanx import LLM, SamplingParams
from phalanx.engine.core_process import STEP_DELAY_ENV
from phalanx.net import free_listen_ports
from tests.dp.harness import process_alive
from tests.e2e.conftest import MODEL_NAME, ServerProcess, serve_command, start_server
from tests.e2e.test_server_lifecycle import gauge_sum, metrics, parse_metrics
from tests.tiny_models import VOCAB, make_eagle_head, make_model

pytestmark = pytest.mark.slow  # each test starts servers with several engine processes under load


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpserve")
    dense = make_model("LlamaForCausalLM", root / "dense")
    return {
        "dense": dense,
        "eagle": make_eagle_head(dense, root / "eagle", "eagle"),
        "moe": make_model("MixtralForCausalLM", root / "moe"),
        "moe_draft": make_model("MixtralForCausalLM", root / "moe_draft", seed=7, num_hidden_layers=1),
    }


class TokenIds:
    """The server's logprob token strings back to ids: the tiny byte-level tokenizer gives every id its
    own string (checked), so comparing ids is exact where comparing decoded text would hide token
    differences behind U+FFFD."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        from phalanx.engine.detokenizer import detokenize_logprobs

        tok = AutoTokenizer.from_pretrained(model)
        strings = detokenize_logprobs(tok, list(range(len(tok))))
        self.ids = {s: i for i, s in enumerate(strings)}
        assert len(self.ids) == len(strings)

    def __call__(self, tokens: list[str]) -> list[int]:
        return [self.ids[t] for t in tokens]


def _requests(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(1, 40)
        base = [rng.randrange(3, VOCAB) for _ in range(max(plen // 2, 1))]
        kind = rng.choices(["plain", "stream", "drop", "abort"], weights=[45, 40, 8, 7])[0]
        out.append(dict(i=i, prompt=(base * 3)[:plen], max_tokens=rng.randint(1, 20), kind=kind,
                        delay=rng.choice([0.0, 0.0, rng.uniform(0, 3.0)])))
    return out


async def _one(client: httpx.AsyncClient, r: dict) -> tuple[int, list[str] | None, str | None]:
    """(request index, the output's token strings or None when the client left, finish reason)."""
    await asyncio.sleep(r["delay"])  # bursts at t=0, the rest spread out
    body = {"model": MODEL_NAME, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    if r["kind"] == "plain":
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        return r["i"], choice["logprobs"]["tokens"], choice["finish_reason"]
    if r["kind"] == "abort":  # the client gives up before the answer
        try:
            await client.post("/v1/completions", json={**body, "max_tokens": 200}, timeout=0.05)
        except httpx.TimeoutException:
            pass
        return r["i"], None, None
    tokens, finish, chunks = [], None, 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks += 1
            if r["kind"] == "drop" and chunks >= 2:
                return r["i"], None, None  # dropped stream: leave mid-answer
            for c in chunk["choices"]:
                tokens += (c["logprobs"] or {}).get("tokens") or []
                finish = c["finish_reason"] or finish
    return r["i"], tokens, finish


async def _load(base_url: str, reqs: list[dict], max_concurrency: int = 48, ceiling_s: float = 150.0
                ) -> list[tuple[int, list[str] | None, str | None]]:
    sem = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        async def bounded(r: dict):  # noqa: ANN202
            async with sem:
                return await _one(client, r)

        # A ceiling against a hang: with the server's start-up and the reference run, the test stays
        # below pytest's 300 s.
        return await asyncio.wait_for(asyncio.gather(*(bounded(r) for r in reqs)), timeout=ceiling_s)


def _reference(model: Path, reqs: list[dict]) -> dict[int, list[int]]:
    llm = LLM(str(model), dtype="float32", max_model_len=256, kv_cache_space=0.05)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    return {r["i"]: o.outputs[0].token_ids for r, o in zip(reqs, llm.generate(prompts, params, use_tqdm=False))}


def _check_load(server, model: Path, seed: int) -> None:  # noqa: ANN001
    reqs = _requests(200, seed)
    results = asyncio.run(_load(server.base_url, reqs))
    ref = _reference(model, reqs)
    token_ids = TokenIds(model)
    completed = [(i, tokens, fin) for i, tokens, fin in results if tokens is not None]
    assert len(completed) >= 150
    for i, tokens, finish in completed:
        assert finish == "length", i
        assert token_ids(tokens) == ref[i], f"request {i} differs from a single rank"
    # Aborted / dropped requests gave their blocks back: usage returns to 0 on every rank.
    deadline = time.monotonic() + 30  # a ceiling against a hang
    while time.monotonic() < deadline:
        now = metrics(server.base_url)
        usage = [v for (n, _), v in now.items() if n == "phalanx:kv_cache_usage_perc"]
        running = [v for (n, _), v in now.items() if n == "phalanx:num_requests_running"]
        if usage and all(u == 0 for u in usage) and all(r == 0 for r in running):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"KV blocks not returned: {usage}, running {running}")


def _drafts_by_rank(server: ServerProcess) -> dict[str, float]:
    """phalanx:spec_decode_num_drafts_total per engine rank (its `engine` label), from /metrics. The
    counter's HELP / TYPE lines show up whether or not anything drafted: the values are what count."""
    out: dict[str, float] = {}
    for (name, labels), value in metrics(server.base_url).items():
        if name == "phalanx:spec_decode_num_drafts_total":
            engine = dict(labels)["engine"]
            out[engine] = out.get(engine, 0.0) + value
    return out


def _assert_every_rank_drafted(server: ServerProcess) -> None:
    drafts = _drafts_by_rank(server)
    assert set(drafts) == {"0", "1"} and all(v > 0 for v in drafts.values()), drafts


def test_moe_expert_parallel_with_moe_draft_under_load(models: dict[str, Path], tmp_path: Path) -> None:
    spec = json.dumps({"method": "draft_model", "model": str(models["moe_draft"]), "num_speculative_tokens": 3})
    server = start_server(models["moe"], tmp_path / "s.log", "-dp", "2", "--enable-expert-parallel",
                          "--speculative-config", spec, "--dp-timeout", "30", "--max-model-len", "256")
    try:
        _check_load(server, models["moe"], seed=1)
        _assert_every_rank_drafted(server)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_dense_forced_lockstep_with_eagle_under_load(models: dict[str, Path], tmp_path: Path) -> None:
    spec = json.dumps({"model": str(models["eagle"]), "num_speculative_tokens": 3})
    server = start_server(models["dense"], tmp_path / "s.log", "-dp", "2", "--dp-lockstep",
                          "--speculative-config", spec, "--dp-check-collectives", "--max-model-len", "256")
    try:
        _check_load(server, models["dense"], seed=2)
        _assert_every_rank_drafted(server)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_dense_independent_ranks_with_eagle_under_load(models: dict[str, Path], tmp_path: Path) -> None:
    """Dense ranks without lockstep (the default): each is a plain engine; outputs still exact."""
    spec = json.dumps({"model": str(models["eagle"]), "num_speculative_tokens": 3})
    server = start_server(models["dense"], tmp_path / "s.log", "-dp", "2", "--speculative-config", spec,
                          "--max-model-len", "256")
    try:
        _check_load(server, models["dense"], seed=4)
        _assert_every_rank_drafted(server)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_two_nodes_on_loopback(models: dict[str, Path], tmp_path: Path) -> None:
    rpc = free_listen_ports(4)  # the head uses rpc .. rpc + 1 + dp
    common = ["-dp", "2", "--enable-expert-parallel", "--data-parallel-size-local", "1",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
              "--max-model-len", "256", "--kv-cache-space", "0.05"]
    log = open(tmp_path / "headless.log", "wb")  # noqa: SIM115 - the child keeps the descriptor
    headless = subprocess.Popen(
        serve_command(models["moe"], *common, "--data-parallel-start-rank", "1", "--headless"),
        cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        server = start_server(models["moe"], tmp_path / "head.log", *common)
        try:
            reqs = _requests(24, seed=3)
            for r in reqs:
                r["kind"] = "plain"
            results = asyncio.run(_load(server.base_url, reqs, ceiling_s=60))
            ref, token_ids = _reference(models["moe"], reqs), TokenIds(models["moe"])
            assert [token_ids(tokens) for _, tokens, _ in results] == [ref[i] for i, _, _ in results]
        finally:
            assert server.stop() == 0, server.log()[-3000:]
        assert headless.wait(120) == 0  # the head's Shutdown reached the remote rank (ceiling: a hang)
    finally:
        if headless.poll() is None:
            headless.kill()
        log.close()


def test_headless_node_stops_when_its_head_dies(models: dict[str, Path], tmp_path: Path) -> None:
    """Independent ranks: a remote rank cannot watch the head's process; the head's pings stop when
    it dies, and the remote rank leaves after --dp-timeout instead of idling forever."""
    rpc = free_listen_ports(4)
    common = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(rpc), "--dp-timeout", "3", "--max-model-len", "256",
              "--kv-cache-space", "0.05"]
    log_path = tmp_path / "headless.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child keeps the descriptor
    headless = subprocess.Popen(
        serve_command(models["dense"], *common, "--data-parallel-start-rank", "1", "--headless"),
        cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        # The silence clock only starts once the head speaks: the headless node, up and waiting, outlives
        # max(--dp-timeout, 5 s) of no head at all.
        deadline = time.monotonic() + 60  # a ceiling against a hang
        while "torch thread(s)" not in log_path.read_text(errors="replace"):
            assert headless.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        time.sleep(6)
        assert headless.poll() is None, log_path.read_text(errors="replace")
        server = start_server(models["dense"], tmp_path / "head.log", *common)
        local_pids = server.engine_pids()
        try:
            reqs = _requests(8, seed=5)
            for r in reqs:
                r["kind"] = "plain"
            results = asyncio.run(_load(server.base_url, reqs, ceiling_s=60))  # both ranks serve some
            ref, token_ids = _reference(models["dense"], reqs), TokenIds(models["dense"])
            assert [token_ids(tokens) for _, tokens, _ in results] == [ref[i] for i, _, _ in results]
            assert headless.poll() is None
            os.kill(server.proc.pid, signal.SIGKILL)  # the head dies without a Shutdown
            server.proc.wait(30)
            assert headless.wait(120) == 0  # it leaves on its own (the ceiling guards a hang)
        finally:
            server.stop()
            for pid in local_pids:  # the head's own rank left on its own (parent gone)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.2)
                else:
                    os.kill(pid, signal.SIGKILL)
                    raise AssertionError(f"the head's engine rank {pid} outlived it")
        log.flush()
        assert "silent" in log_path.read_text()  # it left because the head went silent
    finally:
        if headless.poll() is None:
            headless.kill()
        log.close()


def test_killing_a_lockstep_rank_mid_load(models: dict[str, Path], tmp_path: Path) -> None:
    # 20 ms per step: the 200-token requests (>= 4 s) are still running when a rank is killed, which
    # happens once every one of them is running.
    server = start_server(models["moe"], tmp_path / "s.log", "-dp", "2", "--enable-expert-parallel", "--no-recover",
                          "--dp-timeout", "20", "--max-model-len", "256", env={STEP_DELAY_ENV: "20"})
    pids = server.engine_pids()
    assert len(pids) == 2

    async def load_then_kill() -> list:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(8)]
            deadline = time.monotonic() + 120  # a ceiling against a hang
            while gauge_sum(parse_metrics((await client.get("/metrics")).text), "phalanx:num_requests_running") < 8:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            os.kill(pids[1], signal.SIGKILL)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(load_then_kill())
    # Every request fails (5xx or a dropped connection): none of them can finish without rank 1.
    assert all(isinstance(r, Exception) or r.status_code >= 500 for r in results), results
    assert any(not isinstance(r, Exception) and r.status_code >= 500 for r in results)
    code = server.proc.wait(120)  # exits on its own (the ceiling guards a hang)
    assert code != 0
    log = server.log()
    assert "; failing all requests and shutting down" in log and "exiting with code 1: engine rank" in log, log[-3000:]
    # the cause, whichever the server saw first: the killed rank's exit, or its peer's failed collective
    assert "exited with code -9" in log or "or a dead peer" in log, log[-3000:]

    # The surviving rank is gone too: no orphans.
    deadline = time.monotonic() + 60
    while any(process_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"engine ranks left behind: {[p for p in pids if process_alive(p)]}"
        time.sleep(0.2)
