"""The adaptive draft-length policy (``spec_decode.policy``) and what it measures
(``spec_decode.adaptive``).

* `choose_draft_lengths` is exact: on random acceptance rates, caps and non-decreasing step costs
  its choice reaches the best tokens-per-second ratio that brute force over every length vector
  finds, stays within the caps, and reads its inputs without changing them (hypothesis);
* its limits behave as a user expects: free rows and free passes -> every request drafts its cap;
  nothing ever accepted -> nobody drafts; one expensive pass -> depth 1 only;
* acceptance counts give conditional per-position rates and follow the recent text; the step-cost
  curve interpolates what was measured, never decreases, and extrapolates along the prior shape.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import phalanx.spec_decode.adaptive as adaptive_module
from phalanx.spec_decode.adaptive import (
    BULK_FEED,
    CORNER_GRID_REACH,
    COSTLY_EXPLORE_EVERY,
    EXPLORE_EVERY,
    LOWEST_SLOPE,
    MIN_DRAFTING_STEPS,
    PARK_AFTER,
    PRIOR_FIXED_ROWS,
    PROFILE_ROWS,
    QUIET_EXPLORE_EVERY,
    QUIET_STEPS,
    REUSE_DECISIONS,
    WIDE_EXPLORE_EVERY,
    AcceptanceStats,
    AdaptiveDrafting,
    StepCostModel,
    explore,
)
from phalanx.spec_decode.policy import (
    choose_draft_lengths,
    choose_draft_lengths_small,
    expected_tokens,
    prefer_uniform,
    step_rate,
)


def _ratio(accept: np.ndarray, lengths: np.ndarray, step_cost: np.ndarray, pass_cost: float,
           first_cost: float) -> float:
    depth = int(lengths.max(initial=0))
    drafter = (first_cost + pass_cost * (depth - 1)) if depth else 0.0
    return expected_tokens(accept, lengths) / (step_cost[int(lengths.sum())] + drafter)


@st.composite
def _problems(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    num_reqs = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    accept = draw(arrays(np.float64, (num_reqs, k), elements=st.floats(0.0, 1.0)))
    caps = np.array(draw(st.lists(st.integers(0, k), min_size=num_reqs, max_size=num_reqs)), dtype=np.int64)
    base = draw(st.floats(0.01, 10.0))
    steps = draw(arrays(np.float64, int(caps.sum()), elements=st.floats(0.0, 2.0)))
    step_cost = base + np.concatenate(([0.0], np.cumsum(steps)))  # non-decreasing, > 0
    pass_cost = draw(st.floats(0.0, 5.0))
    first_cost = draw(st.sampled_from([0.0, 0.0, draw(st.floats(0.0, 5.0))]))
    return accept, caps, step_cost, pass_cost, first_cost


@settings(max_examples=400, deadline=None)
@given(_problems())
def test_the_choice_is_the_brute_force_optimum(problem) -> None:  # noqa: ANN001
    accept, caps, step_cost, pass_cost, first_cost = problem
    before = (accept.copy(), caps.copy(), step_cost.copy())
    lengths = choose_draft_lengths(accept, caps, step_cost, pass_cost, first_cost)
    assert np.array_equal(accept, before[0]) and np.array_equal(caps, before[1])
    assert np.array_equal(step_cost, before[2])  # pure: nothing it reads is changed
    assert lengths.dtype == np.int64 and lengths.shape == caps.shape
    assert ((lengths >= 0) & (lengths <= caps)).all()
    best = max(
        _ratio(accept, np.array(d), step_cost, pass_cost, first_cost)
        for d in itertools.product(*(range(c + 1) for c in caps))
    )
    assert _ratio(accept, lengths, step_cost, pass_cost, first_cost) >= best * (1 - 1e-9)


@settings(max_examples=300, deadline=None)
@given(_problems())
def test_the_plain_python_path_chooses_the_same(problem) -> None:  # noqa: ANN001
    """`choose_draft_lengths_small` (plain Python, low concurrency) == `choose_draft_lengths`."""
    accept, caps, step_cost, pass_cost, first_cost = problem
    small = choose_draft_lengths_small(accept.tolist(), caps.tolist(), step_cost.tolist(), pass_cost, first_cost)
    assert small == choose_draft_lengths(accept, caps, step_cost, pass_cost, first_cost).tolist()


@settings(max_examples=300, deadline=None)
@given(_problems(), st.sampled_from([0.0, 0.03, 0.2]))
def test_drafting_must_beat_drafting_nothing_by_the_minimum_gain(problem, min_gain) -> None:  # noqa: ANN001
    """With `min_gain` the choice is the optimum where that beats drafting nothing by more than
    min_gain, and nothing elsewhere; both paths agree."""
    accept, caps, step_cost, pass_cost, first_cost = problem
    best = choose_draft_lengths(accept, caps, step_cost, pass_cost, first_cost)
    lengths = choose_draft_lengths(accept, caps, step_cost, pass_cost, first_cost, min_gain)
    small = choose_draft_lengths_small(accept.tolist(), caps.tolist(), step_cost.tolist(), pass_cost, first_cost,
                                       min_gain)
    assert small == lengths.tolist()
    gain = _ratio(accept, best, step_cost, pass_cost, first_cost) / (caps.shape[0] / step_cost[0]) - 1.0
    if gain > min_gain * (1 + 1e-6) + 1e-9:
        assert lengths.tolist() == best.tolist()
    elif gain <= min_gain * (1 - 1e-6):
        assert (lengths == 0).all()


@settings(max_examples=300, deadline=None)
@given(_problems(), st.floats(0.0, 3.0))
def test_a_cost_per_drafting_request_is_priced_exactly_where_the_search_is_exact(problem, request_cost) -> None:  # noqa: ANN001
    """With a cost per request that drafts at all both paths choose alike, and the choice is the
    brute-force optimum where every candidate drafts one deep or there is one request (the module
    docstring: elsewhere the same candidates, each priced exactly)."""
    accept, caps, step_cost, pass_cost, first_cost = problem
    lengths = choose_draft_lengths(accept, caps, step_cost, pass_cost, first_cost, request_cost=request_cost)
    small = choose_draft_lengths_small(accept.tolist(), caps.tolist(), step_cost.tolist(), pass_cost, first_cost,
                                       request_cost=request_cost)
    assert small == lengths.tolist()
    assert ((lengths >= 0) & (lengths <= caps)).all()

    def rate(d: list[int]) -> float:
        return step_rate(accept, d, step_cost.tolist(), pass_cost, first_cost, request_cost=request_cost)

    best = max(rate(list(d)) for d in itertools.product(*(range(c + 1) for c in caps)))
    got = rate(lengths.tolist())
    assert got <= best * (1 + 1e-9)
    if accept.shape[0] == 1 or int(caps.max(initial=0)) <= 1:
        assert got >= best * (1 - 1e-9)


def test_a_costly_request_drafts_for_fewer_requests() -> None:
    """Four requests accepting 90 / 80 / 40 / 35 % of one draft, a row 0.05 of a step: all four
    draft while a drafting request costs nothing more, the two best where each costs 0.1 of a step,
    none at 0.3 (the best one's draft then loses: 1.9 tokens in 1.35 steps)."""
    accept = np.array([[0.9], [0.8], [0.4], [0.35]])
    step_cost = 1.0 + 0.05 * np.arange(5)
    caps = np.ones(4, dtype=np.int64)
    assert choose_draft_lengths(accept, caps, step_cost, 0.0).tolist() == [1, 1, 1, 1]
    assert choose_draft_lengths(accept, caps, step_cost, 0.0, request_cost=0.1).tolist() == [1, 1, 0, 0]
    assert choose_draft_lengths(accept, caps, step_cost, 0.0, request_cost=0.3).tolist() == [0, 0, 0, 0]


def test_a_small_predicted_gain_is_not_drafted_for() -> None:
    """Two requests accepting 30 %, a draft row costing ~0.137 of a step: one draft each is +2 %
    (2.6 tokens in 1.2745 against 2 in 1), below a 3 % minimum."""
    accept, caps = np.full((2, 1), 0.3), np.array([1, 1])
    step_cost = np.array([1.0, 1.137, 1.2745])
    assert choose_draft_lengths(accept, caps, step_cost, 0.0).tolist() == [1, 1]
    assert choose_draft_lengths(accept, caps, step_cost, 0.0, min_gain=0.03).tolist() == [0, 0]


@settings(max_examples=100, deadline=None)
@given(_problems())
def test_an_equally_good_choice_with_fewer_drafts_is_preferred(problem) -> None:  # noqa: ANN001
    """Ties go to fewer passes, then fewer rows: with nothing ever accepted nobody drafts."""
    _, caps, step_cost, pass_cost, first_cost = problem
    lengths = choose_draft_lengths(np.zeros((caps.shape[0], 4)), caps, step_cost, pass_cost, first_cost)
    assert (lengths == 0).all()


def _uniform(caps: list[int], j: int) -> list[int]:
    return [min(j, c) for c in caps]


@settings(max_examples=300, deadline=None)
@given(_problems(), st.floats(0.0, 1.0), st.sampled_from([0.0, 0.03, 0.2]), st.sampled_from([0.0, 0.03, 0.2]))
def test_a_choice_of_mixed_depths_must_beat_every_uniform_one_by_the_margin(problem, request_cost, margin,
                                                                             min_gain) -> None:  # noqa: ANN001
    """`prefer_uniform` keeps the optimum where it drafts nothing, is uniform or beats every
    uniform choice by more than `margin`; otherwise it returns the best uniform choice where that
    beats drafting nothing by more than `min_gain`, and nothing elsewhere. Pure; numpy or lists alike."""
    accept, caps_a, step_cost, pass_cost, first_cost = problem
    caps = caps_a.tolist()
    chosen = choose_draft_lengths(accept, caps_a, step_cost, pass_cost, first_cost, min_gain, request_cost).tolist()
    before = (accept.copy(), list(chosen), step_cost.copy())
    got = prefer_uniform(accept, chosen, caps, step_cost, pass_cost, first_cost, request_cost, margin, min_gain)
    assert np.array_equal(accept, before[0]) and chosen == before[1] and np.array_equal(step_cost, before[2])
    assert got == prefer_uniform(accept.tolist(), chosen, caps, step_cost.tolist(), pass_cost, first_cost,
                                 request_cost, margin, min_gain)

    def rate(d: list[int]) -> float:
        return step_rate(accept, d, step_cost.tolist(), pass_cost, first_cost, request_cost=request_cost)

    top = max(caps, default=0)
    uniform = [_uniform(caps, j) for j in range(1, top + 1)]
    none = rate([0] * len(caps))
    if not any(chosen) or chosen in uniform:
        assert got == chosen
        return
    best = max(rate(u) for u in uniform)
    if got == chosen:
        assert rate(chosen) > max(best, none * (1 + min_gain)) * (1 + margin) * (1 - 1e-9)
        return
    assert rate(chosen) <= max(best, none * (1 + min_gain)) * (1 + margin) * (1 + 1e-9)
    if any(got):
        assert got in uniform and rate(got) >= best * (1 - 1e-9) and rate(got) > none * (1 + min_gain) * (1 - 1e-9)
    else:
        assert best <= none * (1 + min_gain) * (1 + 1e-9)


def test_a_mixed_choice_that_barely_wins_gives_way_to_one_depth_for_all() -> None:
    """Two requests accepting 90 % and 50 % of each draft, a row 0.05 of a step, a pass after the
    first 0.05: the optimum drafts 3 and 2 (5.189 tokens in 1.35 steps, 3.844 a step) is 1.3 % above
    both drafting 3 (5.314 in 1.4, 3.796). With a 3 % margin both draft 3, with none 3 and 2; where the second accepts 30 % the optimum, 3 and 0, wins by 11 %
    over the best uniform choice and stands at 3 %."""
    caps = [3, 3]
    step_cost = 1.0 + 0.05 * np.arange(7)
    accept = np.array([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5]])
    chosen = choose_draft_lengths(accept, np.array(caps), step_cost, 0.05).tolist()
    assert chosen == [3, 2]
    assert prefer_uniform(accept, chosen, caps, step_cost, 0.05, margin=0.0) == [3, 2]
    assert prefer_uniform(accept, chosen, caps, step_cost, 0.05, margin=0.03) == [3, 3]
    low = np.array([[0.9, 0.9, 0.9], [0.3, 0.3, 0.3]])
    step_cost = 1.0 + 0.1 * np.arange(7)
    chosen = choose_draft_lengths(low, np.array(caps), step_cost, 0.05).tolist()
    assert chosen == [3, 0]
    assert prefer_uniform(low, chosen, caps, step_cost, 0.05, margin=0.03) == [3, 0]
    assert prefer_uniform(accept, [1, 0], [1, 0], step_cost, 0.05, margin=0.5) == [1, 0]  # capped: uniform


