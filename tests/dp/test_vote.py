"""The vote's decision function (rules 2-4 of DESIGN §5): the plan is the specified function of the
gathered table (checked against the rules written out per rank state, each rank's requests with
their own draft lengths 0..k), it covers every rank's needs, and ranks that each vote only their
own row over a real gloo group all derive that same plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.distributed.vote import (
    NUM_FIELDS,
    StepPlan,
    VoteField,
    VoteMismatch,
    decide,
    depth_counts,
    local_row,
    row_width,
)

rank_state = st.tuples(
    st.booleans(),  # has work
    st.integers(0, 300),  # tokens
    st.integers(0, 20),  # reqs
    st.lists(st.integers(0, 5), max_size=20),  # draft lengths of the requests reaching their end
    st.booleans(),  # shutdown (rare below)
)
RankState = tuple[bool, int, int, list[int], bool]


def _row(state: RankState, k: int, step: int) -> torch.Tensor:
    has_work, tokens, reqs, lengths, shutdown = state
    counts = depth_counts(lengths, k)
    return local_row(has_work, tokens, reqs, counts[0] if counts else 0, shutdown, step, deeper=counts[1:])


def _expected_plan(states: list[RankState], k: int, drafter: bool, step: int) -> StepPlan:
    """DESIGN §5 written out per rank state, independently of `decide`'s tensor code."""
    shutdown = any(s[4] for s in states)
    tokens = max(s[1] for s in states)
    run = tokens > 0 and not shutdown
    sizes: tuple[int, ...] = ()
    if run and drafter and k > 0:
        # Pass 1 with every forward (a draft model also feeds each request's new token); pass j
        # (j >= 2) for every rank iff some rank has a request drafting j tokens, sized by the
        # rank with the most such requests.
        deepest = max((d for s in states for d in s[3]), default=0)
        later = tuple(max(sum(1 for d in s[3] if d >= j) for s in states) for j in range(2, deepest + 1))
        sizes = (max(s[1] + s[2] for s in states), *later)
    return StepPlan(run_forward=run, num_tokens=tokens if run else 0, draft_pass_sizes=sizes, shutdown=shutdown,
                    step=step, any_work=any(s[0] for s in states))


def _rank_states(states: list[tuple], k: int) -> list[RankState]:
    out = []
    for has_work, tokens, reqs, lengths, shutdown in states:
        reqs = min(reqs, tokens)  # a rank schedules at least one token per request
        lengths = [min(d, k) for d in lengths[:reqs]]  # requests reaching their end; at most k drafts
        out.append((has_work or tokens > 0, tokens, reqs, lengths, shutdown and tokens % 7 == 0))
    return out


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(rank_state, min_size=1, max_size=5),
    k=st.integers(0, 5),
    drafter=st.booleans(),
    step=st.integers(0, 10_000),
    perm_seed=st.integers(0, 1000),
)
def test_the_plan_is_the_specified_function_of_the_gathered_table(states, k, drafter, step, perm_seed) -> None:  # noqa: ANN001
    states = _rank_states(states, k)
    table = torch.stack([_row(s, k, step) for s in states])
    before = table.clone()
    plan = decide(table, k, drafter)
    assert torch.equal(table, before)  # the table is read, never changed
    assert plan == _expected_plan(states, k, drafter, step)
    # What the plan guarantees every rank (rules 3 and 4).
    tokens = table[:, VoteField.NUM_TOKENS]
    if plan.run_forward:
        assert all(plan.num_tokens >= int(t) for t in tokens)  # one padded size covering all
        if drafter and k > 0:
            # Every rank runs as many passes as the deepest request of any rank needs ...
            deepest = max((d for s in states for d in s[3]), default=0)
            assert len(plan.draft_pass_sizes) == max(deepest, 1)
            assert plan.draft_pass_sizes[0] >= int((tokens + table[:, VoteField.NUM_REQS]).max())
            # ... and each pass has room for every rank's requests drafting that deep.
            for s in states:
                for j, size in enumerate(plan.draft_pass_sizes[1:], start=2):
                    assert size >= sum(1 for d in s[3] if d >= j)
    else:
        assert plan.draft_pass_sizes == () and plan.num_tokens == 0
    # The plan depends on the set of rank states, not on which rank holds which.
    perm = torch.randperm(len(states), generator=torch.Generator().manual_seed(perm_seed))
    assert decide(table[perm], k, drafter) == plan


