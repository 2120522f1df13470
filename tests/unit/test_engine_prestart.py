"""Prestarted engine ranks (`core_client.PrestartedRank`): `phalanx serve` starts its local ranks
before the tokenizer is loaded, so they import torch meanwhile. A cancelled one ends at once, one
that died before its configuration came is replaced by a fresh spawn, and a rank never runs another
rank's configuration. (A served start through them: every e2e server test.)"""

from __future__ import annotations

import os
import signal

import pytest

from phalanx.engine import core_client
from phalanx.engine.core_process import EngineProcessConfig


def _config(rank: int) -> EngineProcessConfig:
    return EngineProcessConfig(engine_args={}, rank=rank, data_parallel_size=2, input_address="ipc:///nowhere-in",
                               output_address="ipc:///nowhere-out", log_level="info")


def test_a_cancelled_rank_ends_at_once() -> None:
    prestarted = core_client.prestart_ranks(range(1))
    proc = prestarted[0].process
    core_client.cancel_prestarted(prestarted)
    assert prestarted == {}
    assert not proc.is_alive() and proc.exitcode in (0, -signal.SIGTERM)


def test_a_rank_dead_before_its_configuration_is_spawned_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[EngineProcessConfig] = []
    monkeypatch.setattr(core_client, "spawn_rank", lambda cfg: spawned.append(cfg) or "fresh")
    rank = core_client.PrestartedRank(1)
    os.kill(rank.process.pid, signal.SIGKILL)
    rank.process.join(30)
    assert rank.launch(_config(1)) == "fresh"
    assert [c.rank for c in spawned] == [1]


def test_a_rank_runs_only_its_own_configuration() -> None:
    rank = core_client.PrestartedRank(0)
    try:
        with pytest.raises(ValueError, match="prestarted rank 0 cannot run rank 1"):
            rank.launch(_config(1))
    finally:
        rank.cancel()
    assert not rank.process.is_alive()