def test_free_rows_and_passes_draft_every_cap() -> None:
    accept = np.full((3, 4), 0.3)
    caps = np.array([4, 2, 0])
    lengths = choose_draft_lengths(accept, caps, np.ones(7), 0.0)
    assert lengths.tolist() == [4, 2, 0]


def test_costly_rows_stop_drafting_where_acceptance_is_low() -> None:
    """Rows cost 0.1 of a step each: a draft pays iff its acceptance probability beats the tokens per
    unit time it dilutes. A request accepting 95 % drafts deep, one accepting 5 % not at all."""
    accept = np.array([[0.95] * 4, [0.05] * 4])
    step_cost = 1.0 + 0.1 * np.arange(9)
    lengths = choose_draft_lengths(accept, np.array([4, 4]), step_cost, 0.0)
    assert lengths.tolist() == [4, 0]


def test_an_expensive_pass_keeps_drafts_one_deep() -> None:
    accept = np.full((2, 3), 0.9)
    lengths = choose_draft_lengths(accept, np.array([3, 3]), np.ones(7), pass_cost=10.0)
    assert lengths.tolist() == [1, 1]


def test_a_costly_first_pass_is_paid_only_for_enough_gain() -> None:
    """The drafter's first pass runs only when something is drafted: two requests accepting 30 %
    draft while it costs a tenth of a step, nothing when it costs as much as their gain."""
    accept = np.full((2, 3), 0.3)
    step_cost = 1.0 + 0.01 * np.arange(7)
    assert choose_draft_lengths(accept, np.array([3, 3]), step_cost, 0.0, first_cost=0.1).tolist() == [3, 3]
    assert choose_draft_lengths(accept, np.array([3, 3]), step_cost, 0.0, first_cost=0.5).tolist() == [0, 0]


def test_step_cost_too_short_is_an_error() -> None:
    with pytest.raises(ValueError, match="step_cost needs 4 entries"):
        choose_draft_lengths(np.ones((1, 3)), np.array([3]), np.ones(2), 0.0)


def test_no_requests_or_no_room() -> None:
    assert choose_draft_lengths(np.ones((0, 3)), np.zeros(0, dtype=np.int64), np.ones(1), 0.0).tolist() == []
    assert choose_draft_lengths(np.ones((2, 3)), np.array([0, 0]), np.ones(1), 0.0).tolist() == [0, 0]


def test_acceptance_rates_are_conditional_per_position() -> None:
    """3 drafts, 1 accepted: positions 1 and 2 were tested, position 3 was not (its rate is the
    request's own rate at position 2 times the engine-wide ratio there: 0); position 1 accepted,
    position 2 rejected."""
    stats = AcceptanceStats(3, prior=0.5, prior_weight=1e-9, request_weight=1e-9)
    for _ in range(5):
        stats.observe("a", 3, 1)
    rates = stats.rates(["a"])[0]
    assert rates[0] == pytest.approx(1.0) and rates[1] == pytest.approx(0.0, abs=1e-6)
    assert rates[2] == pytest.approx(0.0, abs=1e-6)  # never tested: from position 2's
    stats.observe("b", 2, 2)  # both accepted; no third draft, so position 3 is not tested
    decayed = sum(0.995**i for i in range(1, 6))  # "a"'s five tests, decayed once per later test
    assert stats.engine_tested == pytest.approx([decayed + 1, decayed + 1, 0.0])


def test_a_rarely_tested_position_keeps_what_its_tests_said() -> None:
    """Third drafts were tried 10 times and always accepted; then the policy drafts one token for a
    long spell (2,000 verifications of position 1 only). Position 3's rate is still what its own
    tests said, not faded to the prior by the first position's verifications (which would keep a
    policy that drafts little from ever drafting deep again)."""
    stats = AcceptanceStats(3, prior=0.6)
    for i in range(10):
        stats.observe(f"deep{i}", 3, 3)
    for i in range(2000):
        stats.observe(f"short{i % 16}", 1, 1)
    # position 3 against position 2 in the same ten verifications: both always accepted
    assert stats.ratios() == pytest.approx([1.0, 1.0, 1.0])
    assert stats.engine_rates()[0] > 0.99 and stats.engine_rates()[2] > 0.99


def _verify(rng: random.Random, rates: list[float], num_drafts: int) -> int:
    """Accepted drafts of a verification of `num_drafts` drafts with conditional rates `rates`."""
    accepted = 0
    while accepted < num_drafts and rng.random() < rates[accepted]:
        accepted += 1
    return accepted


def test_deep_rates_carry_over_as_ratios_not_as_the_selected_requests_rates() -> None:
    """The policy drafts deep for the requests that accept (here 0.9 at every position) and one token
    for the rest (0.3), so position 3 is tested by good requests only and its pooled rate reads
    ~0.9. A request that drafted one token, accepting ~0.3, must not be priced at that deep: its
    deeper positions follow its own first (times the curve's shape, flat here), not the good
    requests' figure. And where every request drafts alike the engine-wide curve is the true one."""
    rng = random.Random(0)
    stats = AcceptanceStats(3)
    for i in range(3000):
        good = i % 2 == 0
        rid = f"{'good' if good else 'bad'}{(i // 2) % 8}"
        stats.observe(rid, 3 if good else 1, _verify(rng, [0.9] * 3 if good else [0.3] * 3, 3 if good else 1))
    pooled = (stats.engine_accepted[2] + 4 * 0.6) / (stats.engine_tested[2] + 4)
    assert pooled > 0.85  # what the selected requests accept
    assert stats.ratios()[1:] == pytest.approx([1.0, 1.0], abs=0.06)
    bad = stats.rates(["bad3"])[0]
    # its own first position (~10 decayed tests at ~0.3) weighed against the engine's (~0.6)
    assert 0.3 < bad[0] < 0.6
    assert bad[2] == pytest.approx(bad[0], abs=0.06)  # not the ~0.9 the deep tests pooled
    good = stats.rates(["good3"])[0]
    assert (good > 0.75).all()

    rng = random.Random(1)
    same = AcceptanceStats(3)
    truth = [0.6, 0.7, 0.8]
    for i in range(4000):
        same.observe(f"r{i % 16}", 3, _verify(rng, truth, 3))
    assert same.engine_rates() == pytest.approx(truth, abs=0.08)  # ~200 decayed tests a position
    assert same.rates(["fresh"])[0].tolist() == pytest.approx(same.engine_rates())


def test_a_new_request_starts_from_the_engine_wide_rate_and_follows_its_own() -> None:
    stats = AcceptanceStats(2)
    for i in range(50):
        stats.observe(f"r{i}", 2, 2)  # everyone accepts everything
    fresh = stats.rates(["new"])[0]
    assert (fresh > 0.9).all()
    for _ in range(20):
        stats.observe("bad", 2, 0)  # this one never accepts
    # Its own decayed counts (20 tests, no accepts) pulled towards the engine-wide rate with the
    # request weight: less than half of it.
    tested = sum(0.9**i for i in range(20))
    base = stats.engine_rates()[0]
    assert stats.rates(["bad"])[0][0] == pytest.approx(stats.request_weight * base / (tested + stats.request_weight))
    assert stats.rates(["bad"])[0][0] < 0.6 * base
    stats.forget("bad")  # forgotten: back to the engine-wide rate (which its rejections lowered)
    assert stats.rates(["bad"])[0].tolist() == pytest.approx(stats.engine_rates())
    assert 0.5 < stats.engine_rates()[0] < 0.9


def test_one_measured_step_gives_the_prior_shape() -> None:
    """Time ~ rows + PRIOR_FIXED_ROWS through the one measured step, and likewise the drafter's 0.3 s
    against the positions it fed, its fixed part (PRIOR_FIXED_ROWS positions' worth) spread over its
    three passes alike: together they explain all of it."""
    costs = StepCostModel()
    assert not costs.measured
    costs.observe(4, 2.0, 0.3, 3)
    assert costs.measured
    step_cost, first_cost, pass_cost = costs.step_cost(4, 2)
    drafter_row = 0.3 / (4 + PRIOR_FIXED_ROWS)
    assert pass_cost == pytest.approx(drafter_row * PRIOR_FIXED_ROWS / 3) and first_cost == pytest.approx(pass_cost)
    slope = 2.0 / (4 + PRIOR_FIXED_ROWS)
    at_base = 2.0 - 0.3  # the same step without the drafter (it feeds nothing where nothing drafts)
    assert step_cost == pytest.approx([at_base, at_base + slope, at_base + 2 * slope])


def test_the_fit_recovers_rows_and_passes_apart() -> None:
    """Step time = 10 ms + 0.8 ms a row + 0.3 ms a pass after the first, with noise; rows and passes
    vary together (deep drafts at low load), yet each is priced alone."""
    rng = np.random.default_rng(0)
    costs = StepCostModel()
    for _ in range(512):
        passes = int(rng.integers(1, 4))
        rows = int(rng.integers(16, 48)) + 4 * (3 - passes)
        costs.observe(rows, 0.010 + 0.0008 * rows + 0.0003 * (passes - 1) + rng.normal(0, 0.0005),
                      0.001 + 0.0003 * (passes - 1), passes)
    fit = costs.fit(32)
    assert fit.per_logit_row == pytest.approx(0.0008, rel=0.1)  # every row computed logits
    assert fit.pass_cost == pytest.approx(0.0003, rel=0.25)
    assert fit.fixed + fit.first_cost == pytest.approx(0.010, rel=0.1)  # the drafter always ran: one sum


def test_the_first_pass_is_priced_apart_when_it_is_skipped() -> None:
    """At high load no request drafts in most steps and the drafter runs no pass; every 16th step
    one request drafts and pass 1 (1.5 ms: its catch-up) runs. The fit prices it apart from the
    rows, which cost 0.8 ms each, and the step without it at the target's time."""
    rng = np.random.default_rng(4)
    costs = StepCostModel()
    for step in range(512):
        ran = step % EXPLORE_EVERY == 0
        rows = int(rng.integers(24, 40)) + int(ran)
        drafter = 0.0015 if ran else 0.0
        costs.observe(rows, 0.010 + 0.0008 * rows + drafter + rng.normal(0, 0.0003), drafter, int(ran))
    fit = costs.fit(32)
    assert fit.first_cost == pytest.approx(0.0015, rel=0.1)
    assert fit.per_logit_row == pytest.approx(0.0008, rel=0.1)
    assert fit.fixed == pytest.approx(0.010, rel=0.1)


def test_a_drafting_request_is_priced_at_what_the_drafter_spends_on_it() -> None:
    """16 requests decode; each step 0-8 of them draft one token. The drafter takes 0.2 ms when it
    runs, 50 us a request it drafts for and 6 us a position it feeds (a drafting request's draft
    position and, half the time, the one its last step accepted). The fit prices a drafting
    request with its draft row at those 59 us, and a step without drafts at the target's time
    alone: the decode rows of requests that do not draft feed the drafter nothing."""
    rng = np.random.default_rng(6)
    costs = StepCostModel()
    drafted = 0
    for _ in range(512):
        drafting = int(rng.integers(0, 9))
        fed = drafting + int(rng.binomial(drafting, 0.5))
        drafter = (0.0002 + 0.00005 * drafting + 0.000006 * fed) if drafting else 0.0
        rows = 16 + drafted  # this step verifies the last step's drafts
        target = 0.0015 + 0.00006 * rows + rng.normal(0, 0.00002)
        costs.observe(rows, target + drafter, drafter, int(drafting > 0), num_draft_rows=drafted,
                      drafter_rows=fed, drafting_reqs=drafting)
        drafted = drafting
    fit = costs.fit(16)
    # (a drafting request's positions and the request itself move together: the sum is what is told)
    assert fit.request_cost + fit.draft_row == pytest.approx(0.00005 + 0.000006 * 1.5, rel=0.1)
    assert fit.draft_row < 0.00002
    assert fit.first_cost == pytest.approx(0.0002, rel=0.15)
    step_cost, _, _ = costs.step_cost(16, 8)
    assert step_cost[0] == pytest.approx(0.0015 + 0.00006 * 16, rel=0.03)
    assert costs.request_cost(16) == fit.request_cost


