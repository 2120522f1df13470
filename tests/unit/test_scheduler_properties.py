"""Property tests of the block pool and scheduler: random add / abort / step sequences never leak
or double-free a block, the pool's bookkeeping stays consistent, and everything is free at the end.

The model is faked: every request that catches up samples a pseudo-random token, and drafts are
random, so the scheduler's paths run without torch. The hypothesis test draws the sequences;
`test_a_fixed_sequence_reaches_preemption_prefix_hits_and_chunking` pins that the same run does reach
preemption, prefix-cache hits, chunked prefills and speculative steps (with the same checks on), so a
change that made those paths unreachable here would fail rather than go untested.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.config import CacheConfig, SchedulerConfig
from phalanx.core.outputs import ModelRunnerOutput, SchedulerOutput
from phalanx.core.scheduler import Scheduler
from phalanx.request import Request
from phalanx.sampling_params import SamplingParams


def _check_pool(s: Scheduler) -> None:
    pool = s.kv.pool
    held: dict[int, int] = {}
    for blocks in s.kv.req_blocks.values():
        for b in blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == held.get(b.block_id, 0), f"block {b.block_id} ref_cnt {b.ref_cnt} != holders"
        assert (b.ref_cnt == 0) == (b.block_id in pool._free)
    for h, b in pool.cached.items():
        assert b.block_hash == h
    for req in s.running:
        need = -(-req.num_computed_tokens // s.kv.block_size)
        assert len(s.kv.req_blocks.get(req.req_id, [])) >= need


def _fake_run(sched: SchedulerOutput, s: Scheduler, rng: random.Random, k: int) -> ModelRunnerOutput:
    req_ids = list(sched.num_scheduled_tokens)
    sampled, drafts = [], []
    for rid in req_ids:
        req = s.requests[rid]
        n = sched.num_scheduled_tokens[rid]
        spec = sched.scheduled_spec_tokens.get(rid, [])
        caught_up = req.num_computed_tokens + n - len(spec) == req.num_tokens
        assert caught_up == (rid in sched.reaching_end)  # the vote and the runner read this set
        if caught_up:
            accepted = rng.randint(0, len(spec))
            sampled.append(spec[:accepted] + [rng.randint(0, 50)])
        else:
            sampled.append([])
        drafts.append([rng.randint(0, 50) for _ in range(k)])
    out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, spec_token_ids=drafts if k else None)
    if k:  # a model drafter whose KV lags behind for some requests (a deferred catch-up, an opt-out)
        out.drafter_kv_end = {r: rng.randint(0, s.requests[r].num_computed_tokens) for r in req_ids if rng.random() < 0.3}
    return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.integers(1, 6)),
    ),
    max_size=60,
)


@settings(max_examples=600, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 64),
    k=st.sampled_from([0, 0, 2]),
    caching=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_operations_never_leak(ops, num_blocks, block_size, budget, k, caching, seed) -> None:  # noqa: ANN001
    run_ops(ops, num_blocks, block_size, budget, k, caching, seed)


def run_ops(ops, num_blocks: int, block_size: int, budget: int, k: int, caching: bool, seed: int) -> dict:  # noqa: ANN001
    """Run `ops` on a fresh scheduler with the pool and step checked after every schedule and update,
    drain it, check that every block is free; returns what the run went through."""
    seen = {"chunked": 0, "spec_steps": 0}
    max_len = min(num_blocks * block_size, 64)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        num_spec_tokens=k,
    )
    rng = random.Random(seed)
    lookup = s.kv.get_computed_blocks

    def checked_lookup(req: Request, need_drafter_kv: bool = False):  # noqa: ANN202
        assert need_drafter_kv == (k > 0 and req.sampling_params.speculative)
        hit, n = lookup(req, need_drafter_kv)
        assert not need_drafter_kv or all(b.drafter_kv for b in hit)  # a drafting request's hits
        return hit, n

    s.kv.get_computed_blocks = checked_lookup
    prefixes = [[rng.randint(0, 50) for _ in range(30)] for _ in range(4)]
    added = 0
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prefix, speculative = op
            plen = min(plen, max_len - 1)
            prompt = (prefixes[prefix] + [rng.randint(0, 50) for _ in range(plen)])[:plen]
            params = SamplingParams(max_tokens=max_tokens, speculative=speculative)
            req = Request(f"r{added}", prompt, params, eos_token_ids=(0,))
            req.max_tokens = min(max_tokens, max_len - plen)
            s.add_request(req)
            added += 1
        elif op[0] == "abort":
            if added:  # pick among the requests added so far, running or not
                s.abort_requests([f"r{op[1] % added}"])
        else:
            for _ in range(op[1]):
                sched = s.schedule()
                _check_pool(s)
                # what the step holds, counted from its parts (the total is derived from the budget)
                assert sum(sched.num_scheduled_tokens.values()) == sched.total_num_scheduled_tokens <= budget
                for req_id, n in sched.num_scheduled_tokens.items():
                    req = s.requests[req_id]
                    assert req.num_computed_tokens + n <= max_len, (req_id, req.num_computed_tokens, n)
                seen["chunked"] += sum(1 for r in sched.new_reqs
                                       if r.num_computed_tokens + sched.num_scheduled_tokens[r.req_id]
                                       < len(r.prompt_token_ids))
                seen["spec_steps"] += bool(sched.scheduled_spec_tokens)
                out = _fake_run(sched, s, rng, k)
                s.update_from_output(sched, out)
                _check_pool(s)
    # Drain: everything finishes (no livelock), then every block is free.
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        sched = s.schedule()
        s.update_from_output(sched, _fake_run(sched, s, rng, k))
        _check_pool(s)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks
    assert not s.kv.req_blocks
    return {**seen, "preemptions": s.num_preemptions, "prefix_hits": s.kv.prefix_hits}


def test_a_fixed_sequence_reaches_preemption_prefix_hits_and_chunking() -> None:
    """Long prompts sharing a prefix, more of them than a small pool holds, a budget below a prompt:
    the checked run above must go through every path its docstring names."""
    ops = [("add", 30, 10, 0, True), ("step", 2), ("add", 30, 10, 1, True), ("add", 30, 10, 2, False),
           ("add", 30, 10, 0, True), ("step", 8), ("add", 30, 10, 0, True), ("abort", 2), ("step", 8)]
    seen = run_ops(ops, num_blocks=20, block_size=4, budget=16, k=2, caching=True, seed=3)
    assert seen["preemptions"] > 0, seen
    assert seen["prefix_hits"] > 0, seen
    assert seen["chunked"] > 0, seen
    assert seen["spec_steps"] > 0, seen
