"""Per-request speculation control and the adaptive draft length, through the offline engine and
the server's request validation.

* `SamplingParams(speculative=False)` / `num_speculative_tokens=j` mixed at random in one batch:
  greedy outputs equal plain decoding token for token (fp32, and bf16 on the batch-invariant GEMM
  path), opted-out requests never get drafts, capped ones at most j per step, the others keep
  speculating at k — for every drafting method;
* `"adaptive": true`: lossless the same way; its choices go through the scheduler to the proposer
  (a good drafter on free rows drafts k, a useless one on costly rows drafts nothing), they are
  counted in `spec_draft_lengths`, and `disable_by_batch_size` still switches drafting off;
* invalid values are refused naming the field and the valid range: a ValueError offline, a 400
  with an OpenAI-style body (`param` set) on /v1/completions and /v1/chat/completions, also on a
  server without speculative decoding, where `speculative: false` is accepted.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks.step_log import calibration, cost_model, price, summarise
from phalanx import LLM, SamplingParams
from phalanx.core import scheduler as scheduler_module
from phalanx.engine import engine_core as engine_core_module
from phalanx.engine.engine_core import STEP_LOG_ENV
from phalanx.engine.metrics import ServingMetrics
from phalanx.engine.protocol import EngineCoreRequest
from phalanx.spec_decode.adaptive import (
    DRAFT_MIN_GAIN,
    EXPLORE_EVERY,
    MIN_DRAFTING_STEPS,
    PROFILE_MIN_ROWS,
    PROFILE_ROWS,
    StepCostModel,
    StepProfile,
    profile_may_stop_after,
)
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.worker.model_runner import ModelRunner
from tests.fake_engine import fake_app
from tests.tiny_models import VOCAB, make_agreeing_eagle_pair, make_eagle_head, make_model
from tests.tokenizer_fixtures import make_chat_tokenizer

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("per_request")
    target = make_model("LlamaForCausalLM", root / "target", num_hidden_layers=3)
    agreeing_target, agreeing_head = make_agreeing_eagle_pair(root / "agree")
    return {
        "target": target,
        "eagle": make_eagle_head(target, root / "eagle", "eagle"),
        "draft": make_model("LlamaForCausalLM", root / "draft", seed=5, num_hidden_layers=1),
        "agreeing_target": agreeing_target,
        "agreeing_head": agreeing_head,
    }


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]
        out.append({"prompt_token_ids": (base * 4)[: rng.randint(2, 30)]})  # repetitive: n-gram finds matches
    return out


def _mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """Opt-outs, caps 0..k and uncapped requests mixed at random; greedy."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        kind = i % 4 if i < 4 else rng.randrange(4)  # every kind at least once
        extra: dict[str, Any] = [{"speculative": False}, {"num_speculative_tokens": rng.randint(0, K)}, {},
                                 {"num_speculative_tokens": 1}][kind]  # fmt: skip
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 20), ignore_eos=True, **extra))
    return params


def _spec(method: str, models: dict[str, Path], **extra: Any) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1, **extra}
    return {"model": str(models["target" if method == "self" else method]), "num_speculative_tokens": K,
            **({"method": "draft_model"} if method in ("self", "draft") else {}), **extra}  # fmt: skip


def _spy_drafts(llm: LLM) -> list[tuple[list[str], list[int], list[list[int]]]]:
    """Record every proposal: (request ids, draft lengths asked for, drafts returned)."""
    proposer = llm.engine.runner.proposer
    calls: list[tuple[list[str], list[int], list[list[int]]]] = []
    propose = proposer.propose

    def spy(batch):  # noqa: ANN001, ANN202
        drafts = propose(batch)
        calls.append((list(batch.req_ids), list(batch.num_drafts), [list(d) for d in drafts]))
        return drafts

    proposer.propose = spy
    return calls