def test_what_drafting_cost_is_remembered_through_a_spell_without_drafts() -> None:
    """Steps that verify drafts tell the verification's fixed cost, a later pass's and a drafting
    request's. After more steps without drafts than the window holds, the fit still prices those
    three as the drafting steps measured them, where a model that never saw drafting has its
    priors (0); with drafting steps in the window again it fits them afresh."""
    rng = np.random.default_rng(3)

    def run(costs: StepCostModel, steps: int, draft: bool) -> None:
        drafted = 0
        for _ in range(steps):
            drafting = int(rng.integers(0, 5)) if draft else 0
            drafter = (0.0002 + 0.00005 * drafting + 0.0001 * 2) if drafting else 0.0  # 3 passes
            rows = 16 + 3 * drafted
            target = 0.0015 + 0.00006 * rows + (0.0004 if drafted else 0.0) + rng.normal(0, 0.00002)
            costs.observe(rows, target + drafter, drafter, 3 if drafting else 0, num_draft_rows=3 * drafted,
                          drafter_rows=drafting, drafter_pass_rows=2 * drafting, drafting_reqs=drafting)
            drafted = drafting

    costs = StepCostModel()
    run(costs, 512, draft=True)
    seen = costs.fit(16)
    assert seen.verify_cost == pytest.approx(0.0004, rel=0.25) and seen.pass_cost > 0.00005
    run(costs, 600, draft=False)  # the window holds none of the drafting steps now
    later = costs.fit(16)
    assert (later.verify_cost, later.pass_cost, later.request_cost) == pytest.approx(
        (seen.verify_cost, seen.pass_cost, seen.request_cost), rel=1e-9, abs=1e-9)
    never = StepCostModel()
    run(never, 600, draft=False)
    fresh = never.fit(16)
    assert fresh.verify_cost == 0.0 and fresh.request_cost == 0.0
    run(costs, 512, draft=True)  # drafting again: fitted from its steps, not from the memory
    assert costs.fit(16).verify_cost == pytest.approx(0.0004, rel=0.25)


def test_in_lockstep_a_decode_row_costs_the_drafter_its_position() -> None:
    """Lockstep: the drafter feeds every request's positions every step (the vote sized its first
    pass), 6 us each, and 50 us a request it drafts for. A step without drafts is priced with its
    16 positions, and a drafting request at its own work only (the positions it fed are fed
    anyway); alone, the same steps would price the step without them."""
    rng = np.random.default_rng(7)
    fits = {}
    for lockstep in (True, False):
        costs = StepCostModel(feeds_every_row=lockstep)
        drafted = 0
        for _ in range(512):
            drafting = int(rng.integers(0, 9))
            fed = 16 + int(rng.binomial(drafted, 0.5))  # every position, and what the last drafts accepted
            drafter = 0.0001 + 0.000006 * fed + 0.00005 * drafting
            rows = 16 + drafted
            target = 0.0015 + 0.00006 * rows + rng.normal(0, 0.00002)
            costs.observe(rows, target + drafter, drafter, 1, num_draft_rows=drafted, drafter_rows=fed,
                          drafting_reqs=drafting)
            drafted = drafting
        fits[lockstep] = costs.step_cost(16, 8)[0][0], costs.request_cost(16)
    at_base, request = fits[True]
    assert at_base == pytest.approx(0.0015 + 0.00006 * 16 + 0.0001 + 0.000006 * 16, rel=0.03)
    assert request == pytest.approx(0.00005, rel=0.3)
    assert fits[False][0] < at_base - 0.00006


def test_a_draft_row_is_priced_as_a_row_that_computes_logits() -> None:
    """Prompt rows cost 0.6 ms, rows that compute logits (decode and draft rows) 0.9 ms (the lm_head
    and sampling on top): at high load most of the rows' variation is prompt chunks, yet a draft row
    is priced at its 0.9 ms, not at the prompt rows' 0.6."""
    rng = np.random.default_rng(5)
    costs = StepCostModel()
    for step in range(512):
        decode = 32 + int(rng.integers(0, 8))  # 32 requests, a few drafting one token
        prompt = int(rng.integers(16, 64)) if step % 4 == 0 else 0  # a new request's prompt chunk
        seconds = 0.010 + 0.0006 * (decode + prompt) + 0.0003 * decode + rng.normal(0, 0.0003)
        costs.observe(decode + prompt, seconds, 0.0, 0, num_logit_rows=decode)
    fit = costs.fit(40)
    assert fit.per_row == pytest.approx(0.0006, rel=0.15)
    assert fit.per_logit_row == pytest.approx(0.0009, rel=0.1)
    step_cost, _, _ = costs.step_cost(32, 2, base_logit_rows=32)
    assert step_cost[1] - step_cost[0] == pytest.approx(0.0009, rel=0.1)
    assert step_cost[0] == pytest.approx(0.010 + 0.0009 * 32, rel=0.05)


def test_verifying_drafts_at_all_is_priced_apart_from_the_rows() -> None:
    """A step that verifies drafts costs 1 ms more than one that does not, whatever their number
    (the rejection sampler, the runner's and the scheduler's per-draft work), and a row 0.05 ms: on
    a small model the fixed part is twenty rows' worth. Drafting is rare (every 16th step one
    request drafts one token), so without its own term the 1 ms would be charged to that one extra
    row. The fit prices the row at its 0.05 ms and the 1 ms as what drafting anything costs."""
    rng = np.random.default_rng(7)
    costs = StepCostModel()
    for step in range(512):
        drafts = int(step % EXPLORE_EVERY == 0)
        decode = 14 + int(rng.integers(0, 3))  # requests come and go
        seconds = 0.002 + 0.00005 * (decode + drafts) + 0.001 * drafts + rng.normal(0, 0.0001)
        costs.observe(decode + drafts, seconds, 0.0, 0, num_logit_rows=decode + drafts, num_draft_rows=drafts)
    fit = costs.fit(16)
    assert fit.verify_cost == pytest.approx(0.001, rel=0.15)
    assert fit.per_logit_row == pytest.approx(0.00005, abs=0.00003)
    step_cost, first_cost, _ = costs.step_cost(16, 16)
    assert first_cost == fit.verify_cost  # drafting anything: no drafter here, the verification
    assert step_cost[16] - step_cost[0] == pytest.approx(16 * 0.00005, abs=0.0004)


def test_a_catch_up_is_charged_to_the_rows_it_fed_not_to_the_passes() -> None:
    """The drafter costs 0.3 ms a pass and 0.02 ms a fed position. Requests draft 3 only now and
    then (every 8th step), after spells of no drafting whose positions the first pass then catches
    up on (~100 positions): against the step's rows that catch-up would be charged to the later
    passes, which come with it; against the positions fed it is not."""
    rng = np.random.default_rng(8)
    costs, against_rows = StepCostModel(), StepCostModel()
    for step in range(512):
        deep = step % 8 == 0
        rows = 16 + int(rng.integers(0, 3))
        fed = 100 + int(rng.integers(0, 20)) if deep else int(rng.integers(0, 3))  # prompts are always fed
        passes = 3 if deep else int(fed > 0)
        drafter = 0.0003 * passes + 0.00002 * fed
        seconds = 0.003 + 0.0001 * rows + drafter + rng.normal(0, 0.0001)
        costs.observe(rows, seconds, drafter, passes, drafter_rows=fed)
        against_rows.observe(rows, seconds, drafter, passes)
    fit = costs.fit(16)
    # a little above: the prior (the average time per pass, catch-ups in it) is an upper bound
    assert fit.pass_cost == pytest.approx(0.0003, rel=0.3)
    assert fit.first_cost == pytest.approx(0.0003, rel=0.3)
    assert against_rows.fit(16).pass_cost > 2 * 0.0003


def test_a_catch_up_is_priced_at_the_drafters_cost_per_position_in_bulk() -> None:
    """Eight requests decode, none drafting: the drafter feeds 0-4 positions a step at its bookkeeping
    cost (memory-bound passes: a few positions cost what one does). Every 40th step a new request's
    prompt of ~300 rows comes in and the drafter feeds all of it, at 0.19 ms a position (a bulk pass
    is compute-bound). A catch-up of hundreds of waiting positions is such a pass: priced at the bulk
    rate, not at the slope of the steady steps near 8 rows (~0)."""
    rng = np.random.default_rng(11)
    costs = StepCostModel()
    for step in range(400):
        if step % 40 == 0:
            rows = fed = 300 + int(rng.integers(0, 40))
            passes = 3
            drafter = 0.001 * (passes - 1) + 0.00019 * fed
        else:
            rows, fed = 8, int(rng.integers(0, 5))
            passes = int(fed > 0)
            drafter = 0.00013 + 0.001 * passes
        seconds = 0.050 + 0.006 * rows + drafter + rng.normal(0, 0.001)
        costs.observe(rows, seconds, drafter, passes, drafter_rows=fed)
    assert costs.fit(8).catch_up_row == pytest.approx(0.00019, rel=0.05)
    assert costs.catch_up_cost(8) == pytest.approx(0.00019, rel=0.05)
    # with no bulk step in the window, the local slope stands
    steady = StepCostModel()
    for step in range(200):
        fed = step % 17  # a few requests catching up a little
        steady.observe(8, 0.1 + 0.0001 * fed, 0.0001 * fed, int(fed > 0), drafter_rows=fed)
    assert steady.fit(8).catch_up_row == pytest.approx(0.0001, rel=0.3)


def test_where_only_prompt_rows_vary_a_draft_row_costs_a_row_and_its_lm_head() -> None:
    """32 requests decode in every step (their count never changes) while prompt chunks come and
    go: the steps say what a prompt row costs (0.6 ms) and nothing about the lm_head's extra. A
    draft row is priced at a prompt row plus the lm_head's share of it (here 0.25: 0.75 ms), not at
    a prompt row alone, which would make drafts look cheaper than they are at high load."""
    rng = np.random.default_rng(9)
    costs = StepCostModel(logit_share=0.25)
    for step in range(512):
        prompt = int(rng.integers(16, 64)) if step % 3 == 0 else 0
        seconds = 0.010 + 0.0006 * prompt + 0.00075 * 32 + rng.normal(0, 0.0002)
        costs.observe(32 + prompt, seconds, 0.0, 0, num_logit_rows=32)
    fit = costs.fit(40)
    assert fit.per_row == pytest.approx(0.0006, rel=0.1)
    assert fit.per_logit_row == pytest.approx(0.00075, rel=0.1)


def test_batch_sizes_a_request_apart_share_one_fit() -> None:
    """A fit is taken at the grid point nearest the batch size asked about: 15, 16 and 17 rows
    (requests coming and going) share one, instead of each refitting every step."""
    costs = StepCostModel()
    for rows in [14, 15, 16, 17, 18] * 20:
        costs.observe(rows, 0.002 + 0.0001 * rows, 0.0, 0)
    fitted: list[float] = []
    fit = costs.fit
    costs.fit = lambda rows: fitted.append(rows) or fit(rows)  # type: ignore[method-assign]
    for base in (15, 16, 17, 16, 15):
        costs.step_cost(base, 0)
    assert len(fitted) == 1
    curve, _, _ = costs.step_cost(15, 2)
    assert curve == pytest.approx([0.0035, 0.0036, 0.0037], rel=0.02)  # evaluated at 15, not at the grid point


def test_drafts_that_take_the_batch_far_are_priced_where_they_land() -> None:
    """Steps measured only at 4-16 rows, where time is flat (weights streamed once): 16 requests
    drafting 3 each would verify 64 rows. The local tangent at 16 (flat) is not extended there:
    beyond what was measured the curve follows the prior shape (time ~ rows + 16), and once steps
    of ~64 rows are measured (1 ms a row above 16), it follows those."""
    rng = np.random.default_rng(6)
    costs = StepCostModel(refit_every=1)
    for _ in range(256):
        rows = int(rng.integers(4, 17))
        costs.observe(rows, 0.020 + rng.normal(0, 0.0002), 0.0, 0)
    curve, _, _ = costs.step_cost(16, 48)
    assert curve[0] == pytest.approx(0.020, rel=0.05)
    assert curve[48] == pytest.approx(0.020 * (64 + PRIOR_FIXED_ROWS) / (16 + PRIOR_FIXED_ROWS), rel=0.1)
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    for _ in range(256):
        rows = int(rng.integers(56, 72))
        costs.observe(rows, 0.020 + 0.001 * (rows - 16) + rng.normal(0, 0.0002), 0.0, 0)
    curve, _, _ = costs.step_cost(16, 48)
    assert curve[48] == pytest.approx(0.020 + 0.001 * 48, rel=0.1)


