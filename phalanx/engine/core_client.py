"""The API server's handle on its engine-core processes: start, route, abort, watch, stop.

Owns: spawning one engine-core process per data-parallel rank (``multiprocessing`` spawn context),
the ZMQ sockets to them (asyncio), the start-up handshake (every rank reports `EngineReady` or a
clear `EngineFailed` message), routing each request to the least-loaded rank (unfinished engine
requests routed there: running + waiting, as the client sees them), and noticing a dead rank.
Does not own: the message formats or the engine loop (``core_process``), text, request state
and streaming (``entrypoints.async_llm``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from phalanx.engine.core_process import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineMessage,
    EngineProcessConfig,
    EngineReady,
    Shutdown,
    run_engine_core,
)
from phalanx.engine.engine_core import EngineCoreRequest

logger = logging.getLogger("phalanx.engine")


class EngineStartupError(RuntimeError):
    """An engine-core rank could not start (bad model path, bad config, crash while loading)."""


class EngineDeadError(RuntimeError):
    """An engine-core rank died or failed while serving."""


@dataclass
class RankHandle:
    rank: int
    process: Any  # multiprocessing.Process (spawn context)
    input_socket: zmq.asyncio.Socket
    ready: EngineReady | None = None
    num_unfinished: int = 0  # engine requests routed here and not finished yet


@dataclass
class EngineClientConfig:
    engine_args: Any  # EngineArgs
    data_parallel_size: int = 1
    extra_eos_token_ids: list[int] = field(default_factory=list)
    log_level: str = "info"
    startup_timeout_s: float = 600.0


class EngineCoreClient:
    """Engine ranks behind ZMQ. Create, then `await start()`; use from one asyncio event loop."""

    def __init__(self, config: EngineClientConfig) -> None:
        self.config = config
        self.ranks: list[RankHandle] = []
        self._req_rank: dict[str, RankHandle] = {}
        self._next_rank = 0
        self._ctx = zmq.asyncio.Context()
        self._ipc_dir = tempfile.mkdtemp(prefix="phalanx-ipc-")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._output_socket = self._ctx.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.LINGER, 0)
        self._output_address = f"ipc://{self._ipc_dir}/output"
        self._output_socket.bind(self._output_address)
        self.dead_message: str | None = None

    # ---- start-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn every rank and wait until all report ready. Raises EngineStartupError otherwise."""
        cfg = self.config
        spawn = multiprocessing.get_context("spawn")
        dp = cfg.data_parallel_size
        threads = max(1, (os.cpu_count() or 1) // dp) if dp > 1 else None
        engine_args = dataclasses.asdict(cfg.engine_args)
        for rank in range(dp):
            address = f"ipc://{self._ipc_dir}/input-{rank}"
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            proc_cfg = EngineProcessConfig(
                engine_args=engine_args,
                rank=rank,
                data_parallel_size=dp,
                input_address=address,
                output_address=self._output_address,
                extra_eos_token_ids=list(cfg.extra_eos_token_ids),
                log_level=cfg.log_level,
                num_threads=threads,
            )
            proc = spawn.Process(
                target=run_engine_core,
                args=(msgspec.msgpack.encode(proc_cfg),),
                name=f"phalanx-engine-{rank}",
                daemon=True,
            )
            proc.start()
            self.ranks.append(RankHandle(rank, proc, sock))
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not all(r.ready for r in self.ranks):
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"engine start-up timed out after {self.config.startup_timeout_s:.0f} s"
                )
            if await self._output_socket.poll(200):
                msg = self._decoder.decode(await self._output_socket.recv())
                if isinstance(msg, EngineReady):
                    self.ranks[msg.rank].ready = msg
                    logger.info(
                        "engine rank %d ready (pid %d, %d KV blocks)", msg.rank, msg.pid, msg.num_kv_blocks
                    )
                elif isinstance(msg, EngineFailed):
                    raise EngineStartupError(f"engine rank {msg.rank} failed to start: {msg.message}")
                continue
            dead = self.dead_rank()
            if dead is not None:
                raise EngineStartupError(
                    f"engine rank {dead.rank} exited during start-up with code {dead.process.exitcode}"
                )

    @property
    def max_model_len(self) -> int:
        assert self.ranks[0].ready is not None
        return self.ranks[0].ready.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.ranks[0].ready is not None
        return self.ranks[0].ready.vocab_size

    # ---- requests ---------------------------------------------------------------------------
    def least_loaded_rank(self) -> RankHandle:
        """Fewest unfinished requests; ties go round-robin (so an idle server spreads sequential work)."""
        n = len(self.ranks)
        rank = min(self.ranks, key=lambda r: (r.num_unfinished, (r.rank - self._next_rank) % n))
        self._next_rank = (rank.rank + 1) % n
        return rank

    def add_requests(self, requests: list[EngineCoreRequest]) -> int:
        """Send a group of engine requests (the samples of one parent) to one rank; returns it.

        The group stays together so the samples share prefix-cache blocks."""
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        rank = self.least_loaded_rank()
        for req in requests:
            self._req_rank[req.req_id] = rank
            rank.num_unfinished += 1
            rank.input_socket.send(self._encoder.encode(AddRequest(req)))
        return rank.rank

    def abort_requests(self, req_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for req_id in req_ids:
            rank = self._req_rank.pop(req_id, None)
            if rank is not None:
                rank.num_unfinished -= 1
                by_rank.setdefault(rank.rank, []).append(req_id)
        if self.dead_message is not None:
            return
        for r, ids in by_rank.items():
            self.ranks[r].input_socket.send(self._encoder.encode(AbortRequests(ids)))

    def mark_finished(self, req_id: str) -> None:
        """An engine request finished (or was rejected); it no longer loads its rank."""
        rank = self._req_rank.pop(req_id, None)
        if rank is not None:
            rank.num_unfinished -= 1

    async def recv(self) -> EngineMessage:
        return self._decoder.decode(await self._output_socket.recv())

    # ---- liveness and shutdown --------------------------------------------------------------
    def dead_rank(self) -> RankHandle | None:
        for r in self.ranks:
            if not r.process.is_alive():
                return r
        return None

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        for r in self.ranks:
            if r.process.is_alive():
                try:
                    r.input_socket.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            while r.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(2)
            if r.process.is_alive():
                r.process.kill()
                r.process.join(1)
        for r in self.ranks:
            r.input_socket.close()
        self._output_socket.close()
        self._ctx.term()
        for name in os.listdir(self._ipc_dir):
            try:
                os.unlink(os.path.join(self._ipc_dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._ipc_dir)
        except OSError:
            pass
