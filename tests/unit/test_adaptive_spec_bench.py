"""benchmarks/adaptive_spec.py's bookkeeping: which server and request fields each mode uses, and the
paired ratios its table prints (the servers themselves: the benchmark's own runs)."""

from __future__ import annotations

import pytest

from benchmarks.adaptive_spec import best_mode_ratio, merge_saved, mode_server, table


def test_each_mode_runs_on_its_server_with_its_fields() -> None:
    assert mode_server("plain", False) == ("static", {"speculative": False})
    assert mode_server("k=2", False) == ("static", {"num_speculative_tokens": 2})
    assert mode_server("adaptive", False) == ("adaptive", {})
    assert mode_server("plain@adaptive", False) == ("adaptive", {"speculative": False})
    pinned = ("adaptive", {"num_speculative_tokens": 3, "speculative_adaptive": False})
    assert mode_server("k=3@adaptive", False) == pinned and mode_server("k=3@adaptive", True) == pinned
    assert mode_server("k=2", True) == ("k=2", {})


def test_the_same_server_ratio_takes_the_best_of_plain_and_pinned_k_round_by_round() -> None:
    def point(*rounds: float) -> dict:
        return {"output_throughput": sorted(rounds)[len(rounds) // 2], "rounds_output_throughput": list(rounds)}

    modes = ["plain", "k=3", "adaptive", "plain@adaptive", "k=3@adaptive"]
    results = {
        "plain": {"chat/c4": point(100.0, 100.0, 100.0)},
        "k=3": {"chat/c4": point(150.0, 150.0, 150.0)},
        "adaptive": {"chat/c4": point(120.0, 160.0, 90.0)},
        "plain@adaptive": {"chat/c4": point(100.0, 100.0, 100.0)},
        "k=3@adaptive": {"chat/c4": point(120.0, 150.0, 100.0)},
    }
    text = table(results, modes, "chat", [4])
    header, _, row = text.splitlines()
    assert header.endswith("| paired: adaptive / max(plain@adaptive, best k@adaptive) "
                           "| paired: adaptive / the best mode@adaptive [90 % interval] |")
    # rounds: 120/120, 160/150, 90/100 -> median 1.0; against the static server: 0.8, 1.067, 0.6 -> 0.8
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2] == "1.000" and cells[-5] == "0.800"
    # against k=3@adaptive alone (the best median): 1.0, 1.067, 0.9 -> 1.0
    assert cells[-1].startswith("1.000 [") and cells[-1].endswith("(k=3@adaptive)")


def test_the_best_mode_is_chosen_by_its_median_and_the_interval_holds_the_median() -> None:
    """Two close modes: the per-round maximum would take each round's luckier one; the best mode is
    the one whose median is higher, and adaptive is paired with it alone."""
    rounds = [{"adaptive": 100.0, "plain@adaptive": 100.0 + d, "k=3@adaptive": 100.0 - d}
              for d in (5.0, -5.0, 4.0, -3.0, 2.0)]
    best, mid, lo, hi = best_mode_ratio(rounds, ["plain@adaptive", "k=3@adaptive"])
    assert best == "plain@adaptive"  # medians 102 against 98
    assert mid == 100.0 / 102.0
    assert lo <= mid <= hi and 100.0 / 105.0 <= lo and hi <= 100.0 / 95.0


def test_saved_runs_merge_into_one_grid_and_refuse_overlaps_and_gaps() -> None:
    def run(*points: str) -> dict:
        return {"meta": {}, "results": {m: {p: {"output_throughput": 1.0} for p in points}
                                        for m in ("adaptive", "plain@adaptive")}}  # fmt: skip

    results, modes, names, levels = merge_saved([run("plain/c1", "plain/c16"), run("mixed/c1", "mixed/c16")])
    assert modes == ["adaptive", "plain@adaptive"] and names == ["plain", "mixed"] and levels == [1, 16]
    assert set(results["adaptive"]) == {"plain/c1", "plain/c16", "mixed/c1", "mixed/c16"}
    with pytest.raises(ValueError, match="more than one file"):
        merge_saved([run("plain/c1"), run("plain/c1")])
    with pytest.raises(ValueError, match="full grid"):
        merge_saved([run("plain/c1", "plain/c4"), run("mixed/c1")])
    other = run("mixed/c1")
    other["results"]["k=1@adaptive"] = other["results"].pop("plain@adaptive")
    with pytest.raises(ValueError, match="different modes"):
        merge_saved([run("plain/c1"), other])
