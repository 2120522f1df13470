"""The API server's per-request metrics, on the real app over a fake engine (no processes)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.fake_engine import fake_app
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer


def _counter(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
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