def test_a_slow_spell_is_not_charged_to_the_rows_drafted_during_it() -> None:
    """The machine slows by half for a while (other tenants) just when the policy drafts more: levels
    alone would price a row at ~2.5 ms; consecutive steps give its true 0.5 ms."""
    rng = np.random.default_rng(1)
    costs = StepCostModel()
    for t in range(400):
        slow = t >= 200
        rows = int(rng.integers(1, 3)) + (2 if slow else 0)
        costs.observe(rows, (0.010 + 0.0005 * rows) * (1.5 if slow else 1.0), 0.0, 0)
    assert 0.0003 < costs.fit(3).per_logit_row < 0.0009


def test_the_fit_is_local_to_the_batch_size_asked_about() -> None:
    """Flat up to 8 rows (weights streamed once), 1 ms a row beyond: a row is cheap at 2 rows and
    costs its ms at 64."""
    rng = np.random.default_rng(2)
    costs = StepCostModel()
    for _ in range(512):
        rows = int(rng.integers(1, 5)) if rng.random() < 0.5 else int(rng.integers(48, 80))
        costs.observe(rows, 0.010 + 0.001 * max(rows - 8, 0), 0.0, 0)
    assert costs.fit(2).per_logit_row < 0.0002
    assert costs.fit(64).per_logit_row == pytest.approx(0.001, rel=0.1)


def test_a_pass_is_priced_from_the_drafter_timer() -> None:
    """Steps jitter by +-3 ms, ten times a 0.2 ms pass; the drafter's own time does not: the pass
    is priced from it, the rows from the steps."""
    rng = np.random.default_rng(3)
    costs = StepCostModel()
    for step in range(512):
        passes = 2 if step % EXPLORE_EVERY == 0 else 1
        rows = int(rng.integers(24, 40))
        drafter = 0.001 + 0.00002 * rows + 0.0002 * (passes - 1)
        costs.observe(rows, 0.010 + 0.0008 * rows + drafter + rng.uniform(-0.003, 0.003), drafter, passes)
    fit = costs.fit(32)
    assert fit.pass_cost == pytest.approx(0.0002, rel=0.25)  # a little above: the ridge's prior is an upper bound
    assert fit.per_logit_row == pytest.approx(0.00082, rel=0.25)


def test_passes_that_never_vary_split_the_drafters_time_along_its_prior() -> None:
    """Every step ran 3 passes in 3 ms, feeding its rows in the first and twice as many in the later
    two: nothing separates the passes from each other or from the positions. The passes are priced
    alike, at the prior's share (a pass's overhead is worth PRIOR_FIXED_ROWS positions, spread over
    the three), never at the average 1 ms a pass, which would charge a later pass every position
    the first fed; the first pass takes what the rest leaves of the 3 ms, so a drafting step costs
    what it took and a step without drafts is charged none of it."""
    costs = StepCostModel()
    for rows in [8, 9, 10, 11] * 20:
        costs.observe(rows, 0.010 + 0.001 * rows + 0.003, 0.003, 3, drafter_pass_rows=2 * rows)
    fit = costs.fit(9)
    assert fit.pass_cost < 0.0005
    assert fit.first_cost >= fit.pass_cost
    curve, first_cost, pass_cost = costs.step_cost(9, 0)
    assert curve[0] + first_cost + 2 * pass_cost == pytest.approx(0.022, rel=0.02)
    assert curve[0] == pytest.approx(0.019, abs=0.0003)  # the target's part; the drafter's rows at ~0


def test_a_later_pass_is_priced_at_its_overhead_not_at_the_positions_the_first_fed() -> None:
    """32 requests draft one token each (64 rows, the drafter feeding their 64 positions in one
    pass) and new requests' prompt chunks come in every 5th step, fed to the drafter alongside; no
    step near here ran a second pass. The drafter costs 1.5 ms a pass and 0.08 ms a position, and
    its timer jitters by 0.5 ms. A later pass costs its overhead (its positions are priced as
    positions): ~1.5 ms, not the ~8 ms the drafter averaged per pass, which priced the demo's
    later passes at 5-12 ms against ~2.5 for 32 requests (AVX2) and kept it from drafting deep."""
    rng = np.random.default_rng(12)
    costs = _profiled()
    for step in range(512):
        chunk = int(rng.integers(30, 160)) if step % 5 == 0 else 0
        rows, fed = 64 + chunk, 64 - int(rng.integers(0, 3)) + chunk
        drafter = 0.0015 + 0.00008 * fed + rng.normal(0, 0.0005)
        forward = 0.005 + 0.002 * rows + 0.0005 * 64
        costs.observe(rows, forward + drafter + 0.002, drafter, 1, num_logit_rows=64, num_draft_rows=32,
                      drafter_rows=fed, forward_seconds=forward)
    fit = costs.fit(32)
    assert fit.pass_cost == pytest.approx(0.0015, rel=0.3)
    # the profiled steps: the drafter's row (near 32 rows only the 0-2 positions of jitter vary: its
    # prior holds it near the local average, ~0.083)
    assert fit.per_row == pytest.approx(0.00008, rel=0.35)


def test_a_catch_up_that_comes_with_later_passes_is_not_charged_to_them() -> None:
    """32 requests decode without drafts (their drafter catch-ups wait), new requests' prompt chunks
    are fed every 5th step, and every 64th step the whole batch drafts 3 (a wide exploration): that
    step's first pass catches up ~700 waiting positions (0.09 ms each, dearer than the 0.06 of the
    prompts' positions: long contexts) and two later passes follow. The only steps near here whose
    passes varied are those; their catch-up is priced apart, and a later pass at its 1.5 ms, not at
    the 10-18 ms the catch-up's cost beyond the positions' slope made it."""
    rng = np.random.default_rng(13)
    costs = _profiled()
    for step in range(512):
        chunk = int(rng.integers(30, 100)) if step % 5 == 0 else 0
        wide = step % 64 == 63
        caught = 700 + int(rng.integers(0, 100)) if wide else 0
        passes = 3 if wide else int(chunk > 0)
        fed, pass_rows = chunk + (32 + caught if wide else 0), 64 if wide else 0
        drafter = 0.0003 + (0.0015 * passes + 0.00006 * (fed + pass_rows) + 0.00003 * caught if passes else 0.0)
        drafter += rng.normal(0, 0.0003)
        rows = 32 + chunk
        forward = 0.005 + 0.002 * rows + 0.0005 * 32
        costs.observe(rows, forward + drafter + 0.002, drafter, passes, num_logit_rows=32, drafter_rows=fed,
                      forward_seconds=forward, drafter_pass_rows=pass_rows)
    fit = costs.fit(32)
    assert fit.pass_cost == pytest.approx(0.0015, rel=0.35)
    assert fit.first_cost == pytest.approx(0.0015, rel=0.35)


def test_a_fit_is_reused_for_a_few_steps() -> None:
    costs = StepCostModel(refit_every=4)
    costs.observe(4, 1.0, 0.0, 0)
    first = costs.step_cost(4, 1)
    for _ in range(3):
        costs.observe(4, 3.0, 0.0, 0)
        assert costs.step_cost(4, 1) == first  # the same fit, three steps on
    fits: list[float] = []
    fit = costs.fit
    costs.fit = lambda base: fits.append(base) or fit(base)  # type: ignore[method-assign]
    assert costs.step_cost(2, 1) != first and fits == []  # a base on the same grid point: the same fit
    other = costs.step_cost(16, 1)
    assert len(fits) == 1 and other != first  # a base on another grid point: a fit of its own ...
    assert costs.step_cost(16, 1) == other and len(fits) == 1  # ... kept too
    del costs.fit
    costs.observe(4, 3.0, 0.0, 0)
    assert costs.step_cost(4, 1)[0][0] > first[0][0]  # four steps on: refitted


def test_short_steps_reuse_a_fit_until_enough_time_has_passed() -> None:
    """Steps of 1 ms (a small model at one request): a fit costs about half a step, so it is kept
    for `refit_seconds` of steps, not only `refit_every` of them."""
    costs = StepCostModel(refit_every=4, refit_seconds=0.1)
    costs.observe(4, 0.001, 0.0, 0)
    first = costs.step_cost(4, 1)
    for _ in range(97):  # 98 ms of steps in all
        costs.observe(4, 0.001, 0.0, 0)
    assert costs.step_cost(4, 1) == first  # 98 steps on, still the first fit
    for _ in range(4):
        costs.observe(4, 0.003, 0.0, 0)
    assert costs.step_cost(4, 1)[0][0] > first[0][0]  # 0.1 s of steps on: refitted


def test_old_steps_leave_the_window() -> None:
    costs = StepCostModel(window=8, refit_every=1)
    for _ in range(8):
        costs.observe(4, 1.0, 0.0, 0)
    for _ in range(8):
        costs.observe(4, 3.0, 0.0, 0)
    assert costs.step_cost(4, 0)[0][0] == pytest.approx(3.0)


def _assert_sane_costs(costs: StepCostModel, base: int, extra: int) -> None:
    """Predicted step times positive, finite, never falling as drafts are added; the drafter's
    costs finite and >= 0."""
    step_cost, first_cost, pass_cost = costs.step_cost(base, extra)
    assert len(step_cost) == extra + 1
    assert all(np.isfinite(step_cost)) and step_cost[0] > 0
    assert (np.diff(step_cost) >= 0).all()
    assert np.isfinite(pass_cost) and pass_cost >= 0
    assert np.isfinite(first_cost) and first_cost >= 0


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 5000), st.floats(1e-4, 1.0), st.floats(0.0, 0.5), st.integers(0, 4)),
                      min_size=1, max_size=40),
       base=st.integers(1, 6000), extra=st.integers(0, 64))
def test_predicted_times_are_positive_and_never_fall(steps, base, extra) -> None:  # noqa: ANN001
    costs = StepCostModel(window=16)
    for rows, seconds, drafter, passes in steps:
        costs.observe(rows, seconds, drafter * seconds, passes)
    _assert_sane_costs(costs, base, extra)


def test_adaptive_drafting_drafts_the_caps_until_a_step_was_measured() -> None:
    policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
    assert policy.choose(["a", "b"], [3, 1], base_rows=2) == [3, 1]
    policy.observe_step(200, 5.0, 0.5, 1)  # a prompt's step: nothing yet about batches of 2 rows
    assert policy.choose(["a", "b"], [3, 1], base_rows=2) == [3, 1]
    for _ in range(30):
        policy.observe_verification("a", 3, 0)  # "a" never accepts
        policy.observe_verification("b", 3, 3)  # "b" always does
    for rows in (2, 4, 6, 8):  # a row costs a fifth of a 2-row step: worth ~0.4 accepted tokens
        policy.observe_step(rows, 0.6 + 0.2 * rows, 0.1, 1)
    a, b = policy.choose(["a", "b"], [3, 3], base_rows=2)
    assert a == 0 and b > 0


def test_an_unchanged_batch_keeps_its_decision_for_a_few_steps() -> None:
    """The same requests, caps and base rows as the last fresh decision (one that drafts for some
    requests, not all): it stands for REUSE_DECISIONS decisions in all, however the estimates moved
    meanwhile; another batch, or the same one once those are used up, is decided afresh."""
    policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
    for _ in range(30):
        policy.observe_verification("a", 3, 3)  # "a" always accepts
        policy.observe_verification("b", 3, 0)  # "b" never does
    for rows in (2, 4, 6, 8):
        policy.observe_step(rows, 0.6 + 0.2 * rows, 0.1, 1)
    fresh = policy.choose(["a", "b"], [3, 3], base_rows=2)
    assert fresh[0] > 0 and fresh[1] == 0
    for _ in range(60):
        policy.observe_verification("a", 3, 0)  # now it never does either
    for _ in range(REUSE_DECISIONS - 1):
        assert policy.choose(["a", "b"], [3, 3], base_rows=2) == fresh  # reused
    assert policy.choose(["a", "b"], [3, 3], base_rows=2) == [0, 0]  # decided again
    policy.observe_verification("c", 3, 3)
    assert policy.choose(["a", "c"], [3, 3], base_rows=2)[0] == 0  # another batch: decided afresh


def _policy_with_costs() -> AdaptiveDrafting:
    policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
    for rows in (2, 4, 6, 8):  # a row costs a fifth of a 2-row step
        policy.observe_step(rows, 0.6 + 0.2 * rows, 0.1, 1)
    return policy