@pytest.mark.parametrize(
    ("method", "dtype", "adaptive"),
    [("self", "float32", False), ("eagle", "float32", False), ("ngram", "float32", False),
     ("eagle", "bfloat16", False), ("self", "float32", True), ("draft", "float32", True), ("ngram", "float32", True),
     ("eagle", "bfloat16", True), ("self", "bfloat16", True)],
)  # fmt: skip
def test_opt_outs_and_caps_are_lossless_and_honoured(method: str, dtype: str, adaptive: bool,
                                                     models: dict[str, Path]) -> None:
    prompts, params = _prompts(12, seed=1), _mixed_params(12, seed=2)
    plain = LLM(str(models["target"]), dtype=dtype, max_num_batched_tokens=96, block_size=8)
    plain_params = [p.clone(speculative=True, num_speculative_tokens=None) for p in params]  # no drafter here
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, plain_params, use_tqdm=False)]
    llm = LLM(str(models["target"]), dtype=dtype, max_num_batched_tokens=96, block_size=8,
              speculative_config=_spec(method, models, adaptive=adaptive))
    calls = _spy_drafts(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # The engine's request ids are "0".."11", in prompt order.
    caps = {str(i): p.draft_cap(K) for i, p in enumerate(params)}
    for req_ids, wanted, drafts in calls:
        for rid, n, d in zip(req_ids, wanted, drafts):
            assert n <= caps[rid] and len(d) <= n, (rid, n, d)
    for o, p in zip(outs, params):
        c = o.outputs[0]
        if p.draft_cap(K) == 0:
            assert c.num_draft_tokens == 0
        else:
            assert c.num_draft_tokens <= p.draft_cap(K) * c.num_verify_steps
    # Others in the same batches keep speculating at full depth (adaptive: at least some drafts).
    uncapped = [c for o, p in zip(outs, params) if p.draft_cap(K) == K for c in o.outputs]
    assert uncapped and sum(c.num_draft_tokens for c in uncapped) > 0
    if not adaptive and method == "self":  # a self-draft always agrees: full depth while there is room
        assert any(len(d) == K for _, _, ds in calls for d in ds)
    # Every length given is counted (0 also for requests that produced no token: prefill chunks).
    # Opted-out requests never reach the proposer: a 0 for each token they sampled.
    counts = llm.get_metrics()["spec_draft_lengths"]
    wanted = [n for _, ns, _ in calls for n in ns]
    assert len(counts) == K + 1 and counts[1:] == [wanted.count(d) for d in range(1, K + 1)]
    opted_out_steps = sum(len(o.outputs[0].token_ids) for o, p in zip(outs, params) if p.draft_cap(K) == 0)
    assert opted_out_steps > 0 and not {rid for ids, _, _ in calls for rid in ids} & {
        str(i) for i, p in enumerate(params) if p.draft_cap(K) == 0}
    assert 0 < counts[0] <= wanted.count(0) + opted_out_steps
    if adaptive:  # every verification reached the policy; every finished request was forgotten
        stats = llm.engine.adaptive.acceptance
        assert stats.engine_tested[0] > 0 and not stats._counts


@pytest.mark.parametrize("method", ["eagle", "draft"])
def test_parked_requests_run_as_opted_out_and_probes_pass(method: str, models: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """While the policy parks (forced here), requests that may draft are parked as they arrive but
    for every PROBE_EVERY-th (3 here): a parked request never reaches the drafter, not even its
    prompt, and gets no drafts; a probe is drafted for as the policy chooses; opted-out requests
    do not count. Outputs are those of plain decoding."""
    monkeypatch.setattr(scheduler_module, "PROBE_EVERY", 3)
    prompts = _prompts(10, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 2 * i, ignore_eos=True,
                             **({"speculative": False} if i % 3 == 2 else {})) for i in range(10)]
    ref = LLM(str(models["target"]), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(models["target"]), dtype="float32", max_num_seqs=4,
              speculative_config=_spec(method, models, adaptive=True))
    adaptive = llm.engine.adaptive
    assert adaptive is not None and adaptive.may_park
    adaptive.parks = lambda load: True  # type: ignore[method-assign]
    calls = _spy_drafts(llm)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    parked: dict[str, bool] = {}

    def spy_schedule():  # noqa: ANN202
        out = schedule()
        parked.update((new.req_id, scheduler.requests[new.req_id].parked) for new in out.new_reqs)
        return out

    scheduler.schedule = spy_schedule  # type: ignore[method-assign]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    # may draft: 0 1 3 4 6 7 9 (every third opted out); the 3rd and 6th of them are probes
    assert {r for r, was in parked.items() if was} == {"0", "1", "4", "6", "9"}
    assert llm.get_metrics()["spec_num_parked"] == 5
    fed = {rid for ids, _, _ in calls for rid in ids}
    assert fed <= {"3", "7"} and "3" in fed  # neither a parked nor an opted-out request is fed
    for o in outs:
        if parked.get(o.request_id):
            assert o.outputs[0].num_draft_tokens == 0


def _synthetic_costs(llm: LLM, row_seconds: float, pass_seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the engine's step timing by a fixed cost model: 1 s + `row_seconds` per row, and
    `pass_seconds` per drafter pass, so that the adaptive choices are deterministic. The profile
    the engine measured at start-up gives way to the same model's shape, and every step is kept
    (the engine leaves out steps whose thread got too little CPU, which on a busy machine would
    leave the model unfed and the choices up to the load)."""
    monkeypatch.setattr(engine_core_module, "MIN_CPU_SHARE", 0.0)
    adaptive = llm.engine.adaptive
    assert adaptive is not None
    assert adaptive.costs._profile is not None  # measured at start-up (not under expert parallelism)
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    adaptive.costs.set_profile(rows, [1.0 + row_seconds * r for r in rows], [0.0] * len(rows))
    observe = adaptive.observe_step

    def fixed(num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
              num_logit_rows: int | None = None, num_draft_rows: int = 0, drafter_rows: int | None = None,
              forward_seconds: float | None = None, drafter_pass_rows: int = 0, drafting_reqs: int = 0) -> None:
        observe(num_rows, 1.0 + row_seconds * num_rows + pass_seconds * drafter_passes, pass_seconds * drafter_passes,
                drafter_passes, num_logit_rows, num_draft_rows, drafter_rows, 1.0 + row_seconds * num_rows,
                drafter_pass_rows, drafting_reqs)

    adaptive.observe_step = fixed  # type: ignore[method-assign]


def test_adaptive_drafts_deep_with_a_good_drafter_on_free_rows(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreeing EAGLE pair accepts everything; rows and passes cost almost nothing: every
    request drafts its full cap (k, or the room left) at every step, exactly the lengths of static
    drafting, and the output is plain decoding's."""
    target, head = str(models["agreeing_target"]), str(models["agreeing_head"])
    prompts = _prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLM(target, dtype="float32").generate(prompts, params, use_tqdm=False)
    lengths = []
    for adaptive in (False, True):
        llm = LLM(target, dtype="float32", speculative_config={"model": head, "num_speculative_tokens": K,
                                                                "adaptive": adaptive})  # fmt: skip
        if adaptive:
            _synthetic_costs(llm, row_seconds=1e-4, pass_seconds=1e-4, monkeypatch=monkeypatch)
        calls = _spy_drafts(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert llm.get_metrics()["spec_mean_acceptance_length"] > 3.0
        lengths.append([ns for _, ns, _ in calls])
    assert lengths[1] == lengths[0] and any(K in ns for ns in lengths[0])


def test_adaptive_stops_drafting_a_useless_drafter_on_costly_rows(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A random draft model (nearly nothing accepted) and rows that cost a whole step each: once
    the acceptance and the drafter are measured, nobody drafts (but for exploration); outputs stay
    exact."""
    prompts, params = _prompts(6, seed=4), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = LLM(str(models["target"]), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("draft", models, adaptive=True))
    _synthetic_costs(llm, row_seconds=1.0, pass_seconds=0.5, monkeypatch=monkeypatch)
    calls = _spy_drafts(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    counts = llm.get_metrics()["spec_draft_lengths"]
    # mostly 0 once the first MIN_DRAFTING_STEPS steps (every request at its cap) are past ...
    assert counts[0] > 0.8 * (sum(counts) - len(prompts) * MIN_DRAFTING_STEPS)
    # ... and at the end none but the one exploring draft every EXPLORE_EVERY decisions
    assert sum(n for _, ns, _ in calls[-EXPLORE_EVERY:] for n in ns) <= 1


def test_a_pinned_request_drafts_its_cap_where_the_policy_drafts_nothing(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`speculative_adaptive=False`: on costly rows where the policy drafts nothing for the others,
    a pinned request still drafts its cap (k, or its own `num_speculative_tokens`) every step,
    while parking (forced here) passes it by; outputs are plain decoding's."""
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             **[{}, {"speculative_adaptive": False},
                                {"speculative_adaptive": False, "num_speculative_tokens": 2}][i % 3])
              for i in range(6)]
    plain_params = [p.clone(speculative_adaptive=None, num_speculative_tokens=None) for p in params]
    ref = LLM(str(models["target"]), dtype="float32").generate(prompts, plain_params, use_tqdm=False)
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("draft", models, adaptive=True))
    _synthetic_costs(llm, row_seconds=1.0, pass_seconds=0.5, monkeypatch=monkeypatch)
    calls = _spy_drafts(llm)
    outs = llm.generate(prompts[:3], params[:3], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref[:3]]
    asked = [(rid, n) for ids, ns, _ in calls for rid, n in zip(ids, ns)]
    # the engine's request ids are "0", "1", "2": the policy's, pinned at k, pinned at 2
    # (the last few steps leave room for fewer drafts before max_tokens)
    for rid, cap in (("1", K), ("2", 2)):
        lengths = [n for r, n in asked if r == rid]
        end = lengths[-(K + 1):]
        assert set(lengths[:-(K + 1)]) == {cap} and end == sorted(end, reverse=True), lengths
    late = [n for rid, n in asked[-3 * EXPLORE_EVERY:] if rid == "0"]
    assert late and sum(late) <= 2  # the policy's request: nothing, but for an exploration
    # Parking passes a pinned request by; a request left to the policy is parked.
    llm.engine.adaptive.parks = lambda load: True  # type: ignore[method-assign]
    outs = llm.generate(prompts[3:], params[3:], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref[3:]]
    parked = {r.request_id: r.outputs[0].num_draft_tokens for r in outs}
    assert parked["3"] == 0 and parked["4"] > 0 and parked["5"] > 0
    assert llm.get_metrics()["spec_num_parked"] == 1


def test_adaptive_prices_drafts_against_the_batch_that_verifies_them(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts chosen in a step are verified in the next one: the policy is told that batch holds
    one row per request of this step, also when this step carries a prompt's chunk (pricing the
    drafts against this step's rows would make them look free next to a prefill)."""
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("eagle", models, adaptive=True),
              max_num_seqs=2)  # fmt: skip
    _synthetic_costs(llm, row_seconds=1e-4, pass_seconds=1e-4, monkeypatch=monkeypatch)
    adaptive, scheduler = llm.engine.adaptive, llm.engine.scheduler
    assert adaptive is not None
    choose, schedule = adaptive.choose, scheduler.schedule
    given: list[int] = []
    steps: list[tuple[int, int, int]] = []  # (base rows given, requests in the step, rows in the step)

    def spy_choose(req_ids: list[str], caps: list[int], base_rows: int, lags: list[int] | None = None,
                   extra_logit_rows: int = 0) -> list[int]:
        given.append(base_rows)
        return choose(req_ids, caps, base_rows, lags, extra_logit_rows=extra_logit_rows)

    def spy_schedule():  # noqa: ANN202
        before = len(given)
        out = schedule()
        if len(given) > before:
            steps.append((given[-1], len(out.num_scheduled_tokens), out.total_num_scheduled_tokens))
        return out

    adaptive.choose = spy_choose  # type: ignore[method-assign]
    scheduler.schedule = spy_schedule  # type: ignore[method-assign]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 14, 10, 18, 8, 12)]
    outs = llm.generate(_prompts(6, seed=6), params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert all(base == num_reqs for base, num_reqs, _ in steps)
    # some steps decode one request and prefill another's prompt: many more rows than requests
    assert any(num_reqs == 2 and rows > 2 * (1 + K) for _, num_reqs, rows in steps)


def _observed_engine(models: dict[str, Path]) -> tuple[Any, list[float]]:
    """An adaptive EAGLE engine whose policy's step observations are recorded (their seconds)."""
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("eagle", models, adaptive=True))
    engine = llm.engine
    assert engine.adaptive is not None
    observe, seen = engine.adaptive.observe_step, []

    def spy(**step: Any) -> None:
        seen.append(step["seconds"])
        observe(**step)

    engine.adaptive.observe_step = spy  # type: ignore[method-assign]
    return engine, seen


def test_a_step_is_timed_to_the_next_steps_start(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loop does between steps (a server sends outputs and takes requests in) is paid once
    per step: while requests are in flight the policy is given each step's time from its start to
    the next step's start; the step before an idle spell counts its own time only. (Every step is
    kept: on a loaded machine the engine leaves out steps whose thread got too little CPU, the
    next test's subject.)"""
    monkeypatch.setattr(engine_core_module, "MIN_CPU_SHARE", 0.0)
    engine, seen = _observed_engine(models)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(EngineCoreRequest("a", [5, 6, 7, 8], params, time.monotonic()))
    while engine.has_unfinished_requests():
        engine.step()
        time.sleep(0.05)  # the loop's work between steps
    went_on = len(seen)
    assert went_on >= 2 and all(s >= 0.05 for s in seen)
    time.sleep(0.2)  # idle: nothing in flight
    engine.add_request(EngineCoreRequest("b", [5, 6, 7, 9], params, time.monotonic()))
    engine.step()
    assert len(seen) == went_on + 1 and seen[-1] < 0.05  # the last step of "a": its own time


def test_a_preempted_step_is_left_out_of_the_step_costs(models: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step in which the engine thread got less CPU time than MIN_CPU_SHARE of its wall time
    was preempted by other processes: the policy's step-cost model never sees it. Every other
    step is observed (a step waits for the next one's start)."""
    engine, seen = _observed_engine(models)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(req_id: str) -> int:
        engine.add_request(EngineCoreRequest(req_id, [5, 6, 7, 8], params, time.monotonic()))
        before = engine.num_steps
        while engine.has_unfinished_requests():
            engine.step()
        return engine.num_steps - before

    steps = run("a")
    # each step observed or counted preempted, the last one's observation waiting for the next step
    assert steps - 1 <= len(seen) + engine.num_preempted_steps <= steps
    # No CPU time at all: every step from here on was preempted.
    monkeypatch.setattr(engine_core_module, "time", SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=time.monotonic, thread_time=lambda: 0.0))
    observed, preempted = len(seen), engine.num_preempted_steps
    steps = run("b")
    assert engine.num_preempted_steps - preempted == steps
    assert len(seen) - observed <= 1  # "a"'s last step, timed by "b"'s first


def test_adaptive_respects_disable_by_batch_size(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec("eagle", models, adaptive=True, disable_by_batch_size=4)
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=spec, max_num_batched_tokens=512)
    _synthetic_costs(llm, row_seconds=1e-4, pass_seconds=1e-4, monkeypatch=monkeypatch)
    calls = _spy_drafts(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(9, 25)]
    outs = llm.generate(_prompts(16, seed=5), params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert any(len(ids) > 4 for ids, _, _ in calls)
    assert all(n == 0 for ids, ns, _ in calls if len(ids) > 4 for n in ns)
    assert any(n > 0 for ids, ns, _ in calls if len(ids) <= 4 for n in ns)


def test_a_drafter_with_nothing_to_feed_runs_no_pass(tmp_path: Path) -> None:
    """Regression: a bf16 draft model on the fused kernels whose requests were all caught up and
    drafted nothing (here: the one request has no room left before max_tokens; before, the same
    with every request over disable_by_batch_size) ran an empty pass through the fused layer
    kernel, which raised 'fused layer: no attention grid'. Outside lockstep such a step now runs no
    drafter pass."""
    target = make_model("LlamaForCausalLM", tmp_path / "m", hidden_size=128, intermediate_size=160)
    draft = make_model("LlamaForCausalLM", tmp_path / "d", seed=3, hidden_size=64, intermediate_size=96)
    prompt = _prompts(1, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)  # its last step has no room
    ref = LLM(str(target), dtype="bfloat16").generate(prompt, params, use_tqdm=False)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    llm = LLM(str(target), dtype="bfloat16", speculative_config=spec)
    assert llm.engine.runner.proposer.model.chain_form() is not None  # the fused path
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_speculative_tokens": -1}, r"num_speculative_tokens must be None or an integer >= 0"),
        ({"num_speculative_tokens": 1.5}, r"num_speculative_tokens must be None or an integer >= 0"),
        ({"num_speculative_tokens": True}, r"num_speculative_tokens must be None or an integer >= 0"),
        ({"speculative": "no"}, r"speculative must be true or false, got 'no'"),
        ({"speculative": False, "num_speculative_tokens": 2}, r"num_speculative_tokens=2 contradicts speculative=False"),
        ({"speculative_adaptive": "no"}, r"speculative_adaptive must be None, true or false, got 'no'"),
        ({"speculative_adaptive": 0}, r"speculative_adaptive must be None, true or false, got 0"),
        ({"speculative": False, "speculative_adaptive": False}, r"speculative_adaptive=False contradicts speculative=False"),
    ],
)
def test_sampling_params_refuse_bad_speculation_fields(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_speculation_fields_accepted() -> None:
    assert SamplingParams(speculative=False, num_speculative_tokens=0).draft_cap(3) == 0
    assert SamplingParams(num_speculative_tokens=2).draft_cap(3) == 2
    assert SamplingParams(num_speculative_tokens=7).draft_cap(3) == 3  # check_speculation refuses it first
    assert SamplingParams().draft_cap(3) == 3


def test_the_engine_checks_the_cap_against_its_k(models: dict[str, Path]) -> None:
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("ngram", models))
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[0, 3\] .* got 4"):
        llm.generate(prompt, SamplingParams(num_speculative_tokens=4), use_tqdm=False)
    assert llm.generate(prompt, SamplingParams(num_speculative_tokens=3, max_tokens=2), use_tqdm=False)[0].finished
    plain = LLM(str(models["target"]), dtype="float32")
    with pytest.raises(ValueError, match="without speculative decoding .* got 1"):
        plain.generate(prompt, SamplingParams(num_speculative_tokens=1), use_tqdm=False)
    for ok in (SamplingParams(speculative=False, max_tokens=2), SamplingParams(num_speculative_tokens=0, max_tokens=2)):
        assert plain.generate(prompt, ok, use_tqdm=False)[0].finished
    # speculative_adaptive: false fits any engine that speculates, true only an adaptive one, and
    # neither one that does not speculate.
    with pytest.raises(ValueError, match=r'speculative_adaptive must be false or unset here: .*"adaptive": true'):
        llm.generate(prompt, SamplingParams(speculative_adaptive=True), use_tqdm=False)
    assert llm.generate(prompt, SamplingParams(speculative_adaptive=False, max_tokens=2), use_tqdm=False)[0].finished
    with pytest.raises(ValueError, match="speculative_adaptive must be unset here: .*without speculative decoding"):
        plain.generate(prompt, SamplingParams(speculative_adaptive=False), use_tqdm=False)
    adaptive = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("ngram", models, adaptive=True))
    for value in (True, False):
        assert adaptive.generate(prompt, SamplingParams(speculative_adaptive=value, max_tokens=2),
                                 use_tqdm=False)[0].finished  # fmt: skip


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_adaptive_must_be_a_boolean(value: object, models: dict[str, Path]) -> None:
    from phalanx.config import ModelConfig

    target = ModelConfig.from_hf(models["target"])
    with pytest.raises(ValueError, match=f"adaptive must be true or false, got {value!r}"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "adaptive": value}, target)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "adaptive": True},
                                       target).adaptive  # fmt: skip


