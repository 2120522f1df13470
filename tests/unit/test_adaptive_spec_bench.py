"""benchmarks/adaptive_spec.py's bookkeeping: which server and request fields each mode uses, and the
paired ratios its table prints (the servers themselves: the benchmark's own runs)."""

from __future__ import annotations

from benchmarks.adaptive_spec import mode_server, table


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
    assert header.endswith("| paired: adaptive / max(plain@adaptive, best k@adaptive) |")
    # rounds: 120/120, 160/150, 90/100 -> median 1.0; against the static server: 0.8, 1.067, 0.6 -> 0.8
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "1.000" and cells[-4] == "0.800"
