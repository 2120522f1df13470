"""Per-request speculation control through `phalanx serve`.

A server drafting with the target itself (a draft model that always agrees, k = 3; static drafting:
the adaptive policy would rightly draft little with a drafter as costly as the target, and is
tested offline and under lockstep in tests/unit/test_spec_per_request.py and tests/dp):
on /v1/completions and /v1/chat/completions alike, a request with `"speculative": false` gets no
drafts while the requests around it keep drafting, `"num_speculative_tokens": 1` gets at most one
draft per step, and every text equals the plain greedy one; values out of range are a 400 naming
the field and the range; /metrics counts the draft lengths given.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e.conftest import MODEL_NAME, start_server

K = 3
PROMPT = "the cat sat on the mat " * 3


def _body(path: str, extra: dict) -> dict:
    base = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "return_spec_stats": True}
    if path == "/v1/completions":
        return {**base, "prompt": PROMPT, **extra}
    return {**base, "messages": [{"role": "user", "content": PROMPT}], **extra}


def _text(path: str, r: httpx.Response) -> str:
    choice = r.json()["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def test_opt_out_and_cap_through_the_server(tiny_model: Path, tmp_path: Path) -> None:
    spec = json.dumps({"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": K})
    srv = start_server(tiny_model, tmp_path / "spec.log", "--max-model-len", "256", "--speculative-config", spec)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            for path in ("/v1/completions", "/v1/chat/completions"):
                plain = _text(path, c.post(path, json=_body(path, {"speculative": False})))
                extras = [{}, {"speculative": False}, {"num_speculative_tokens": 1}, {"num_speculative_tokens": 0}] * 2
                with ThreadPoolExecutor(len(extras)) as pool:  # in flight together: one batch
                    rs = list(pool.map(lambda e, p=path: c.post(p, json=_body(p, e)), extras))
                for extra, r in zip(extras, rs):
                    assert r.status_code == 200, r.text
                    assert _text(path, r) == plain, (path, extra)
                    stats = r.json()["choices"][0]["spec_stats"]
                    if extra.get("speculative") is False or extra.get("num_speculative_tokens") == 0:
                        assert stats["num_draft_tokens"] == 0, (path, extra, stats)
                    elif extra.get("num_speculative_tokens") == 1:
                        assert stats["num_draft_tokens"] <= stats["num_verify_steps"], (path, extra, stats)
                assert sum(r.json()["choices"][0]["spec_stats"]["num_draft_tokens"] for r in rs[::4]) > 0
                for extra, text in [({"num_speculative_tokens": K + 1}, f"must be in [0, {K}]"),
                                    ({"speculative": False, "num_speculative_tokens": 2}, "contradicts")]:  # fmt: skip
                    r = c.post(path, json=_body(path, extra))
                    assert r.status_code == 400, r.text
                    error = r.json()["error"]
                    assert error["param"] == "num_speculative_tokens" and text in error["message"], error
            metrics = c.get("/metrics").text
            lengths = {line.split('length="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                       for line in metrics.splitlines() if line.startswith("phalanx:spec_decode_draft_length_total")}  # fmt: skip
            assert set(lengths) <= {str(d) for d in range(K + 1)} and lengths.get("0", 0) > 0
            assert sum(v for d, v in lengths.items() if d != "0") > 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
