"""The samples of an n > 1 request reach the engine as one group (the scheduler lets one compute
the shared prompt and the others wait for its cached blocks), from the server as offline. The real
app over a fake engine (no processes)."""

from __future__ import annotations

import asyncio

from tests.fake_engine import fake_app
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer


def test_the_samples_of_one_request_share_a_group_and_single_samples_have_none() -> None:
    """Regression: the server sent every sample without its group (offline `LLM` set it), so the n
    samples of a request each computed the whole prompt."""

    async def run() -> list:
        async with fake_app(make_byte_bpe_tokenizer(), vocab_size=320) as (http, engine, _):
            for body in ({"prompt": [5, 6, 7], "n": 3, "max_tokens": 2},
                         {"prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 2},
                         {"prompt": [5, 6, 7], "max_tokens": 2}):
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            return list(engine.added)

    added = asyncio.run(run())
    assert len(added) == 3 + 2 * 2 + 1
    groups = [r.group_id for r in added]
    assert groups[-1] is None  # one sample: no group
    firsts = groups[:3], groups[3:5], groups[5:7]
    for g in firsts:
        assert g[0] is not None and len(set(g)) == 1, groups
    assert len({g[0] for g in firsts}) == 3  # each prompt of each request its own group