# ---- the server's validation ----------------------------------------------------------------------
TOKENIZER = make_chat_tokenizer()
ENDPOINTS = {"/v1/completions": {"prompt": [5, 6], "max_tokens": 2},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}  # fmt: skip


def _serve(k: int, check: Any, adaptive: bool = False) -> Any:
    async def main() -> Any:
        async with fake_app(TOKENIZER, vocab_size=2048, num_speculative_tokens=k,
                            adaptive_speculation=adaptive) as (http, engine, _):
            return await check(http, engine)

    return asyncio.run(main())


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_server_accepts_opt_outs_and_caps_and_refuses_the_rest(path: str) -> None:
    async def check(http: Any, engine: Any) -> None:
        for extra in ({"speculative": False}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": 3},
                      {"speculative": True, "num_speculative_tokens": 1}):  # fmt: skip
            r = await http.post(path, json={**ENDPOINTS[path], **extra})
            assert r.status_code == 200, (extra, r.text)
        got = [(r.sampling_params.speculative, r.sampling_params.num_speculative_tokens) for r in engine.added]
        assert got == [(False, None), (True, 0), (True, 3), (True, 1)]
        bad = [
            ({"num_speculative_tokens": 4}, "num_speculative_tokens", "must be in [0, 3]"),
            ({"num_speculative_tokens": -1}, "num_speculative_tokens", "must be in [0, 3]"),
            ({"speculative": False, "num_speculative_tokens": 2}, "num_speculative_tokens", "contradicts"),
            ({"speculative": "maybe"}, "speculative", "speculative"),
            ({"num_speculative_tokens": 2**70}, "num_speculative_tokens", "num_speculative_tokens"),
        ]
        for extra, param, text in bad:
            r = await http.post(path, json={**ENDPOINTS[path], **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and text in error["message"], (extra, error)
            assert error["type"] == "invalid_request_error"
        assert len(engine.added) == 4  # nothing refused reached the engine

    _serve(3, check)


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@pytest.mark.parametrize("adaptive", [False, True])
def test_server_checks_speculative_adaptive_against_the_server(path: str, adaptive: bool) -> None:
    """`speculative_adaptive`: false (draft the cap every step) on any server that speculates, true
    only on an adaptive one; a 400 naming the field otherwise, and for a non-boolean or one given
    with `speculative: false`."""

    async def check(http: Any, engine: Any) -> None:
        fine = [False, None, *([True] if adaptive else [])]
        for value in fine:
            r = await http.post(path, json={**ENDPOINTS[path], "speculative_adaptive": value})
            assert r.status_code == 200, (value, r.text)
        assert [r.sampling_params.speculative_adaptive for r in engine.added] == fine
        bad = [({"speculative_adaptive": "maybe"}, "speculative_adaptive"),
               ({"speculative": False, "speculative_adaptive": False}, "contradicts speculative=false"),
               *([] if adaptive else [({"speculative_adaptive": True}, '"adaptive": true')])]  # fmt: skip
        for extra, text in bad:
            r = await http.post(path, json={**ENDPOINTS[path], **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == "speculative_adaptive" and text in error["message"], (extra, error)
        assert len(engine.added) == len(fine)

    _serve(3, check, adaptive=adaptive)


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_server_without_speculation(path: str) -> None:
    """`speculative: false` (and a cap of 0) mean what the server does anyway; a cap above 0 is a
    400 that says the server does not speculate."""

    async def check(http: Any, engine: Any) -> None:
        for extra in ({"speculative": False}, {"num_speculative_tokens": 0}):
            r = await http.post(path, json={**ENDPOINTS[path], **extra})
            assert r.status_code == 200, (extra, r.text)
        r = await http.post(path, json={**ENDPOINTS[path], "num_speculative_tokens": 2})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "num_speculative_tokens"
        assert "without speculative decoding" in error["message"] and "got 2" in error["message"]
        r = await http.post(path, json={**ENDPOINTS[path], "speculative_adaptive": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative_adaptive"
        assert "without speculative decoding" in r.json()["error"]["message"]
        assert len(engine.added) == 2

    _serve(0, check)


def test_draft_length_counts_in_metrics() -> None:
    """/metrics: phalanx:spec_decode_draft_length{length} counts how often a request reaching its end
    was given each draft length, per engine rank, from the ranks' cumulative stats."""
    from phalanx.core.outputs import SchedulerStats

    metrics = ServingMetrics("m")
    metrics.on_stats(0, SchedulerStats(spec_draft_lengths=[5, 0, 2, 7]))
    metrics.on_stats(0, SchedulerStats(spec_draft_lengths=[6, 1, 2, 9]))
    metrics.on_stats(1, SchedulerStats(spec_draft_lengths=[1, 0, 0, 3], spec_num_parked=4))
    text = metrics.render().decode()
    assert 'phalanx:spec_decode_num_parked_requests_total{engine="1",model_name="m"} 4.0' in text
    for engine, length, value in [("0", "0", 6), ("0", "1", 1), ("0", "3", 9), ("1", "3", 3), ("1", "0", 1)]:
        line = f'phalanx:spec_decode_draft_length_total{{engine="{engine}",length="{length}",model_name="m"}} {value}.0'
        assert line in text, (line, [t for t in text.splitlines() if "draft_length" in t])


def test_a_profile_point_slower_than_a_larger_batch_is_measured_again() -> None:
    """One slow run at 49 rows (a slow CPU measures each point once) would make the monotone curve
    flat from 49 to 64 rows, and drafts there free: the point is measured again (the fastest run
    kept), a bounded number of times even where it stays slow."""
    calls: list[int] = []

    def time_rows(rows: int, blocks: int, context: int, group: int = 1) -> tuple[float, float]:
        calls.append(rows)
        spike = 3.0 if rows == 49 and calls.count(49) <= 2 else 1.0  # the warm-up and round 1
        return 0.01 * rows * spike, 0.001 * rows

    runner = SimpleNamespace(expert_shard=None, block_size=16, num_blocks=64, _time_rows=time_rows)
    rows, fwd, head, grouped_rows, grouped, _ = ModelRunner.profile_step_curve(runner, 64, repeats=1)  # type: ignore[arg-type]
    assert grouped_rows is None and grouped is None  # no speculation asked for: rows of their own sequences only
    assert rows == [r for r in PROFILE_ROWS if r <= 64]
    assert fwd == pytest.approx([0.01 * r for r in rows]) and (np.diff(fwd) > 0).all()
    assert calls.count(49) == 3 and calls.count(48) == 2  # warm-up, round 1, one more for 49 only

    stuck = SimpleNamespace(expert_shard=None, block_size=16, num_blocks=64,
                            _time_rows=lambda rows, blocks, context, group=1: (1.0 if rows == 49 else 0.01 * rows, 0.0))
    rows, fwd, *_ = ModelRunner.profile_step_curve(stuck, 64, repeats=1, retries=2)  # type: ignore[arg-type]
    assert fwd[rows.index(49)] == 1.0  # still slow after the retries
    costs = StepCostModel()
    costs.set_profile(rows, fwd, [0.0] * len(rows))  # which takes the larger batch's time for it
    assert float(costs.shape(49, 0)) == pytest.approx(0.64) and float(costs.shape(56, 0)) == pytest.approx(0.64)


def test_the_profile_prices_small_batches_on_the_gemms_own_row_blocks() -> None:
    """oneDNN's AVX512-BF16 GEMM (no AMX) takes rows 6 at a time: a forward over 5 or 6 rows costs
    what 4 does, the 7th row a whole block. The profile measures every small batch, so 4 requests
    verifying one draft for two of them (6 rows) are priced at next to nothing and a third draft
    (7 rows) at the block; interpolated from 4 to 8 rows the two drafts were priced at half a block
    and the third at a quarter."""
    block = 0.005

    def time_rows(rows: int, blocks: int, context: int, group: int = 1) -> tuple[float, float]:
        return 0.010 + block * -(-rows // 6), 0.0001 * rows

    runner = SimpleNamespace(expert_shard=None, block_size=16, num_blocks=64, _time_rows=time_rows)
    rows, fwd, head, *_ = ModelRunner.profile_step_curve(runner, 64, repeats=1)  # type: ignore[arg-type]
    assert all(r in rows for r in range(1, 17))
    costs = StepCostModel()
    costs.set_profile(rows, fwd, head)
    at = costs.shape(np.array([4.0, 6.0, 7.0]), np.array([4.0, 6.0, 7.0]))
    assert at[1] - at[0] == pytest.approx(0.0002)  # two draft rows: their lm_head rows only
    assert at[2] - at[1] == pytest.approx(block + 0.0001)  # the 7th row: a block


def test_adaptive_engines_profile_step_time_against_rows_at_start(models: dict[str, Path]) -> None:
    """The adaptive policy prices rows on the target's step time against rows, measured when the
    engine starts (nothing else runs then): rising rows up to the scheduler's token budget, every
    time > 0. Static speculation measures nothing; a forward under expert parallelism has partners
    on the other ranks and refuses to run alone."""
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("eagle", models, adaptive=True),
              max_num_batched_tokens=100)  # fmt: skip
    adaptive = llm.engine.adaptive
    assert adaptive is not None and adaptive.costs._profile is not None
    rows, fwd, _, head = adaptive.costs._profile
    # the grid up to the token budget; past the profile's time budget (a slow CPU, or a busy one:
    # beside two busy cores this engine's start-up stopped at 64 rows) cut where it may stop
    grid, measured = [r for r in PROFILE_ROWS if r < 100] + [100], rows.tolist()
    assert measured == grid or (measured == grid[: len(measured)] and profile_may_stop_after(grid, len(measured) - 1))
    assert (fwd > 0).all() and (np.diff(fwd) >= 0).all() and head[0] == 0 and (np.diff(head) >= 0).all()
    # and, at a few of those rows, as a verification holds them, k + 1 rows to a sequence
    k = llm.engine.cfg.speculative.num_speculative_tokens
    assert adaptive.costs._group == k + 1 and adaptive.costs._saving is not None
    saving_rows, saved = adaptive.costs._saving
    assert saving_rows.tolist() == [0, 16, 32, 64] and (saved >= 0).all()
    profile = llm.engine.runner.profile_step_curve(100, repeats=1, group=k + 1)
    assert profile.grouped_rows == [16, 32, 64] and profile.grouped is not None and min(profile.grouped) > 0
    assert profile.group == k + 1
    assert llm.generate(_prompts(2, seed=9), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    # Past its time budget (a slow CPU) the grid ends at the first point it may past 64 rows; with
    # time to spare it runs to the end.
    runner = llm.engine.runner
    assert runner.profile_step_curve(200, repeats=1, budget_seconds=0.0)[0] == [r for r in PROFILE_ROWS if r <= 64]
    assert runner.profile_step_curve(200, repeats=1, budget_seconds=1e9)[0] == [r for r in PROFILE_ROWS if r < 200] + [200]
    static = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("eagle", models))
    assert static.engine.adaptive is None
    with pytest.raises(RuntimeError, match="expert parallelism"):
        ModelRunner.profile_step_curve(SimpleNamespace(expert_shard=(0, 2)), 16)  # type: ignore[arg-type]


def test_the_profile_stops_only_where_its_last_segment_extends_fairly() -> None:
    """Never before PROFILE_MIN_ROWS, never just past a tile edge (r - 1 on the grid), else anywhere."""
    grid = list(PROFILE_ROWS)
    stops = [r for i, r in enumerate(grid) if profile_may_stop_after(grid, i)]
    assert stops == [r for i, r in enumerate(grid) if r >= PROFILE_MIN_ROWS and grid[i - 1] != r - 1]
    assert stops[0] == PROFILE_MIN_ROWS == 64 and 65 not in stops and 97 not in stops and 256 in stops
    assert profile_may_stop_after([64], 0) and not profile_may_stop_after([1, 2, 4], 2)


def test_the_step_log_records_every_step(models: dict[str, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """PHALANX_DEBUG_STEP_LOG=PATH: one JSON line per step in PATH.<pid>, whose figures add up to
    what the engine did (tokens emitted, drafts verified); off by default."""
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "steps"))
    llm = LLM(str(models["agreeing_target"]), dtype="float32",
              speculative_config={"model": str(models["agreeing_head"]), "num_speculative_tokens": K})  # fmt: skip
    outs = llm.generate(_prompts(3, seed=2), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    lines = [json.loads(s) for s in (tmp_path / f"steps.{os.getpid()}").read_text().splitlines()]
    assert len(lines) == llm.engine.num_steps
    assert sum(s["tokens"] for s in lines) == sum(len(o.outputs[0].token_ids) for o in outs) == 36
    assert sum(s["drafts"] for s in lines) > 0 and max(s["passes"] for s in lines) == K
    for s in lines:
        assert s["t1"] > s["t0"] and 0 < s["forward"] <= s["t1"] - s["t0"] and s["drafter"] >= 0
        assert s["rows"] >= s["reqs"] + s["drafts"] > 0 and s["cpu"] > 0
    text = summarise(tmp_path / f"steps.{os.getpid()}", reqs=3, skip=0)
    assert f"{len(lines)} steps" in text and "36 tokens" in text and "3 requests decoding" in text
    assert {s["decision"] for s in lines} == {""}  # a static engine makes no choice
    # An adaptive engine records how it chose each step's lengths: every cap until MIN_DRAFTING_STEPS
    # steps ran the drafter ("static"), then its own decisions. (Steps whose thread got too little
    # CPU never reach the policy, MIN_CPU_SHARE: on a loaded machine it would stay static.)
    monkeypatch.setattr(engine_core_module, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "adaptive"))
    llm = LLM(str(models["agreeing_target"]), dtype="float32", speculative_config={
        "model": str(models["agreeing_head"]), "num_speculative_tokens": K, "adaptive": True})
    llm.generate(_prompts(3, seed=2), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    log = tmp_path / f"adaptive.{os.getpid()}"
    head, *steps = [json.loads(s) for s in log.read_text().splitlines()]
    # Its first line: the profile the policy prices rows on, from which a replay prices them alike.
    costs = llm.engine.adaptive.costs
    assert StepProfile(**head["profile"]) == costs.measured_profile and head["logit_share"] == costs.logit_share
    assert len(steps) == llm.engine.num_steps and all(s["reqs"] <= s["logit_rows"] <= s["rows"] for s in steps)
    replayed = cost_model(log)
    assert replayed.measured_profile == costs.measured_profile and replayed._count == len(steps) - 1 - sum(
        s["cpu"] < engine_core_module.MIN_CPU_SHARE * (s["t1"] - s["t0"]) for s in steps[:-1])
    assert price(replayed, 3, 6).startswith("  priced: 3 requests decoding ")
    # --calibrate: each decode step's time over its price just before, without drafts and with
    text = calibration(log, bucket=4)
    assert text.startswith("  what decode steps took over") and "rel " in text
    row = next(line for line in text.splitlines() if line.split()[0] == "0-3")
    fields = row.split()
    assert int(fields[fields.index("with") + 1]) > 0  # the 3 requests drafted in some decode steps
    decisions = [s["decision"] for s in steps]
    chosen = [d for d in decisions if d]
    assert set(decisions) <= {"", "static", "reused", "fresh", "explore", "wide", "quiet"}
    first_own = next(i for i, d in enumerate(chosen) if d != "static")  # (a step's timing reaches the policy a step late)
    assert MIN_DRAFTING_STEPS <= first_own <= MIN_DRAFTING_STEPS + 1 and "static" not in chosen[first_own:]
    # Each fresh decision (explorations start from one) carries what the cost model predicted: the
    # choice never below drafting nothing, nor below every cap by more than the margin drafting must
    # clear (DRAFT_MIN_GAIN) and the search's own inexactness with per-request costs (policy module).
    predicted = [(s["decision"], s["predicted"]) for s in steps if "predicted" in s]
    assert predicted and len(predicted) == sum(d in ("fresh", "explore", "wide", "quiet") for d in decisions)
    for kind, pr in predicted:  # (a quiet exploration's: the fresh choice it stood in for)
        assert kind in ("fresh", "explore", "wide", "quiet") and pr["base_rows"] >= 1 and pr["draft_rows"] >= 0
        assert pr["chosen"] >= pr["none"] - 0.01 and pr["chosen"] >= pr["caps"] / (1 + DRAFT_MIN_GAIN) / 1.05
        # the parts of the chosen lengths' predicted time: a step, and what drafting adds to it
        parts = [pr[k] for k in ("ms_rows", "ms_first", "ms_passes", "ms_requests")]
        assert pr["ms_step"] > 0 and min(parts) >= 0
        if pr["draft_rows"]:  # drafting at all clears the margin over drafting nothing
            assert pr["chosen"] >= pr["none"] * (1 + DRAFT_MIN_GAIN) - 0.01
        else:
            assert pr["chosen"] == pr["none"] and parts == [0, 0, 0, 0]
    text = summarise(tmp_path / f"adaptive.{os.getpid()}", reqs=3, skip=0)
    assert "adaptive decisions: " in text and f"static {first_own}" in text and "fresh decisions, predicted" in text
    assert "in parts (step without drafts + rows" in text
    # --span keeps the steps within a perf_counter span (one benchmark run's)
    mid = steps[len(steps) // 2]
    text = summarise(tmp_path / f"adaptive.{os.getpid()}", reqs=3, skip=0, span=(mid["t0"], mid["t1"]))
    assert text.startswith(f"{tmp_path / f'adaptive.{os.getpid()}'}: 1 steps")
    monkeypatch.delenv(STEP_LOG_ENV)
    assert LLM(str(models["target"]), dtype="float32").engine._step_log is None
