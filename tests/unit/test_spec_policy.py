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

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from phalanx.spec_decode.adaptive import PRIOR_FIXED_ROWS, AcceptanceStats, AdaptiveDrafting, StepCostModel
from phalanx.spec_decode.policy import choose_draft_lengths, choose_draft_lengths_small, expected_tokens


def _ratio(accept: np.ndarray, lengths: np.ndarray, step_cost: np.ndarray, pass_cost: float) -> float:
    depth = int(lengths.max(initial=0))
    return expected_tokens(accept, lengths) / (step_cost[int(lengths.sum())] + pass_cost * max(depth - 1, 0))


@st.composite
def _problems(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    num_reqs = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    accept = draw(arrays(np.float64, (num_reqs, k), elements=st.floats(0.0, 1.0)))
    caps = np.array(draw(st.lists(st.integers(0, k), min_size=num_reqs, max_size=num_reqs)), dtype=np.int64)
    base = draw(st.floats(0.01, 10.0))
    steps = draw(arrays(np.float64, int(caps.sum()), elements=st.floats(0.0, 2.0)))
    step_cost = base + np.concatenate(([0.0], np.cumsum(steps)))  # non-decreasing, > 0
    pass_cost = draw(st.floats(0.0, 5.0))
    return accept, caps, step_cost, pass_cost


@settings(max_examples=400, deadline=None)
@given(_problems())
def test_the_choice_is_the_brute_force_optimum(problem) -> None:  # noqa: ANN001
    accept, caps, step_cost, pass_cost = problem
    before = (accept.copy(), caps.copy(), step_cost.copy())
    lengths = choose_draft_lengths(accept, caps, step_cost, pass_cost)
    assert np.array_equal(accept, before[0]) and np.array_equal(caps, before[1])
    assert np.array_equal(step_cost, before[2])  # pure: nothing it reads is changed
    assert lengths.dtype == np.int64 and lengths.shape == caps.shape
    assert ((lengths >= 0) & (lengths <= caps)).all()
    best = max(
        _ratio(accept, np.array(d), step_cost, pass_cost) for d in itertools.product(*(range(c + 1) for c in caps))
    )
    assert _ratio(accept, lengths, step_cost, pass_cost) >= best * (1 - 1e-9)


@settings(max_examples=300, deadline=None)
@given(_problems())
def test_the_plain_python_path_chooses_the_same(problem) -> None:  # noqa: ANN001
    """`choose_draft_lengths_small` (plain Python, low concurrency) == `choose_draft_lengths`."""
    accept, caps, step_cost, pass_cost = problem
    small = choose_draft_lengths_small(accept.tolist(), caps.tolist(), step_cost.tolist(), pass_cost)
    assert small == choose_draft_lengths(accept, caps, step_cost, pass_cost).tolist()


@settings(max_examples=100, deadline=None)
@given(_problems())
def test_an_equally_good_choice_with_fewer_drafts_is_preferred(problem) -> None:  # noqa: ANN001
    """Ties go to fewer passes, then fewer rows: with nothing ever accepted nobody drafts."""
    _, caps, step_cost, pass_cost = problem
    lengths = choose_draft_lengths(np.zeros((caps.shape[0], 4)), caps, step_cost, pass_cost)
    assert (lengths == 0).all()


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


def test_step_cost_too_short_is_an_error() -> None:
    with pytest.raises(ValueError, match="step_cost needs 4 entries"):
        choose_draft_lengths(np.ones((1, 3)), np.array([3]), np.ones(2), 0.0)


def test_no_requests_or_no_room() -> None:
    assert choose_draft_lengths(np.ones((0, 3)), np.zeros(0, dtype=np.int64), np.ones(1), 0.0).tolist() == []
    assert choose_draft_lengths(np.ones((2, 3)), np.array([0, 0]), np.ones(1), 0.0).tolist() == [0, 0]


def test_acceptance_rates_are_conditional_per_position() -> None:
    """3 drafts, 1 accepted: positions 1 and 2 were tested, position 3 was not (its rate stays at the
    prior); position 1 accepted, position 2 rejected."""
    stats = AcceptanceStats(3, prior=0.5, prior_weight=1e-9, request_weight=1e-9)
    for _ in range(5):
        stats.observe("a", 3, 1)
    rates = stats.rates(["a"])[0]
    assert rates[0] == pytest.approx(1.0) and rates[1] == pytest.approx(0.0, abs=1e-6)
    assert rates[2] == pytest.approx(0.5)  # never tested: the engine-wide prior
    stats.observe("b", 2, 2)  # both accepted; no third draft, so position 3 is not tested
    decayed = sum(0.995**i for i in range(1, 6))  # "a"'s five tests, decayed once per later observation
    assert stats.engine_tested == pytest.approx([decayed + 1, decayed + 1, 0.0])


def test_a_new_request_starts_from_the_engine_wide_rate_and_follows_its_own() -> None:
    stats = AcceptanceStats(2)
    for i in range(50):
        stats.observe(f"r{i}", 2, 2)  # everyone accepts everything
    fresh = stats.rates(["new"])[0]
    assert (fresh > 0.9).all()
    for _ in range(20):
        stats.observe("bad", 2, 0)  # this one never accepts
    assert stats.rates(["bad"])[0][0] < 0.2
    stats.forget("bad")  # forgotten: back to the engine-wide rate (which its rejections lowered)
    assert stats.rates(["bad"])[0].tolist() == pytest.approx(stats.engine_rates())
    assert 0.5 < stats.engine_rates()[0] < 0.9


def test_step_cost_curve() -> None:
    costs = StepCostModel(alpha=1.0)
    assert not costs.measured
    costs.observe(4, 2.0, 0.0, 0, decode_only=True)
    assert costs.measured
    # One bucket measured: flat below it, the prior shape (time ~ rows + PRIOR_FIXED_ROWS) above.
    assert costs.step_cost(np.array([1.0, 4.0, 20.0])).tolist() == pytest.approx(
        [2.0, 2.0, 2.0 * (20 + PRIOR_FIXED_ROWS) / (4 + PRIOR_FIXED_ROWS)])
    costs.observe(32, 6.0, 0.0, 0, decode_only=True)
    got = costs.step_cost(np.array([4.0, 18.0, 32.0, 64.0]))
    assert got[:3].tolist() == pytest.approx([2.0, 4.0, 6.0])  # measured points, linear between
    assert got[3] == pytest.approx(6.0 + 32 * 4.0 / 28)  # along the last segment beyond them
    costs.observe(64, 1.0, 0.0, 0, decode_only=True)  # a noisy fast step: the curve never decreases
    assert (np.diff(costs.step_cost(np.arange(1.0, 100.0))) >= -1e-12).all()


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 5000), st.floats(1e-4, 1.0)), min_size=1, max_size=30),
       rows=st.lists(st.floats(0.0, 6000.0), min_size=1, max_size=20))