def test_a_decision_stands_while_the_caps_fall_and_still_hold_it() -> None:
    """Caps that fell since the last fresh decision (requests nearing max_tokens) keep it while it
    fits within them: the best choice among more candidates is the best among fewer that include
    it. A cap below its length, or a cap that rose, decides afresh."""
    policy = _policy_with_costs()
    for _ in range(30):
        policy.observe_verification("a", 3, 3)  # "a" always accepts
        policy.observe_verification("b", 3, 0)  # "b" never does
    assert policy.choose(["a", "b"], [3, 3], base_rows=2) == [3, 0]
    for _ in range(60):
        policy.observe_verification("a", 3, 0)  # now "a" never accepts either
    assert policy.choose(["a", "b"], [3, 1], base_rows=2) == [3, 0]  # "b"'s cap fell: still holds
    assert policy.choose(["a", "b"], [2, 1], base_rows=2) == [0, 0]  # "a"'s fell below 3: afresh
    policy = _policy_with_costs()
    for _ in range(30):
        policy.observe_verification("a", 3, 3)
        policy.observe_verification("b", 3, 3)
    assert policy.choose(["a", "b"], [3, 1], base_rows=2) == [3, 1]
    assert policy.choose(["a", "b"], [3, 3], base_rows=2) == [3, 3]  # "b"'s cap rose: afresh


def test_a_decision_to_draft_every_cap_stands_for_a_changed_batch_near_its_size() -> None:
    """Every request at its cap: until the next exploration a batch near the same size keeps it,
    a new request at its cap, unless a request it knew has a higher cap or some cap goes deeper
    than its deepest; a batch of another size is decided afresh."""
    policy = _policy_with_costs()
    for r in "abcd":
        for _ in range(30):
            policy.observe_verification(r, 3, 3 if r != "d" else 0)  # "d" never accepts
    assert policy.choose(["a", "b"], [3, 2], base_rows=2) == [3, 2]  # fresh: every cap
    assert policy.choose(["a", "c"], [3, 2], base_rows=2) == [3, 2]  # "c" new: at its cap
    assert policy.choose(["a", "d"], [2, 1], base_rows=2) == [2, 1]  # reused, though "d" would not draft
    assert policy.choose(["a", "b"], [3, 3], base_rows=2) == [3, 3]  # "b"'s cap rose: afresh
    held = 0
    while (policy._decisions + 1) % EXPLORE_EVERY:
        assert policy.choose(["a", "d"], [3, 3], base_rows=2) == [3, 3]  # reused ...
        held += 1
    assert held > REUSE_DECISIONS
    policy.choose(["a", "d"], [3, 3], base_rows=2)  # ... up to the exploration's turn: decided afresh
    assert policy._last is not None and policy._last.lengths == [3, 0]
    assert policy.choose(["a", "b"], [3, 3], base_rows=32)  # another size: afresh
    assert policy._last is not None and policy._last.key[1] == 32


def test_a_clear_decision_to_draft_every_cap_stands_one_grid_point_away() -> None:
    """A batch whose size crosses a grid point's edge back and forth (13 and 14 requests) keeps a
    clear decision to draft every cap: up to CORNER_GRID_REACH grid points from its own, not
    further."""
    policy = _policy_with_costs()
    for r in "ab":
        for _ in range(60):
            policy.observe_verification(r, 3, 3)  # always accepted: drafting wins clearly
    costs = policy.costs
    assert costs.grid_point(13) + 1 == costs.grid_point(14) == costs.grid_point(16)
    far = next(r for r in range(14, 200) if costs.grid_point(r) - costs.grid_point(14) > CORNER_GRID_REACH)
    assert policy.choose(["a", "b"], [3, 3], base_rows=14) == [3, 3]
    assert policy._last is not None and policy._last.clear
    at = policy._last.at
    for rows in (13, 16, 13, 14):  # one grid point either side: reused
        assert policy.choose(["a", "b"], [3, 3], base_rows=rows) == [3, 3] and policy._last.at == at
    policy.choose(["a", "b"], [3, 3], base_rows=far)  # further: afresh
    assert policy._last.at > at and policy._last.key[1] == far


def test_a_marginal_decision_to_draft_every_cap_is_kept_as_briefly_as_any_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request at its cap, but predicted to beat drafting nothing by less than
    CORNER_CLEAR_GAIN: it does not stand for a changed batch (a new request is decided afresh, not
    given its cap), and for the same batch only REUSE_DECISIONS decisions; a clear one stands."""
    clear = _policy_with_costs()
    for _ in range(60):
        for r in "ab":
            clear.observe_verification(r, 1, 1)  # always accepted: drafting wins clearly
    assert clear.choose(["a"], [1], base_rows=2) == [1] and clear._last is not None and clear._last.clear
    at = clear._last.at
    assert clear.choose(["a", "b"], [1, 1], base_rows=2) == [1, 1] and clear._last.at == at  # "b" at its cap
    # The same acceptance with a bar no gain reaches: every decision to draft is marginal.
    monkeypatch.setattr(adaptive_module, "CORNER_CLEAR_GAIN", 100.0)
    policy = _policy_with_costs()
    for _ in range(60):
        for r in "ab":
            policy.observe_verification(r, 1, 1)
    assert policy.choose(["a"], [1], base_rows=2) == [1] and policy._last is not None and not policy._last.clear
    at = policy._last.at
    assert policy.choose(["a", "b"], [1, 1], base_rows=2) == [1, 1]  # "b" new to the decision: afresh
    assert policy._last.at > at and policy._last.key[0] == ("a", "b")
    at, kept = policy._last.at, 0
    while True:
        policy.choose(["a", "b"], [1, 1], base_rows=2)
        if policy._last.at != at:
            break
        kept += 1
    assert kept == REUSE_DECISIONS - 1


def test_a_decision_to_draft_nothing_stands_until_the_next_exploration() -> None:
    """With no drafts no verification moves the acceptance the decision read: it stands past
    REUSE_DECISIONS, until an exploration is due (which decides afresh)."""
    policy = _policy_with_costs()
    for _ in range(30):
        policy.observe_verification("a", 3, 0)
    assert policy.choose(["a"], [3], base_rows=2) == [0]
    for _ in range(60):
        policy.observe_verification("a", 3, 3)  # it would pay now
    held = 0
    while (policy._decisions + 1) % EXPLORE_EVERY:
        assert policy.choose(["a"], [3], base_rows=2) == [0]
        held += 1
    assert held > REUSE_DECISIONS
    assert policy.choose(["a"], [3], base_rows=2) == [3]  # the exploration's turn: decided afresh


def test_a_marginal_decision_to_draft_nothing_is_kept_as_briefly_as_any_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafting nothing because no draft length beat it by DRAFT_MIN_GAIN, though one beats it:
    the decision is marginal, kept for the same batch REUSE_DECISIONS decisions and decided afresh
    for another; drafting nothing because nothing pays at all stands (the test above)."""
    monkeypatch.setattr(adaptive_module, "DRAFT_MIN_GAIN", 100.0)  # no gain reaches it
    policy = _policy_with_costs()
    for _ in range(60):
        for r in "ab":
            policy.observe_verification(r, 1, 1)  # always accepted: drafting pays
    assert policy.choose(["a"], [1], base_rows=2) == [0]
    assert policy._last is not None and not policy._last.clear
    at, kept = policy._last.at, 0
    while True:
        assert policy.choose(["a"], [1], base_rows=2) == [0]
        if policy._last.at != at:
            break
        kept += 1
    assert kept == REUSE_DECISIONS - 1
    at = policy._last.at
    assert policy.choose(["a", "b"], [1, 1], base_rows=2) == [0, 0]  # another batch: afresh
    assert policy._last.at > at and policy._last.key[0] == ("a", "b")


def test_the_caps_stand_until_enough_steps_ran_the_drafter() -> None:
    """A request whose drafts are never accepted: the fit says drafting does not pay from the first
    steps on, but the caps stand until MIN_DRAFTING_STEPS steps ran the drafter (the first ones,
    a prompt's catch-up and every shape's first run, say little about a pass)."""
    policy = AdaptiveDrafting(3, drafter_passes=True)
    for _ in range(30):
        policy.observe_verification("a", 3, 0)
    for rows in (2, 4, 6, 8):
        policy.observe_step(rows, 0.6 + 0.2 * rows, 0.0, 0)
    for _ in range(MIN_DRAFTING_STEPS - 1):
        policy.observe_step(8, 2.2, 0.2, 3)
        assert policy.choose(["a"], [3], base_rows=2) == [3]  # too few drafting steps: the cap
    policy.observe_step(8, 2.2, 0.2, 3)
    assert policy.costs.drafting_steps == MIN_DRAFTING_STEPS
    assert policy.choose(["a"], [3], base_rows=2) == [0]  # the fit decides from here


def test_every_so_often_one_request_drafts_one_more() -> None:
    lengths = [1, 0, 1]
    assert explore(lengths, [3, 3, 1]) == 0
    assert lengths == [2, 0, 1]  # the longest with room: a row and a pass more
    lengths = [0, 0]
    assert explore(lengths, [0, 2]) == 1
    assert lengths == [0, 1]
    lengths = [2, 1]
    assert explore(lengths, [2, 1]) is None  # no room anywhere
    assert lengths == [2, 1]
    lengths = [0, 0, 0]
    assert explore(lengths, [3, 3, 3], lags=[40, 3, 3]) == 1  # the shortest catch-up waiting, the first of equals
    assert lengths == [0, 1, 0]
    lengths = [1, 0]
    assert explore(lengths, [3, 3], lags=[0, 0]) == 0
    assert lengths == [2, 0]
    policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
    for _ in range(30):
        policy.observe_verification("a", 3, 0)  # never accepts
    for rows in (2, 4, 6, 8):  # a row costs a fifth of a step: never worth "a"'s drafts
        policy.observe_step(rows, 0.6 + 0.2 * rows, 0.1, 1)
    # The draft would cost ~a sixth of the step for nothing: tried only every COSTLY_EXPLORE_EVERY.
    chosen = [policy.choose(["a"], [3], base_rows=2) for _ in range(2 * COSTLY_EXPLORE_EVERY)]
    assert [i for i, c in enumerate(chosen) if c != [0]] == [COSTLY_EXPLORE_EVERY - 1, 2 * COSTLY_EXPLORE_EVERY - 1]
    assert all(c == [1] for c in chosen if c != [0])


def test_new_requests_are_parked_after_a_while_of_drafting_nothing() -> None:
    """Rows as dear as the step and nothing ever accepted: every fresh decision drafts nothing, and
    after PARK_AFTER decisions the policy parks — at the load it decided for (16 requests) or more,
    not where the load fell a grid point of the fits below it (drafting may pay there). The first
    fresh decision that drafts (free rows, everything accepted; at the next exploration, till which
    drafting nothing stands) ends it. In lockstep (every request feeds the drafter anyway) the
    policy never parks."""
    for lockstep in (False, True):
        may_park = not lockstep
        policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0, lockstep=lockstep)
        policy.costs.measured_near = lambda rows: True  # type: ignore[method-assign]
        policy.costs.request_cost = lambda rows: 0.0  # type: ignore[method-assign]
        policy.costs.step_cost = lambda base, extra, logits=None: (  # type: ignore[method-assign]
            [1.0 + m for m in range(extra + 1)], 0.0, 0.1)
        for _ in range(30):
            policy.observe_verification("a", 3, 0)
            policy.observe_verification("b", 3, 3)
        for _ in range(PARK_AFTER):
            assert not policy.parks(16)
            policy.choose(["a"], [3], base_rows=16)
        assert policy.parks(16) is may_park and policy.parks(40) is may_park
        assert not policy.parks(8) and not policy.parks(1)
        policy.costs.step_cost = lambda base, extra, logits=None: (  # type: ignore[method-assign]
            [1.0] * (extra + 1), 0.0, 0.0)
        while (policy._decisions + 1) % EXPLORE_EVERY:  # the decision to draft nothing stands till then
            assert policy.choose(["b"], [3], base_rows=16) == [0]
        assert policy.choose(["b"], [3], base_rows=16) == [3]
        assert not policy.parks(16)


