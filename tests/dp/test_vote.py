"""The vote's decision function: every rank derives the same plan from the gathered table, and the
plan covers every rank's needs (rules 2-4 of DESIGN §5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.distributed.vote import NUM_FIELDS, VoteField, VoteMismatch, decide, local_row

rank_state = st.tuples(
    st.booleans(),  # has work
    st.integers(0, 300),  # tokens
    st.integers(0, 20),  # reqs
    st.integers(0, 20),  # sampling
    st.booleans(),  # shutdown (rare below)
)


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(rank_state, min_size=1, max_size=5),
    k=st.integers(0, 5),
    drafter=st.booleans(),
    step=st.integers(0, 10_000),
    perm_seed=st.integers(0, 1000),
)
def test_every_rank_derives_the_same_covering_plan(states, k, drafter, step, perm_seed) -> None:  # noqa: ANN001
    rows = []
    for has_work, tokens, reqs, sampling, shutdown in states:
        reqs = min(reqs, tokens)  # a rank schedules at least one token per request
        sampling = min(sampling, reqs)
        rows.append(local_row(has_work or tokens > 0, tokens, reqs, sampling, shutdown and tokens % 7 == 0, step))
    table = torch.stack(rows)
    # Each rank gets its own copy of the gathered table (as all_gather delivers it).
    plans = [decide(table.clone(), k, drafter) for _ in rows]
    assert all(p == plans[0] for p in plans)
    plan = plans[0]
    tokens = table[:, VoteField.NUM_TOKENS]
    if plan.shutdown:
        assert not plan.run_forward
        return
    assert plan.run_forward == bool((tokens > 0).any())
    if not plan.run_forward:
        assert plan.draft_pass_sizes == ()
        return
    assert all(plan.num_tokens >= int(t) for t in tokens)  # rule 4: one padded size covering all
    if drafter and k > 0:
        sampling = table[:, VoteField.NUM_SAMPLING]
        assert len(plan.draft_pass_sizes) == (k if bool((sampling > 0).any()) else 1)
        assert plan.draft_pass_sizes[0] >= int((tokens + table[:, VoteField.NUM_REQS]).max())
        assert all(s >= int(sampling.max()) for s in plan.draft_pass_sizes[1:])
    else:
        assert plan.draft_pass_sizes == ()
    # The plan depends on the set of rank states, not on which rank holds which.
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(perm_seed))
    assert decide(table[perm], k, drafter) == plan


def test_ranks_at_different_iterations_are_an_error() -> None:
    table = torch.stack([local_row(True, 3, 1, 1, False, 7), local_row(True, 3, 1, 1, False, 8)])
    with pytest.raises(VoteMismatch, match=r"different lockstep iterations: \[7, 8\]"):
        decide(table, 3, True)


def test_row_layout_is_fixed() -> None:
    assert local_row(True, 1, 1, 0, False, 0).shape == (NUM_FIELDS,)
