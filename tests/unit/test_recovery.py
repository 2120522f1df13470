"""The pieces of recovery from a rank's death that need no processes: the restart budget, the
replays the front end forms (text never repeated or missing across the replay, prompt logprobs,
speculative statistics, n > 1 groups), requests that wait for a serving rank and give up with a 503
naming why, and the fault-injection switch's parsing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from phalanx.core.outputs import EngineCoreOutput, TokenLogprobs
from phalanx.engine.engine_core import EngineCoreRequest
from phalanx.engine.fault_injection import KillPoint, parse_kill_points
from phalanx.engine.metrics import ServingMetrics
from phalanx.engine.output_processor import OutputProcessor
from phalanx.engine.recovery import RankState, RecoveryConfig, RestartBudget
from phalanx.entrypoints.async_llm import AsyncLLM
from phalanx.sampling_params import SamplingParams
from tests.fake_engine import FakeEngineClient
from tests.tiny_models import make_model


def test_restart_budget_backs_off_then_gives_up_and_forgets_old_deaths() -> None:
    budget = RestartBudget(RecoveryConfig(max_restarts=3, restart_window_s=100.0, backoff_s=1.0, max_backoff_s=1.5))
    assert [budget.on_death(t) for t in (0.0, 5.0, 9.0)] == [0.0, 1.0, 1.5]  # the third capped at the max
    assert budget.on_death(50.0) is None  # a fourth death within the window: given up
    # Deaths older than the window are forgotten: a rank that stayed up earns its budget back.
    assert RestartBudget(RecoveryConfig(max_restarts=1, restart_window_s=10.0)).on_death(0.0) == 0.0
    b = RestartBudget(RecoveryConfig(max_restarts=1, restart_window_s=10.0))
    assert b.on_death(0.0) == 0.0 and b.on_death(5.0) is None
    assert b.on_death(100.0) == 0.0
    assert RestartBudget(RecoveryConfig(max_restarts=0)).on_death(0.0) is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_restarts=-1), "max_restarts"),
    (dict(request_timeout_s=0), "request_timeout_s"),
    (dict(backoff_s=5.0, max_backoff_s=1.0), "backoff_s"),
    (dict(max_replays=-1), "max_replays"),
])
def test_recovery_config_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecoveryConfig(**kwargs)


def test_kill_points_parse_and_reject_bad_values() -> None:
    assert parse_kill_points("1:25:drafter, 0:5:step,1:3:collective:drafter pass 2") == [
        KillPoint(1, 25, "drafter"), KillPoint(0, 5, "step"), KillPoint(1, 3, "collective", "drafter pass 2")]
    for bad in ("1:2", "a:2:step", "1:2:nowhere", "-1:2:step", "1:2:step:site"):
        with pytest.raises(ValueError, match="PHALANX_DEBUG_KILL_AT"):
            parse_kill_points(bad)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model("LlamaForCausalLM", tmp_path_factory.mktemp("tok")))


def _out(req_id: str, tokens: list[int], finish: str | None = None, drafts: int = 0, accepted: int = 0,
         steps: int = 0, prompt_lps: list | None = None, cached: int = 0) -> EngineCoreOutput:
    lps = [TokenLogprobs([t], [-0.5], 1) for t in tokens]
    return EngineCoreOutput(req_id, tokens, lps, prompt_lps, finish, None, cached, drafts, accepted, steps)


def _text_ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_replay_continues_text_stop_strings_logprobs_and_stats(tokenizer) -> None:  # noqa: ANN001
    """Death in the middle of a held-back stop-string prefix: the replay carries exactly the tokens
    received; feeding the replay's outputs gives the text, stop, logprobs and statistics that the
    same tokens give undisturbed."""
    ids = _text_ids(tokenizer, "hello wor" + "ld and more words here")
    cut = len(_text_ids(tokenizer, "hello wor"))
    params = SamplingParams(max_tokens=40, stop=["world"], logprobs=0, n=2, seed=5, prompt_logprobs=0)
    prompt = [5, 6, 7]

    first = [None, TokenLogprobs([6], [-1.0], 1), TokenLogprobs([7], [-1.0], 1)]  # all prompt logprobs
    proc = OutputProcessor(tokenizer)
    proc.add_request("p", None, prompt, params)
    proc.process([_out("0_p", ids[:cut], drafts=4, accepted=3, steps=2, prompt_lps=first, cached=2),
                  _out("1_p", ids[:4], "length", cached=2)])
    replays = proc.replays(["0_p", "1_p", "unknown"])  # sample 1 already finished: not replayed
    assert list(replays) == ["p"] and [r.engine_id for r in replays["p"]] == ["0_p"]
    replay = replays["p"][0]
    assert replay.output_token_ids == ids[:cut] and replay.prompt_token_ids == prompt
    assert replay.params.seed == 5 and replay.params.prompt_logprobs is None  # all prompt logprobs arrived
    assert proc.num_replays("p") == 1
    # The replaying rank's counters start from 0; its first output also reports its own cache hit.
    got = proc.process([_out("0_p", ids[cut:], drafts=5, accepted=3, steps=1, cached=40)])
    ref_out = OutputProcessor(tokenizer)
    ref_out.add_request("p", None, prompt, params)
    want = ref_out.process([_out("0_p", ids, drafts=9, accepted=6, steps=3, prompt_lps=first, cached=2),
                            _out("1_p", ids[:4], "length", cached=2)])
    g, w = got.request_outputs[0], want.request_outputs[0]
    assert "wor" in tokenizer.decode(replay.output_token_ids)  # died holding back a stop-string prefix
    assert g.outputs[0].text == w.outputs[0].text == "hello "
    assert g.outputs[0].finish_reason == "stop" and g.outputs[0].stop_reason == "world"
    assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].logprobs == w.outputs[0].logprobs
    assert (g.outputs[0].num_draft_tokens, g.outputs[0].num_accepted_tokens, g.outputs[0].num_verify_steps) == (9, 6, 3)
    assert g.num_cached_tokens == 2 and g.prompt_logprobs == w.prompt_logprobs and g.finished


def test_a_replay_during_prefill_asks_for_prompt_logprobs_again(tokenizer) -> None:  # noqa: ANN001
    proc = OutputProcessor(tokenizer)
    proc.add_request("p", None, [5, 6, 7, 8], SamplingParams(max_tokens=4, prompt_logprobs=1))
    proc.process([_out("p", [], prompt_lps=[None, TokenLogprobs([6], [-1.0], 1)])])  # half the prompt
    replay = proc.replays(["p"])["p"][0]
    assert replay.params.prompt_logprobs == 1 and replay.output_token_ids == []
    full = [None] + [TokenLogprobs([t], [-1.0], 1) for t in (6, 7, 8)]
    out = proc.process([_out("p", [9], prompt_lps=full)]).request_outputs[0]
    assert len(out.prompt_logprobs) == 4  # collected afresh, not appended to the partial list


class _PendingClient(FakeEngineClient):
    """A fake engine client whose only rank is restarting: requests wait, then expire."""

    serving = False

    def __init__(self) -> None:
        super().__init__(vocab_size=320, max_model_len=64)
        self.ranks = [type("R", (), {"rank": 0, "state": RankState.RESPAWNING})()]
        self.pending: list[tuple[list[EngineCoreRequest], float]] = []
        self.expire_now = asyncio.Event()

    def add_requests(self, requests: list[EngineCoreRequest], timeout_s: float | None = None) -> int | None:
        assert timeout_s is not None  # recovery on: a request may wait
        self.pending.append((requests, timeout_s))
        return None

    def expire_pending(self, now: float) -> list[str]:
        if not self.expire_now.is_set():
            return []
        ids = [r.req_id for reqs, _ in self.pending for r in reqs]
        self.pending.clear()
        return ids


def test_a_request_waiting_for_a_serving_rank_gets_a_503_naming_why(tmp_path: Path) -> None:
    from phalanx.entrypoints.openai.server import build_app, make_state

    async def run() -> None:
        client = _PendingClient()
        metrics = ServingMetrics("tiny")
        engine = AsyncLLM(client, None, metrics, recovery=RecoveryConfig(request_timeout_s=7.0))  # type: ignore[arg-type]
        engine.start(None)
        app = build_app(make_state(engine, None, metrics, "tiny", "/nowhere", None))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
            assert "rank 0 respawning" in health.json()["error"]["message"]
            request = asyncio.create_task(http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}))
            while not client.pending:
                await asyncio.sleep(0.01)
            assert client.pending[0][1] == 7.0  # it waits at most the configured recovery timeout
            client.expire_now.set()
            resp = await request
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unavailable"
            assert "no engine rank could take the request within 7 s" in resp.json()["error"]["message"]
        await engine.stop()

    asyncio.run(run())


def test_a_non_streaming_client_that_leaves_gets_no_server_exception() -> None:
    """Regression: when a non-streaming client disconnected, the handler raised the cancelled work's
    CancelledError (a cancelled gather ends with that exception, not in the cancelled state), and
    uvicorn logged "Exception in ASGI application" for every such client; now the request's
    samples are aborted and the handler returns None (-> 499)."""
    from phalanx.entrypoints.openai.serving import _collect

    class Raw:
        async def receive(self) -> dict:
            return {"type": "http.disconnect"}

    aborted: list[str] = []

    async def never_finishes():  # noqa: ANN202 - an engine stream that outlives its client
        try:
            await asyncio.sleep(3600)
            yield None
        finally:
            aborted.append("aborted")

    async def run() -> object:
        return await _collect([never_finishes(), never_finishes()], Raw())  # type: ignore[arg-type]

    assert asyncio.run(run()) is None
    assert aborted == ["aborted", "aborted"]