def test_an_exploration_that_costs_little_runs_every_16th_decision() -> None:
    """Acceptance 0.6 a position (the prior), a row 0.2 of a 1 s step, a pass 0.1: one draft is best
    (1.33 tokens/s), two come within EXPLORE_MARGIN of it (1.31): every EXPLORE_EVERY-th decision
    drafts two. With a row 0.3 of the step two fall outside the margin (1.15 against 1.23): tried
    every COSTLY_EXPLORE_EVERY-th decision only."""
    for row, every in ((0.2, EXPLORE_EVERY), (0.3, COSTLY_EXPLORE_EVERY)):
        policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
        policy.costs.measured_near = lambda rows: True  # type: ignore[method-assign]
        policy.costs.request_cost = lambda rows: 0.0  # type: ignore[method-assign]
        policy.costs.step_cost = lambda base, extra, logits=None, row=row: (  # type: ignore[method-assign]
            [1.0 + row * m for m in range(extra + 1)], 0.0, 0.1)
        chosen = [policy.choose(["a"], [3], base_rows=1) for _ in range(WIDE_EXPLORE_EVERY - 1)]
        assert [i for i, c in enumerate(chosen) if c != [1]] == list(range(every - 1, WIDE_EXPLORE_EVERY - 1, every))
        assert all(c == [2] for c in chosen if c != [1])


def _drafting_every_step_at_16() -> AdaptiveDrafting:
    """A policy whose window holds 32 steps of 16 requests verifying 3 drafts each (64 rows about a
    base of 16, the drafter fed each request's 4 positions), a request "a" that accepts every
    draft, and a synthetic step cost (1 s a step, 0.1 a draft row or a later pass)."""
    policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
    for _ in range(32):
        policy.observe_step(64, 0.03, 0.003, 3, num_draft_rows=48, drafter_rows=64)
    policy.costs.measured_near = lambda rows: True  # type: ignore[method-assign]
    policy.costs.request_cost = lambda rows: 0.0  # type: ignore[method-assign]
    policy.costs.step_cost = lambda base, extra, logits=None: (  # type: ignore[method-assign]
        [1.0 + 0.1 * m for m in range(extra + 1)], 0.0, 0.1)
    for _ in range(30):
        policy.observe_verification("a", 3, 3)
    return policy


def test_a_policy_that_drafts_every_step_measures_a_step_without_drafts_now_and_then() -> None:
    """Every step near 16 requests verified drafts: the step drafting is weighed against is only
    extrapolated from them. Every QUIET_EXPLORE_EVERY decisions (half-way between the wide
    explorations) no request drafts, until the window holds QUIET_STEPS decode steps about this
    size that verified nothing; then the policy drafts as it chose. A policy that drafts nothing
    has those steps already, and one with no steps near here has nothing to extrapolate from."""
    policy = _drafting_every_step_at_16()

    def run(n: int) -> tuple[list[list[int]], list[int]]:
        chosen, quiet = [], []
        for _ in range(n):
            chosen.append(policy.choose(["a"], [3], base_rows=16))
            if policy.last_decision == "quiet":
                quiet.append(policy._decisions)
        return chosen, quiet

    chosen, quiet = run(QUIET_EXPLORE_EVERY + EXPLORE_EVERY)
    assert quiet == [EXPLORE_EVERY, QUIET_EXPLORE_EVERY + EXPLORE_EVERY]
    assert [c for c in chosen if c != [3]] == [[0], [0]]
    assert policy.costs.only_drafted_near(16, QUIET_STEPS) and not policy.costs.only_drafted_near(64, QUIET_STEPS)
    for _ in range(QUIET_STEPS):  # the steps those decisions gave: nothing verified
        policy.observe_step(16, 0.016, 0.0, 0)
    assert run(QUIET_EXPLORE_EVERY) == ([[3]] * QUIET_EXPLORE_EVERY, [])


def test_a_quiet_step_counts_though_its_drafter_catches_up_or_it_takes_a_prompt() -> None:
    """A quiet decision leaves every request's new positions waiting in the drafter; the policy
    drafts again at the next decision, so the step that verifies nothing is also the step whose
    drafter feeds them: 16 requests, ~4 positions each waiting, a catch-up of BULK_FEED positions
    or more. Under churn it often takes a new request's prompt chunk too. Either way it is a step
    without drafts at 16 requests: QUIET_STEPS of them end the quiet explorations (counted among
    the clean decode steps only, none ever counted, and a policy drafting at 16 requests or more
    went quiet every QUIET_EXPLORE_EVERY decisions for good)."""
    policy = _drafting_every_step_at_16()
    quiet = 0
    for _ in range((QUIET_STEPS + 2) * QUIET_EXPLORE_EVERY):
        chosen = policy.choose(["a"], [3], base_rows=16)
        if policy.last_decision == "quiet":
            quiet += 1
            assert chosen == [0]
            # the step that decision gave: 16 requests, nothing verified; the next decision drafts,
            # so its drafter catches 64 waiting positions up besides the step's rows (every other
            # one with a 100-token prompt chunk besides)
            prompt = 100 * (quiet % 2)
            policy.observe_step(16 + prompt, 0.02, 0.004, 3, num_logit_rows=16, num_draft_rows=0,
                                drafter_rows=80 + prompt)
            policy.costs._flush()  # (not a clean decode step: a catch-up)
            assert bool(policy.costs._caught_up()[(policy.costs._next - 1) % policy.costs.window])
        else:
            policy.observe_step(64, 0.03, 0.003, 3, num_draft_rows=48, drafter_rows=64)
    assert quiet == QUIET_STEPS
    assert not policy.costs.only_drafted_near(16, QUIET_STEPS)


def test_an_exploration_that_must_catch_up_a_long_wait_is_a_costly_one() -> None:
    """"a" accepts every draft (it drafts its cap), "b" none (no drafts): every EXPLORE_EVERY-th
    decision gives "b" one draft, a row of 0.1 of a 1 s step. With 200 positions of "b"'s drafter
    catch-up waiting at 5 ms each that draft costs a second more: it is tried only every
    COSTLY_EXPLORE_EVERY-th decision."""
    for lag, every in ((0, EXPLORE_EVERY), (200, COSTLY_EXPLORE_EVERY)):
        policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
        for _ in range(30):
            policy.observe_verification("a", 3, 3)
            policy.observe_verification("b", 3, 0)
        policy.costs.measured_near = lambda rows: True  # type: ignore[method-assign]
        policy.costs.request_cost = lambda rows: 0.0  # type: ignore[method-assign]
        policy.costs.step_cost = lambda base, extra, logits=None: (  # type: ignore[method-assign]
            [1.0 + 0.1 * m for m in range(extra + 1)], 0.0, 0.1)
        policy.costs.catch_up_cost = lambda rows: 0.005  # type: ignore[method-assign]
        chosen = [policy.choose(["a", "b"], [3, 3], base_rows=2, lags=[0, lag])
                  for _ in range(WIDE_EXPLORE_EVERY - 1)]
        assert [i for i, c in enumerate(chosen) if c != [3, 0]] == list(range(every - 1, WIDE_EXPLORE_EVERY - 1, every))
        assert all(c == [3, 1] for c in chosen if c != [3, 0])


def test_every_64th_decision_tries_every_cap_where_it_may_pay() -> None:
    """Acceptance 0.6 a position (the prior), a row costs 0.3 of a 1 s step, a pass 0.1: one draft
    is best (1.23 tokens/s), three come within 0.8 of it (1.04): every WIDE_EXPLORE_EVERY-th
    decision drafts the cap, measuring the batch at its deepest. With a row as dear as the step,
    the cap is far off (0.52 against plain decoding's 1.0): it is never tried that way."""
    for row, usual, wide in ((0.3, [1], [3]), (1.0, [0], [1])):
        policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
        policy.costs.measured_near = lambda rows: True  # type: ignore[method-assign]
        policy.costs.request_cost = lambda rows: 0.0  # type: ignore[method-assign]
        policy.costs.step_cost = lambda base, extra, logits=None, row=row: (  # type: ignore[method-assign]
            [1.0 + row * m for m in range(extra + 1)], 0.0, 0.1)
        chosen = [policy.choose(["a"], [3], base_rows=1) for _ in range(2 * WIDE_EXPLORE_EVERY)]
        assert [chosen[i] for i in (WIDE_EXPLORE_EVERY - 1, 2 * WIDE_EXPLORE_EVERY - 1)] == [wide, wide]
        others = [c for i, c in enumerate(chosen) if (i + 1) % EXPLORE_EVERY]
        assert all(c == usual for c in others)


def test_the_whole_batch_is_not_tried_where_its_catch_ups_make_it_too_dear() -> None:
    """As above (a row 0.3 of a 1 s step), two requests: "a" accepts every draft, "b" none, so the
    choice drafts for "a" alone and the caps (three rows for "b" besides) come within the margin.
    With 200 positions of "b"'s drafter catch-up waiting at 5 ms each, the caps would cost a
    second more: they are not tried."""
    for lag, tried in ((0, True), (200, False)):
        policy = AdaptiveDrafting(3, drafter_passes=True, min_drafting_steps=0)
        for _ in range(30):
            policy.observe_verification("a", 3, 3)
            policy.observe_verification("b", 3, 0)
        policy.costs.measured_near = lambda rows: True  # type: ignore[method-assign]
        policy.costs.request_cost = lambda rows: 0.0  # type: ignore[method-assign]
        policy.costs.step_cost = lambda base, extra, logits=None: (  # type: ignore[method-assign]
            [1.0 + 0.1 * m for m in range(extra + 1)], 0.0, 0.1)
        policy.costs.catch_up_cost = lambda rows: 0.005  # type: ignore[method-assign]
        usual = policy.choose(["a", "b"], [3, 3], base_rows=2, lags=[0, lag])
        assert usual[1] == 0 < usual[0]
        policy._decisions = WIDE_EXPLORE_EVERY - 1
        wide = policy.choose(["a", "b"], [3, 3], base_rows=2, lags=[0, lag])
        assert (wide == [3, 3]) is tried


# ---- the profiled shape ------------------------------------------------------------------------
# A compute-bound CPU: the forward costs 5 ms + 2 ms a row, the lm_head 0.5 ms a row.
_PROFILE_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _profiled(**kwargs) -> StepCostModel:  # noqa: ANN003
    costs = StepCostModel(**kwargs)
    costs.set_profile(_PROFILE_ROWS, [0.005 + 0.002 * r for r in _PROFILE_ROWS], [0.0005 * r for r in _PROFILE_ROWS])
    return costs


def test_a_profiled_shape_prices_rows_where_the_steps_are_too_noisy_to() -> None:
    """Served, steps of 30-33 rows jitter by +-20 % (the API server and the client share the
    cores): a row's cost cannot be read from them, the profile's shape gives it, scaled to what
    the steps take (here 1.2x the profile)."""
    rng = np.random.default_rng(4)
    costs = _profiled()
    for _ in range(512):
        rows = int(rng.integers(30, 34))
        costs.observe(rows, 1.2 * (0.005 + 0.0025 * rows) * rng.uniform(0.8, 1.2), 0.0, 0)
    curve, _, _ = costs.step_cost(32, 32)
    assert curve[0] == pytest.approx(1.2 * (0.005 + 0.0025 * 32), rel=0.05)
    assert curve[32] - curve[0] == pytest.approx(1.2 * 0.0025 * 32, rel=0.1)
    assert costs.measured_near(1000)  # any step scales the shape: known everywhere


