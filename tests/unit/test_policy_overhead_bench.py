"""benchmarks/policy_overhead.py's timers: each wrapped entry point still returns what it did and
adds its calls and seconds; putting the originals back leaves nothing wrapped."""

from __future__ import annotations

from benchmarks.policy_overhead import TIMED, install_timers
from phalanx.spec_decode import adaptive
from phalanx.spec_decode.adaptive import AdaptiveDrafting


def test_the_timers_count_every_call_and_change_no_answer() -> None:
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    before = AdaptiveDrafting.choose, adaptive.prefer_uniform
    originals = install_timers(seconds, calls)
    try:
        assert len(originals) == sum(len(names) for _, _, names in TIMED)
        policy = AdaptiveDrafting(3, drafter_passes=True)
        assert policy.choose(["a", "b"], [3, 2], base_rows=2) == [3, 2]  # nothing measured: every cap
        assert calls["choose"] == 1 and seconds["choose"] > 0
        assert calls.get("drafted_near", 0) + calls.get("step_cost", 0) <= 1
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    assert (AdaptiveDrafting.choose, adaptive.prefer_uniform) == before
