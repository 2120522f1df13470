"""The API server's per-request metrics, on the real app over a fake engine (no processes)."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client.parser import text_string_to_metric_families

from tests.fake_engine import fake_app
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer


def _counter(text: str, name: str, default: float | None = None) -> float:
    """The sample's value; `default` when it has none yet (a labelled counter never incremented)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    if default is not None:
        return default
    raise AssertionError(f"{name} not in /metrics")


def test_prompt_tokens_count_once_per_prompt_not_per_sample() -> None:
    """Regression: with n > 1 the prompt was counted n times in phalanx:prompt_tokens_total (the
    front end multiplied by the number of samples); n samples share one prompt."""

    async def run() -> tuple[float, float, int]:
        async with fake_app(make_byte_bpe_tokenizer(), vocab_size=320) as (http, engine, _):
            prompt = [5, 6, 7, 8, 9]
            r = await http.post("/v1/completions", json={"prompt": prompt, "n": 4, "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await http.post("/v1/completions", json={"prompt": [[5, 6], [7, 8, 9]], "n": 3, "max_tokens": 2})
            assert r.status_code == 200, r.text
            text = (await http.get("/metrics")).text
            return (
                _counter(text, "phalanx:prompt_tokens_total"),
                _counter(text, "phalanx:generation_tokens_total"),
                len(engine.added),
            )

    prompt_tokens, generation_tokens, num_engine_requests = asyncio.run(run())
    assert num_engine_requests == 4 + 2 * 3  # every sample is one engine request ...
    assert prompt_tokens == 5 + 2 + 3  # ... but each prompt counts once
    assert generation_tokens == 2 * (4 + 2 * 3)  # generated tokens count per sample


def test_prompt_tokens_count_when_the_prefill_ends_not_on_arrival() -> None:
    """Like vLLM's prompt_tokens_total (and the log's prompt throughput), a prompt counts as processed
    when its first token arrives, not when the request does: requests queued behind a long prefill
    are not throughput yet, and one aborted before its first token never is."""

    async def run() -> tuple[float, float, float]:
        async with fake_app(make_byte_bpe_tokenizer(), vocab_size=320) as (http, engine, _):
            engine.hold = True
            pending = asyncio.create_task(http.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2}))
            while not engine.added:
                await asyncio.sleep(0.01)
            queued = _counter((await http.get("/metrics")).text, "phalanx:prompt_tokens_total", default=0)
            engine.release()
            assert (await pending).status_code == 200
            done = _counter((await http.get("/metrics")).text, "phalanx:prompt_tokens_total")
            # a client that gives up before the first token: its prompt is never counted
            gone = asyncio.create_task(http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}))
            while len(engine.added) < 2:
                await asyncio.sleep(0.01)
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            engine.release()  # its answer arrives after the request is gone
            await asyncio.sleep(0.1)
            after_abort = _counter((await http.get("/metrics")).text, "phalanx:prompt_tokens_total")
            return queued, done, after_abort

    queued, done, after_abort = asyncio.run(asyncio.wait_for(run(), 60))  # a ceiling against a hang
    assert (queued, done, after_abort) == (0, 4, 4)