def test_a_tile_edge_in_the_profile_keeps_the_policy_from_crossing_it() -> None:
    """The AMX GEMM takes rows 32 at a time: a forward over 33 rows costs ~2.5 ms more than over 32
    (SmolLM2: 15.1 / 17.6 / 19.7 ms at 32 / 33 / 48 rows). The profile measures both sides of every
    such edge (`PROFILE_ROWS`); priced on it, 16 requests drafting one each (32 rows) stay there,
    although interpolating 32 -> 48 would have priced the 33rd row at 0.3 ms and taken it."""
    assert all(r in PROFILE_ROWS and r + 1 in PROFILE_ROWS for r in (16, 32, 48, 64, 96, 128, 192))
    rows = [r for r in PROFILE_ROWS if r <= 64]
    fwd = [0.009 + 0.0002 * r + 0.0025 * ((r - 1) // 32) for r in rows]
    costs = StepCostModel()
    costs.set_profile(rows, fwd, [0.0001 * r for r in rows])
    for _ in range(64):
        costs.observe(32, fwd[rows.index(32)] + 0.0032, 0.0, 0, forward_seconds=fwd[rows.index(32)] + 0.0032)
    curve, _, _ = costs.step_cost(16, 32)
    assert curve[17] - curve[16] > 0.002  # the 33rd row pays the edge
    assert curve[32] - curve[17] < 0.005
    # The 16 requests' second drafts (acceptance 0.55 at position 2 after 0.6 at 1: 0.33 tokens
    # each) do not pay one at a time across the edge: the policy keeps one draft each.
    accept = np.tile([0.6, 0.55, 0.5], (16, 1))
    lengths = choose_draft_lengths(accept, np.full(16, 2), np.asarray(curve), 0.002)
    assert lengths.tolist() == [1] * 16


def test_the_profile_follows_prompt_rows_and_the_drafter() -> None:
    """A prompt row skips the lm_head; the drafter's part is its own line through the rows it fed."""
    costs = _profiled()
    for step in range(256):
        prompt = 100 if step % 8 == 0 else 0
        rows, logits = 16 + prompt, 16
        drafter = 0.001 + 0.0001 * rows
        costs.observe(rows, 0.005 + 0.002 * rows + 0.0005 * logits + drafter, drafter, 1, num_logit_rows=logits)
    fit = costs.fit(16)
    assert fit.scale == pytest.approx(1.0, rel=0.02)
    assert fit.per_row == pytest.approx(0.0001, rel=0.25)  # the drafter's row (its ridge pulls it a little)
    curve, _, _ = costs.step_cost(16, 16, base_logit_rows=16)
    assert curve[16] - curve[0] == pytest.approx(16 * (0.0025 + 0.0001), rel=0.05)


def test_verifying_drafts_at_all_is_priced_apart_from_the_profiled_rows() -> None:
    costs = _profiled()
    for step in range(256):
        drafts = 4 if step % 3 == 0 else 0
        rows = 14 + step % 5 + drafts  # requests come and go: their rows vary apart from the drafts'
        forward = 0.005 + 0.0025 * rows
        costs.observe(rows, forward + (0.003 if drafts else 0.0), 0.0, 0, num_draft_rows=drafts,
                      forward_seconds=forward)
    fit = costs.fit(16)
    assert fit.verify_cost == pytest.approx(0.003, rel=0.1)
    assert fit.scale == pytest.approx(1.0, rel=0.02)


def test_the_work_around_the_forward_is_not_scaled_with_it() -> None:
    """A small model's served step is half Python: the forward as profiled (here slowed 1.1x by
    the API server's share of the cores), plus 4 ms of scheduling and output handling per step and
    50 us per request or draft. A draft row costs its forward's row (1.1 x 2.5 ms) and its 50 us,
    not the forward's row times the whole step's ratio to the forward (~1.2x here)."""
    rng = np.random.default_rng(7)
    costs = _profiled()
    for _ in range(512):
        rows = int(rng.integers(12, 24))
        drafts = rows - 12
        forward = 1.1 * (0.005 + 0.0025 * rows) * rng.uniform(0.9, 1.1)
        rest = (0.004 + 0.00005 * rows) * rng.uniform(0.8, 1.2)
        costs.observe(rows, forward + rest, 0.0, 0, num_draft_rows=drafts, forward_seconds=forward)
    fit = costs.fit(16)
    assert fit.scale == pytest.approx(1.1, rel=0.03)
    assert fit.per_logit_row == pytest.approx(0.00005, abs=0.00003)
    curve, first, _ = costs.step_cost(16, 8)
    assert curve[8] - curve[0] == pytest.approx(8 * (1.1 * 0.0025 + 0.00005), rel=0.08)
    assert curve[0] == pytest.approx(1.1 * (0.005 + 0.0025 * 16) + 0.004 + 0.00005 * 16, rel=0.05)
    assert first == pytest.approx(0.0, abs=0.001)


def test_what_served_forwards_take_beyond_the_profile_per_step_is_not_charged_to_draft_rows() -> None:
    """SmolLM2 served at 32 requests (AVX512-BF16): forwards took 23.7 ms where the profile said
    18.5 (x1.28), and 32 draft rows added 9.5 ms where the profile said ~9.2; priced at the ratio,
    they added 11.8, and the policy drafted nothing where one draft each served 1.09x plain. Here
    every served forward takes 20 ms more than its profile, with spells of steps verifying one draft
    each between spells without: the differences between consecutive steps show a draft row costs
    what the profile says, and the 20 ms go with the step."""
    rng = np.random.default_rng(11)
    costs = _profiled()
    for step in range(512):
        drafts = 32 if (step // 8) % 2 else 0
        rows = 32 + drafts
        forward = (0.020 + float(costs.shape(rows, rows, drafts))) * rng.uniform(0.9, 1.1)
        costs.observe(rows, forward + 0.002, 0.0, 0, num_draft_rows=drafts, forward_seconds=forward)
    fit = costs.fit(32)
    ratio = (0.020 + 0.085 + 0.020 + 0.165) / (0.085 + 0.165)  # ~1.16: what one scale would have said
    assert fit.scale == pytest.approx(1.0, abs=0.05) and fit.scale < ratio - 0.1
    curve, _, _ = costs.step_cost(32, 32)
    assert curve[32] - curve[0] == pytest.approx(float(costs.shape(64, 64, 32) - costs.shape(32, 32)), rel=0.06)
    assert curve[0] == pytest.approx(0.020 + 0.085 + 0.002, rel=0.04)


def test_the_forward_slope_on_the_profile_stays_between_half_the_profile_and_the_served_ratio() -> None:
    """Differences between consecutive steps can say anything on a loaded machine; the slope they
    give is kept where it means something: no lower than LOWEST_SLOPE of the profile's own (served
    rows can cost less, their sequences shorter than the profile's, but not that much less) and no
    higher than the served forwards' ratio to it (the per-step part never negative). Drafting steps
    slower than that slope allows are the draft scale's to price (`_draft_scale`)."""
    assert LOWEST_SLOPE == 0.5
    for extra_per_draft_step, want in ((-0.06, 0.5), (0.08, None)):  # slope 0.35 / 2.1 x the profile's
        costs = _profiled()
        for step in range(256):
            drafts = 32 if step % 2 else 0
            rows = 32 + drafts
            forward = 1.1 * float(costs.shape(rows, rows, drafts)) + (extra_per_draft_step if drafts else 0.0)
            costs.observe(rows, forward, 0.0, 0, num_draft_rows=drafts, forward_seconds=forward)
        fit = costs.fit(32)
        if want is not None:
            assert fit.scale == pytest.approx(want)
        else:  # at the ratio: the forwards are the scaled shape and nothing per step (the whole step here)
            assert fit.fixed == pytest.approx(0.0, abs=1e-4) and fit.scale > 1.2


def test_a_profile_point_above_a_larger_batch_takes_that_batch_time() -> None:
    """Timing noise only slows a run down. SmolLM2 (AVX512-BF16) once profiled 15 rows at 13.95 ms
    against 12.85 at 16 and 13.31 at 17; kept monotone by a running maximum, 15 to 17 rows cost the
    same, 7 draft rows at 16 requests were priced at a third of what they took and a step without
    drafts ~15 % above its own time (the policy drafted where it served 0.94x decoding without).
    The outlier takes the larger batch's time; the curve elsewhere is what was measured."""
    rows = [8, 14, 15, 16, 17, 24]
    fwd = [0.0087, 0.01175, 0.01395, 0.01285, 0.01331, 0.01648]
    costs = StepCostModel()
    costs.set_profile(rows, fwd, [0.0] * len(rows))
    assert [float(costs.shape(r, 0)) for r in rows] == pytest.approx([0.0087, 0.01175, 0.01285, 0.01285, 0.01331, 0.01648])
    assert float(costs.shape(23, 0) - costs.shape(16, 0)) == pytest.approx(0.00046 + 6 * (0.01648 - 0.01331) / 7)


def test_a_profile_that_ends_flat_is_extended_at_its_upper_half_slope() -> None:
    """SmolLM2 on Zen 1: the profile stops at 64 rows, and one run measured 49 rows at a spike
    (319 ms) and 64 rows lower (the envelope from below takes 300 for both): its last segment is
    flat. Extended along it, 96 more rows cost nothing, and 32 requests accepting ~0.7 drafted 3
    each (steps of ~950 ms where it predicted 560). Past the grid a row costs at least the slope over
    its upper half (32 -> 64 rows: 4.7 ms), and decoding without drafts stays the better choice."""
    rows = [1, 2, 4, 8, 16, 17, 24, 32, 33, 40, 48, 49, 64]
    fwd = [0.0248, 0.0255, 0.034, 0.0616, 0.1255, 0.1374, 0.1374, 0.1496, 0.1521, 0.1824, 0.2609, 0.3192, 0.30]
    costs = StepCostModel()
    costs.set_profile(rows, fwd, [0.0] * len(rows))
    assert float(costs.shape(49, 0)) == pytest.approx(0.30)  # the spike: the larger batch's time
    slope = (0.30 - 0.1496) / 32
    assert float(costs.shape(128, 0)) == pytest.approx(0.30 + 64 * slope)
    for _ in range(64):
        costs.observe(32, 0.16, 0.0, 0, forward_seconds=0.15)
    curve, first, pass_cost = costs.step_cost(32, 96)
    accept = np.tile([0.72, 0.69, 0.67], (32, 1))
    assert choose_draft_lengths(accept, np.full(32, 3), np.asarray(curve), pass_cost, first, 0.03).sum() == 0


def test_draft_rows_are_priced_as_rows_of_their_requests_sequences() -> None:
    """A sequence's attention reads its keys once whatever its query rows: on SmolLM2 (AMX, 150
    cached tokens) 32 requests verifying one draft each took 38.6 ms where 64 requests of a row
    took 43.3. Priced as the latter (the only profile there was), a draft row at 32 requests looked
    twice its cost and the policy drafted nothing where one draft each ran 1.2x faster. With the
    forward also profiled at k + 1 rows to a sequence, a step's shape moves from one curve to the
    other with its share of draft rows; prompt and decode rows keep the first. What grouping saves
    (the attention of the sequences it spares) is measured at a few rows and is linear between
    them, in proportion to the rows beyond."""
    rows = [1, 16, 32, 64, 128, 256]
    own = [0.010, 0.016, 0.024, 0.040, 0.072, 0.136]  # 0.5 ms a row past 32 (GEMM + a sequence's attention)
    costs = StepCostModel()
    costs.set_profile(rows, own, [0.0] * len(rows), [16, 32, 64], [0.014, 0.019, 0.028], group=4)
    assert float(costs.shape(64, 0)) == pytest.approx(0.040)  # 64 rows of their own
    assert float(costs.shape(64, 0, 48)) == pytest.approx(0.028)  # 16 requests verifying 3 drafts each
    assert float(costs.shape(64, 0, 32)) == pytest.approx(0.040 - (32 / 48) * 0.012)  # 32 verifying one each
    assert float(costs.shape(64, 0, 60)) == pytest.approx(0.028)  # never below the grouped shape
    assert float(costs.shape(48, 0, 36)) == pytest.approx(0.032 - (0.005 + 0.012) / 2)  # between the points
    assert float(costs.shape(8, 0, 6)) == pytest.approx(float(costs.shape(8, 0)) - 0.001)  # towards 0 at 0 rows
    assert float(costs.shape(256, 0, 192)) == pytest.approx(0.136 - 0.048)  # beyond: in proportion to the rows
    # Served steps: 32 requests take 1.2x the profile whether or not they verify drafts.
    for step in range(256):
        drafts = 32 if step % 2 else 0
        forward = 1.2 * float(costs.shape(32 + drafts, 0, drafts))
        costs.observe(32 + drafts, forward, 0.0, 0, num_logit_rows=0, num_draft_rows=drafts, forward_seconds=forward)
    fit = costs.fit(32)
    assert fit.scale == pytest.approx(1.2, rel=0.01)
    curve, _, _ = costs.step_cost(32, 32, base_logit_rows=0)
    assert curve[32] - curve[0] == pytest.approx(1.2 * (0.040 - (32 / 48) * 0.012 - 0.024), rel=0.02)
    # One draft each accepting 0.6: 1.6x the tokens for 1.3x the forward. Priced as 64 rows of
    # their own (1.67x the forward), drafting would lose.
    accept = np.tile([0.6, 0.5, 0.4], (32, 1))
    assert choose_draft_lengths(accept, np.full(32, 1), np.asarray(curve), 0.0, 0.0, 0.03).tolist() == [1] * 32
    plain = StepCostModel()
    plain.set_profile(rows, own, [0.0] * len(rows))
    for step in range(256):
        drafts = 32 if step % 2 else 0
        plain.observe(32 + drafts, 1.2 * float(plain.shape(32 + drafts, 0)), 0.0, 0, num_logit_rows=0,
                      num_draft_rows=drafts)
    own_curve, _, _ = plain.step_cost(32, 32, base_logit_rows=0)
    assert choose_draft_lengths(accept, np.full(32, 1), np.asarray(own_curve), 0.0, 0.0, 0.03).sum() == 0


def test_a_grouped_measurement_above_the_own_rows_curve_is_noise() -> None:
    """Fewer sequences never read more keys: a grouped point measured above the other curve saves
    nothing (the saving is never negative)."""
    costs = StepCostModel()
    costs.set_profile([1, 16, 32], [0.010, 0.016, 0.024], [0.0] * 3, [16, 32], [0.030, 0.020], group=2)
    assert costs._saving is not None and costs._saving[1].tolist() == pytest.approx([0.0, 0.0, 0.004])
    assert float(costs.shape(16, 0, 8)) == pytest.approx(0.016)
    assert float(costs.shape(32, 0, 16)) == pytest.approx(0.020)


def test_a_bad_profile_is_refused() -> None:
    costs = StepCostModel()
    with pytest.raises(ValueError, match="rise"):
        costs.set_profile([4, 2], [0.1, 0.2], [0.0, 0.0])
    with pytest.raises(ValueError, match="one length"):
        costs.set_profile([1, 2], [0.1], [0.0, 0.0])
    with pytest.raises(ValueError, match="rise"):
        costs.set_profile([0, 2], [0.1, 0.2], [0.0, 0.0])
    with pytest.raises(ValueError, match="> 0"):
        costs.set_profile([1, 2], [0.0, 0.2], [0.0, 0.0])
    with pytest.raises(ValueError, match="grouped profile needs rows and seconds of one length"):
        costs.set_profile([1, 2], [0.1, 0.2], [0.0, 0.0], [1, 2], [0.1], group=4)
    with pytest.raises(ValueError, match=r"must rise and be profiled rows \(\[1, 2\]\), got \[3\]"):
        costs.set_profile([1, 2], [0.1, 0.2], [0.0, 0.0], [3], [0.1], group=4)
    with pytest.raises(ValueError, match="grouped profile seconds must be > 0"):
        costs.set_profile([1, 2], [0.1, 0.2], [0.0, 0.0], [2], [0.0], group=4)
    with pytest.raises(ValueError, match="grouped 2 or more to a sequence, got group=1"):
        costs.set_profile([1, 2], [0.1, 0.2], [0.0, 0.0], [2], [0.1], group=1)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 5000), st.floats(1e-4, 1.0), st.floats(0.0, 0.5), st.integers(0, 4),
                                st.integers(0, 8)), min_size=1, max_size=40),
       base=st.integers(1, 6000), extra=st.integers(0, 64),
       profile=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=len(_PROFILE_ROWS)))