def _vote_rank(rank: int, size: int, port: int, rows: list[list[RankState]], k: int, results) -> None:  # noqa: ANN001
    from phalanx.distributed.group import DPGroup

    group = DPGroup(rank, size, f"tcp://127.0.0.1:{port}", 60.0)
    try:
        plans = []
        for states in rows:  # one vote per iteration, each rank contributing only its own row
            plans.append(decide(group.vote(_row(states[rank], k, group.step)), k, True))
            group.step += 1
        results.put((rank, plans))
    finally:
        group.close()


def test_ranks_gathering_their_own_rows_derive_the_same_plan() -> None:
    """Three ranks in a real gloo group, each voting only its local row: after the all-gather every
    rank holds the same table and derives the same plan, the one the rank states specify."""
    import random

    from phalanx.net import free_port
    from tests.dp.harness import fork_context

    rng = random.Random(0)
    size, k = 3, 3
    rows = [_rank_states([(rng.random() < 0.5, rng.choice([0, 0, rng.randint(1, 300)]), rng.randint(0, 20),
                           [rng.randint(0, k) for _ in range(rng.randint(0, 20))], rng.random() < 0.05)
                          for _ in range(size)], k) for _ in range(20)]
    ctx = fork_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_vote_rank, args=(r, size, port, rows, k, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in range(size))  # a ceiling against a hang
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = [_expected_plan(states, k, True, step) for step, states in enumerate(rows)]
    assert got == {r: expected for r in range(size)}
    assert any(p.run_forward for p in expected) and any(not p.run_forward for p in expected)


def test_ranks_at_different_iterations_are_an_error() -> None:
    table = torch.stack([local_row(True, 3, 1, 1, False, 7, (1, 1)), local_row(True, 3, 1, 1, False, 8, (1, 1))])
    with pytest.raises(VoteMismatch, match=r"different lockstep iterations: \[7, 8\]"):
        decide(table, 3, True)


def test_row_layout_is_fixed() -> None:
    """The row's width depends on k alone (the same on every rank), never on the batch."""
    assert local_row(True, 1, 1, 0, False, 0).shape == (NUM_FIELDS,)
    assert _row((True, 9, 3, [3, 0, 1], False), 5, 0).shape == (row_width(5),) == (NUM_FIELDS + 4,)
    assert _row((True, 9, 3, [], False), 5, 0).shape == (row_width(5),)
    with pytest.raises(VoteMismatch, match="k = 3 needs 8"):  # a row without its depth columns
        decide(torch.stack([local_row(True, 3, 1, 1, False, 0)]), 3, True)


def test_depth_counts() -> None:
    assert depth_counts([3, 1, 0, 2], 3) == [3, 2, 1]
    assert depth_counts([], 2) == [0, 0]
    assert depth_counts([1, 1], 0) == []


def test_passes_follow_the_deepest_request_of_any_rank() -> None:
    """Rank 0 drafts [1, 3] tokens, rank 1 [2, 2, 0]: pass 1 (catch-up) sized by tokens + reqs, pass 2
    by the most requests drafting >= 2 on one rank (rank 1's two), pass 3 by rank 0's one; no pass 4
    although k = 4."""
    states = [(True, 10, 2, [1, 3], False), (True, 5, 3, [2, 2, 0], False)]
    plan = decide(torch.stack([_row(s, 4, 0) for s in states]), 4, True)
    assert plan.draft_pass_sizes == (12, 2, 1)
