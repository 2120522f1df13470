"""Prestarted engine ranks (`core_client.PrestartedRank`): `phalanx serve` starts its local ranks
before the tokenizer is loaded, so they import torch meanwhile. A cancelled one ends at once, one
that died before its configuration came is replaced by a fresh spawn, a rank never runs another
rank's configuration, and a start that fails leaves none behind. (A served start through them:
every e2e server test.)"""

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


def test_a_failed_start_leaves_no_prestarted_rank_behind() -> None:
    """A rank's input address that cannot be bound (its port taken) fails `start` before the ranks
    are reached; the shutdown that follows (as `phalanx serve` does on any start-up error) ends the
    prestarted ranks at once instead of leaving them waiting for a configuration."""
    import asyncio
    import socket

    import zmq

    from phalanx.net import free_listen_ports

    base = free_listen_ports(4)
    taken = socket.socket()
    taken.bind(("127.0.0.1", base + 1))  # rank 0's input port
    taken.listen()
    prestarted = core_client.prestart_ranks(range(2))
    procs = [p.process for p in prestarted.values()]
    config = core_client.EngineClientConfig(engine_args=None, data_parallel_size=2,
                                            data_parallel_address="127.0.0.1", data_parallel_rpc_port=base)

    async def start_then_shut_down() -> None:
        client = core_client.EngineCoreClient(config, prestarted)
        try:
            with pytest.raises(zmq.ZMQError):
                await client.start()
        finally:
            await client.shutdown()

    try:
        asyncio.run(start_then_shut_down())
    finally:
        taken.close()
    assert prestarted == {}
    assert all(not p.is_alive() for p in procs)
