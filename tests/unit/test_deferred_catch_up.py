"""Deferred drafter catch-up (``spec_decode.proposer``): a request that gets no drafts feeds the
drafter only its prompt positions; its generated ones wait until it drafts again.

* the drafts are the same as with every position fed every step (EAGLE-1, EAGLE-3 and a draft
  model; fp32, and bf16 on the batch-invariant kernels): a catch-up of many positions in one pass
  writes the same drafter KV as one position per step; outputs equal plain decoding;
* a step where no request drafts and none feeds a prompt runs no drafter pass;
* a wait never grows past the proposer's bound (`max_lag`);
* a waiting request's blocks past its drafter KV go to the prefix cache marked without it: a later
  drafting request sharing its prompt and answer (a second chat turn) hits only the blocks whose
  drafter KV is complete, and drafts exactly as well as on a miss;
* lockstep (the vote sized pass 1 for every position) never defers.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from phalanx import LLM, SamplingParams
from phalanx.spec_decode.proposer import MAX_DRAFT_MODEL_LAG, feed_range, max_lag
from tests.tiny_models import VOCAB, make_agreeing_eagle_pair, make_eagle_head, make_model

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deferred")
    target = make_model("LlamaForCausalLM", root / "target", num_hidden_layers=2)
    agreeing_target, agreeing_head = make_agreeing_eagle_pair(root / "agree")
    return {
        "target": target,
        "eagle": make_eagle_head(target, root / "eagle", "eagle"),
        "eagle3": make_eagle_head(target, root / "eagle3", "eagle3"),
        "draft": make_model("LlamaForCausalLM", root / "draft", seed=5, num_hidden_layers=1),
        "agreeing_target": agreeing_target,
        "agreeing_head": agreeing_head,
    }


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))]} for _ in range(n)]


def _spec(method: str, models: dict[str, Path], **extra: object) -> dict:
    kind = {"method": "draft_model"} if method == "draft" else {}
    return {"model": str(models[method]), "num_speculative_tokens": K, **kind, **extra}


def _run(models: dict[str, Path], method: str, dtype: str, max_lag: int | None) -> tuple[list, list, list]:
    """16 requests of staggered lengths, drafting only once 4 or fewer are left
    (`disable_by_batch_size`): every request waits, then catches up a long stretch at once.
    `max_lag`: the proposer's bound on a wait (None: its own; -1: never waits).
    Returns (outputs, every proposal, per proposal: (requests, passes run, waiting requests))."""
    llm = LLM(str(models["target"]), dtype=dtype, max_num_batched_tokens=512,
              speculative_config=_spec(method, models, disable_by_batch_size=4))
    proposer = llm.engine.runner.proposer
    if max_lag is not None:
        proposer.max_lag = max_lag
    calls: list[tuple[list[str], list[list[int]]]] = []
    seen: list[tuple[int, int, int]] = []
    propose = proposer.propose

    def spy(batch):  # noqa: ANN001, ANN202
        drafts = propose(batch)
        calls.append((list(batch.req_ids), [list(d) for d in drafts]))
        waiting = [r for r in batch.req_ids if r in proposer.drafter_kv_ends()]
        seen.append((len(batch.req_ids), proposer.passes_run, len(waiting)))
        for w in getattr(proposer, "_waiting", {}).values():  # EAGLE keeps the waiting features
            assert w.num_positions <= max(proposer.max_lag, 0)
        return drafts

    proposer.propose = spy
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(9, 41, 2)]
    outs = llm.generate(_prompts(16, seed=1), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], calls, seen


@pytest.mark.parametrize(("method", "dtype"), [("eagle", "float32"), ("eagle3", "float32"), ("draft", "float32"),
                                               ("eagle3", "bfloat16")])  # fmt: skip
def test_deferred_catch_up_drafts_the_same(method: str, dtype: str, models: dict[str, Path]) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(9, 41, 2)]
    plain = [o.outputs[0].token_ids for o in
             LLM(str(models["target"]), dtype=dtype).generate(_prompts(16, seed=1), params, use_tqdm=False)]
    deferred, calls, seen = _run(models, method, dtype, None)
    every_step, calls_fed, seen_fed = _run(models, method, dtype, -1)  # -1: never waits
    assert deferred == every_step == plain
    assert calls == calls_fed  # the same drafts for the same requests, step by step
    assert any(w > 0 for _, _, w in seen) and not any(w for _, _, w in seen_fed)
    # Big batches draft nothing: without prompts to feed, the deferring drafter runs no pass there.
    assert any(n > 4 and p == 0 for n, p, _ in seen)
    assert sum(p for _, p, _ in seen) < sum(p for _, p, _ in seen_fed)
    assert any(d for _, drafts in calls for d in drafts)


def test_a_wait_is_bounded(models: dict[str, Path]) -> None:
    """With a bound of 6 positions a waiting request catches up every few steps; the drafts stay the
    same."""
    capped, calls, seen = _run(models, "eagle3", "float32", 6)
    _, calls_fed, _ = _run(models, "eagle3", "float32", -1)
    assert calls == calls_fed
    assert any(w > 0 for _, _, w in seen)


def test_feed_range() -> None:
    # (caught up to, end of what could be fed, prompt length, drafting, may defer, bound) -> feed up to
    lag = 256
    assert feed_range(10, 11, 5, True, True, lag) == 11  # drafting: everything
    assert feed_range(10, 11, 5, False, False, lag) == 11  # lockstep: everything
    assert feed_range(10, 11, 5, False, True, lag) == 10  # a generated position waits
    assert feed_range(0, 12, 9, False, True, lag) == 9  # the prompt is fed, the first answer positions wait
    assert feed_range(4, 12, 20, False, True, lag) == 12  # all prompt
    assert feed_range(10, 10 + lag, 5, False, True, lag) == 10  # a wait of `lag` positions
    assert feed_range(10, 11 + lag, 5, False, True, lag) == 11 + lag  # too long a wait: caught up
    # An EAGLE head's bound keeps MAX_WAIT_BYTES of features; a draft model's only sizes one pass.
    assert max_lag(3 * 576 * 2) == 606 and max_lag(3 * 4096 * 2) == 85 and max_lag(256 * 2) == 4096
    assert MAX_DRAFT_MODEL_LAG == 2048


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_second_turn_hits_only_blocks_with_drafter_kv(method: str, models: dict[str, Path], tmp_path: Path) -> None:
    """Turn 1 runs beside two longer requests with `disable_by_batch_size` 2: it never drafts, so its
    answer's positions never reach the drafter. Turn 2 (its prompt + answer + more) hits the prefix
    cache only on the prompt's whole blocks and, its drafter agreeing with the target on every
    token, accepts as much as on a miss; a hit on turn 1's answer blocks would have left it
    drafting from missing drafter KV there."""
    block = 8
    if method == "draft":  # the draft is the target itself
        target = models["target"]
        spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": K}
    else:
        target = models["agreeing_target"]
        spec = {"model": str(models["agreeing_head"]), "num_speculative_tokens": K}
    spec["disable_by_batch_size"] = 2
    first = [(5 * i + 7) % 300 + 3 for i in range(20)]
    others = [[(3 * i + j) % 300 + 3 for i in range(12)] for j in (11, 12)]
    greedy = {"temperature": 0.0, "ignore_eos": True}

    llm = LLM(str(target), dtype="float32", block_size=block, speculative_config=spec)
    turn1, *_ = llm.generate([{"prompt_token_ids": p} for p in [first, *others]],
                             [SamplingParams(max_tokens=n, **greedy) for n in (24, 40, 40)], use_tqdm=False)
    assert turn1.outputs[0].num_draft_tokens == 0  # it always ran beside the others: it never drafted
    second = first + list(turn1.outputs[0].token_ids) + [9, 10, 11]
    params = SamplingParams(max_tokens=12, **greedy)
    hit = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    miss = LLM(str(target), dtype="float32", block_size=block, speculative_config=spec).generate(
        [{"prompt_token_ids": second}], params, use_tqdm=False)[0]

    assert hit.num_cached_tokens == (len(first) // block) * block  # the prompt's whole blocks only
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert miss.outputs[0].num_accepted_tokens == miss.outputs[0].num_draft_tokens > 0
    assert hit.outputs[0].num_draft_tokens == miss.outputs[0].num_draft_tokens
    assert hit.outputs[0].num_accepted_tokens == miss.outputs[0].num_accepted_tokens


def _drafts_by_position(llm: LLM) -> dict[tuple[str, int], list[int]]:
    """Every proposal's drafts, by (request, tokens it had): what a correct drafter KV determines."""
    proposer = llm.engine.runner.proposer
    seen: dict[tuple[str, int], list[int]] = {}
    propose = proposer.propose

    def spy(batch):  # noqa: ANN001, ANN202
        drafts = propose(batch)
        for r, tokens, d in zip(batch.req_ids, batch.token_ids, drafts):
            if d:
                seen[(r, len(tokens))] = list(d)
        return drafts

    proposer.propose = spy
    return seen


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_waits_survive_preemption_chunking_and_prefix_hits(method: str, models: dict[str, Path]) -> None:
    """`disable_by_batch_size` 2 so that most steps defer, prompts chunked 10 tokens a step, a cache
    so small that waiting requests are preempted and recomputed, and (a roomier engine) a second
    round over the same prompts that hits the prefix cache: outputs are plain decoding's, and each
    request's drafts at each length equal those of an engine that feeds every position every step
    (the schedules differ — fewer blocks are published while requests wait — but the drafts a
    request gets at a given length depend only on its drafter KV being right)."""
    target = str(models["target"])
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for i in range(n)]} for j, n in enumerate([5, 23, 9, 31, 14])]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 12, 40, 22, 35)]
    plain = [o.outputs[0].token_ids for o in LLM(target, dtype="float32").generate(prompts, params, use_tqdm=False)]
    spec = _spec(method, models, disable_by_batch_size=2)
    runs = []
    for never_waits in (False, True):  # the proposer's own bound; none (every position fed every step)
        tight = LLM(target, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=20,
                    max_num_batched_tokens=10, speculative_config=spec)
        roomy = LLM(target, dtype="float32", block_size=4, max_num_batched_tokens=10, speculative_config=spec)
        if never_waits:
            tight.engine.runner.proposer.max_lag = roomy.engine.runner.proposer.max_lag = -1
        drafts = [_drafts_by_position(tight), _drafts_by_position(roomy)]
        for llm, rounds in ((tight, 1), (roomy, 2)):
            for _ in range(rounds):
                outs = llm.generate(prompts, params, use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outs] == plain
        assert tight.get_metrics()["num_preemptions"] > 0
        assert sum(o.num_cached_tokens for o in outs) > 0  # the roomy engine's second round hit the cache
        runs.append(drafts)
    for waited, fed in zip(*runs):
        common = waited.keys() & fed.keys()
        assert len(common) > 10
        for key in common:
            n = min(len(waited[key]), len(fed[key]))
            assert waited[key][:n] == fed[key][:n], key