def test_the_scalar_and_vector_curves_agree(steps, rows) -> None:  # noqa: ANN001
    costs = StepCostModel()
    for n, seconds in steps:
        costs.observe(n, seconds, 0.0, 0, decode_only=True)
    vector = costs.step_cost(np.array(rows))
    assert vector.tolist() == pytest.approx([costs.cost_at(r) for r in rows], rel=1e-9)
    assert (vector > 0).all()


def test_drafter_passes_after_the_first_are_costed_apart() -> None:
    """A 10 s step whose drafter took 3 s in 3 passes: the curve keeps the step without passes 2-3
    (8 s), the pass cost is 1 s; a step with a prefill chunk does not change the pass cost."""
    costs = StepCostModel(alpha=1.0)
    costs.observe(8, 10.0, 3.0, 3, decode_only=True)
    assert costs.pass_cost == pytest.approx(1.0)
    assert costs.step_cost(np.array([8.0]))[0] == pytest.approx(8.0)
    costs.observe(100, 50.0, 30.0, 3, decode_only=False)
    assert costs.pass_cost == pytest.approx(1.0)


def test_adaptive_drafting_drafts_the_caps_until_a_step_was_measured() -> None:
    policy = AdaptiveDrafting(3, drafter_passes=True)
    assert policy.choose(["a", "b"], [3, 1], base_rows=2) == [3, 1]
    for _ in range(30):
        policy.observe_verification("a", 3, 0)  # "a" never accepts
        policy.observe_verification("b", 3, 3)  # "b" always does
    policy.observe_step(2, 1.0, 0.1, 1, decode_only=True)
    policy.observe_step(8, 2.0, 0.3, 3, decode_only=True)
    a, b = policy.choose(["a", "b"], [3, 3], base_rows=2)
    assert a == 0 and b > 0