def test_profiled_times_are_positive_and_never_fall(steps, base, extra, profile) -> None:  # noqa: ANN001
    """Whatever the profile measured (noise included: a bigger batch faster than a smaller one)."""
    costs = StepCostModel(window=16)
    rows = _PROFILE_ROWS[: len(profile)]
    costs.set_profile(rows, profile, profile[::-1])
    for r, seconds, drafter, passes, drafts in steps:
        costs.observe(r, seconds, drafter * seconds, passes, num_draft_rows=drafts)
    _assert_sane_costs(costs, base, extra)


def test_a_profiled_curve_is_the_same_whatever_was_asked_before() -> None:
    """One curve per batch serves every number of draft rows (cached, grown when a longer one is
    asked): each answer equals a fresh model's."""
    rng = np.random.default_rng(7)
    steps = [(int(rng.integers(2, 40)), float(rng.uniform(0.01, 0.1))) for _ in range(64)]

    def model() -> StepCostModel:
        costs = _profiled()
        for rows, seconds in steps:
            costs.observe(rows, seconds, 0.001, 1, forward_seconds=0.8 * seconds)
        return costs

    shared = model()
    for extra in (5, 20, 3, 0, 64, 21):
        assert shared.step_cost(12, extra, 6) == model().step_cost(12, extra, 6)


def test_where_every_step_drafted_alike_a_step_without_drafts_costs_its_forward_at_least() -> None:
    """16 requests drafting 3 each, every step alike (the static steps an engine starts with): 64 rows,
    the drafter feeding 64 positions in 3 passes, 6.4 ms of its 172 ms. Neither the drafter's rows nor
    its first pass vary, so both are their priors, each of which explains all 6.4 ms; the drafter's
    fixed part came out negative, and 16 requests decoding without drafts were priced under their own
    forward (42.2 ms against 45), which made drafting look dearer than it was (on the demo at 16
    requests it then drafted nothing in half its decisions where k = 3 ran 15 % faster)."""
    costs = _profiled()
    forward = 0.005 + 0.0025 * 64  # the profile's forward and lm_head over 64 rows
    for _ in range(64):
        costs.observe(64, forward + 0.0064 + 0.001, 0.0064, 3, num_logit_rows=64, num_draft_rows=48,
                      drafter_rows=64, forward_seconds=forward)
    curve, first_cost, pass_cost = costs.step_cost(16, 48, base_logit_rows=16)
    assert curve[0] >= 0.005 + 0.0025 * 16  # the forward of 16 rows, at least
    # what the drafting steps measured, still: the model moved no time out of them
    assert curve[48] + first_cost + 2 * pass_cost == pytest.approx(forward + 0.0074, rel=0.02)


def test_drafting_far_from_its_base_is_priced_at_what_its_steps_took() -> None:
    """16 requests drafting 3 each verify 64 rows, beyond the cut of the fit at 16: their step is
    priced on the profile's shape from the steps near 16 rows. Where the shape is off out there
    (here the forward over 64 rows takes 1.15x what the profile says, as a profile taken at
    start-up can be), the drafting steps themselves say so: every drafting cost is scaled to what
    they took beyond their base, and the step without drafts keeps its price."""
    costs = _profiled()
    alone = 0.005 + 0.0025 * 16
    deep = 1.15 * (0.005 + 0.0025 * 64)  # the forward over 64 rows, as it runs
    took = deep + 0.003 + 0.001  # the drafter's 3 passes, the verification
    for _ in range(16):
        for _ in range(16):
            costs.observe(16, alone + 0.0005, 0.0, 0, forward_seconds=alone)
        for _ in range(16):
            costs.observe(64, took, 0.003, 3, num_draft_rows=48, drafter_rows=32, drafter_pass_rows=32,
                          forward_seconds=deep, drafting_reqs=16)
    assert costs.draft_scale(16) > 1.1  # the parts alone priced it well under what it took
    curve, first, per_pass = costs.step_cost(16, 48, base_logit_rows=16)
    assert curve[0] == pytest.approx(alone + 0.0005, rel=0.03)
    assert curve[48] + first + 2 * per_pass + 16 * costs.request_cost(16) == pytest.approx(took, rel=0.03)
    # Drafting where every step near its base drafted alike, and the parts price it right: no scale.
    even = _profiled()
    for _ in range(256):
        even.observe(64, 0.005 + 0.0025 * 64 + 0.004, 0.003, 3, num_draft_rows=48, drafter_rows=32,
                     drafter_pass_rows=32, forward_seconds=0.005 + 0.0025 * 64, drafting_reqs=16)
    assert even.draft_scale(16) == pytest.approx(1.0, abs=0.03)


def test_a_few_odd_steps_near_a_batch_size_do_not_set_its_scale() -> None:
    """32 requests drafting 3 each: 128-row steps, far from a fit at 32, and near 32 rows only a few
    steps of another kind (a spell's first step, a prompt chunk), their forwards 1.4x what the rest
    say of the machine. The fit at 32 leans on every step as much as on those few: the step
    without drafts is priced at the scale the 128-row steps measured, not at theirs."""
    costs = _profiled()
    shape = lambda r: 0.005 + 0.0025 * r  # noqa: E731
    for i in range(400):
        if i % 50 == 0:
            costs.observe(30, 1.4 * 1.9 * shape(30) + 0.001, 0.0, 0, forward_seconds=1.4 * 1.9 * shape(30))
        else:
            costs.observe(128, 1.9 * shape(128) + 0.004, 0.003, 3, num_draft_rows=96, drafter_rows=64,
                          drafter_pass_rows=64, forward_seconds=1.9 * shape(128), drafting_reqs=32)
    assert costs.fit(32).scale == pytest.approx(1.9, rel=0.12)


def test_after_a_spell_without_drafts_a_batch_size_drafts_its_caps_until_the_drafter_is_measured_there(
) -> None:
    """A window whose drafter steps aged out (a spell of opted-out traffic) holds nothing the drafting
    costs at this batch size are read from: every request drafts its cap (static) until
    MIN_DRAFTING_STEPS drafter steps near it are in the window again, then the policy decides."""
    policy = AdaptiveDrafting(3, drafter_passes=True)
    for rows in (2, 4, 6, 8) * 4:  # drafting steps at small batches
        policy.observe_step(rows, 0.6 + 0.2 * rows, 0.1, 1, num_draft_rows=1)
    for _ in range(30):
        policy.observe_verification("a", 3, 0)  # "a" never accepts: the policy would draft nothing
    assert policy.choose(["a"], [3], base_rows=2) == [0] and policy.last_decision == "fresh"
    for i in range(policy.costs.window):  # a spell of steps without the drafter
        policy.observe_step(2 + i % 3, 1.0, 0.0, 0)
    assert policy.choose(["a"], [3], base_rows=2) == [3] and policy.last_decision == "static"
    for _ in range(MIN_DRAFTING_STEPS):
        policy.observe_step(5, 1.6, 0.1, 1, num_draft_rows=3)
    assert policy.choose(["a"], [3], base_rows=2) == [0] and policy.last_decision != "static"


def test_only_decode_steps_count_as_the_drafter_measured_near_a_batch() -> None:
    """`drafted_near` counts steps that ran the drafter on decode rows alone: a step that also ran
    a prompt chunk or fed the drafter a catch-up (BULK_FEED positions or more) is mostly that work,
    and a round of new requests opens with such steps. Priced on them, the demo's first round at 16
    requests after rounds at one drafted nothing, at ~0.6 of k = 3's tokens a second. Each kind of
    step below lies near 16 rows (its base within the fit's cut) and ran the drafter."""
    def prompt_chunk(costs: StepCostModel) -> None:  # 8 requests drafting 3 each, 36 prompt rows
        costs.observe(8 + 36 + 24, 0.004, 0.001, 3, num_logit_rows=8 + 24, num_draft_rows=24)

    def catch_up(costs: StepCostModel) -> None:  # 16 requests drafting 3 each, the drafter catching up
        costs.observe(16 + 48, 0.004, 0.002, 3, num_draft_rows=48, drafter_rows=16 + 48 + BULK_FEED)

    def decoding(costs: StepCostModel) -> None:
        costs.observe(16 + 48, 0.003, 0.001, 3, num_draft_rows=48)

    for kind in (prompt_chunk, catch_up):
        costs = StepCostModel()
        for _ in range(2 * MIN_DRAFTING_STEPS):
            kind(costs)
        assert costs.drafting_steps == 2 * MIN_DRAFTING_STEPS
        assert not costs.drafted_near(16, MIN_DRAFTING_STEPS)
        for _ in range(MIN_DRAFTING_STEPS):
            decoding(costs)
        assert costs.drafted_near(16, MIN_DRAFTING_STEPS)


def test_a_lookup_drafter_decides_once_its_verifications_are_measured() -> None:
    """n-gram lookup runs no drafter pass: its drafting steps are the steps that verified drafts, so
    the policy leaves static drafting once MIN_DRAFTING_STEPS of them were measured near the batch
    (counting drafter passes, it never would: `adaptive` would be static drafting for good)."""
    policy = AdaptiveDrafting(3, drafter_passes=False)
    for _ in range(30):
        policy.observe_verification("a", 3, 0)  # "a" never accepts
    for i in range(MIN_DRAFTING_STEPS - 1):
        policy.observe_step(4 + 3 * (i % 2), 0.01 + 0.002 * (i % 2), 0.0, 0, num_draft_rows=3 * (i % 2))
    assert policy.choose(["a"], [3], base_rows=4) == [3] and policy.last_decision == "static"
    for i in range(2 * MIN_DRAFTING_STEPS):
        policy.observe_step(4 + 3 * (i % 2), 0.01 + 0.002 * (i % 2), 0.0, 0, num_draft_rows=3 * (i % 2))
    assert policy.choose(["a"], [3], base_rows=4) == [0] and policy.last_decision == "fresh"
