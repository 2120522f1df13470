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
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from phalanx.engine.core_process import (
    HEARTBEAT_INTERVAL_S,
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineMessage,
    EngineProcessConfig,
    EngineReady,
    Ping,
    Shutdown,
    run_engine_core,
)
from phalanx.engine.engine_core import EngineCoreRequest
from phalanx.net import free_port

logger = logging.getLogger("phalanx.engine")


class EngineStartupError(RuntimeError):
    """An engine-core rank could not start (bad model path, bad config, crash while loading)."""


class EngineDeadError(RuntimeError):
    """An engine-core rank died or failed while serving."""


@dataclass
class RankHandle:
    rank: int
    process: Any  # multiprocessing.Process (spawn context); None for a rank on another node
    input_socket: zmq.asyncio.Socket
    ready: EngineReady | None = None
    num_unfinished: int = 0  # engine requests routed here and not finished yet


@dataclass
class EngineClientConfig:
    engine_args: Any  # EngineArgs
    data_parallel_size: int = 1
    log_level: str = "info"
    startup_timeout_s: float = 600.0
    # Multi-node: this node runs ranks [start_rank, start_rank + size_local); the others connect
    # from `phalanx serve --headless` nodes to `address`, on ports rpc_port (outputs),
    # rpc_port + 1 + r (rank r's input) and rpc_port + 1 + dp (the DP group's rendezvous).
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    num_threads: int | None = None  # torch threads per rank (default: local_threads)


@dataclass
class RankAddresses:
    output: str
    inputs: list[str]
    dist_init_method: str


def rank_addresses(dp: int, address: str | None, rpc_port: int | None, ipc_dir: str) -> RankAddresses:
    if address is None:
        return RankAddresses(
            f"ipc://{ipc_dir}/output", [f"ipc://{ipc_dir}/input-{r}" for r in range(dp)], f"tcp://127.0.0.1:{free_port()}"
        )
    if rpc_port is None:
        raise ValueError("--data-parallel-address needs --data-parallel-rpc-port")
    return RankAddresses(
        f"tcp://{address}:{rpc_port}",
        [f"tcp://{address}:{rpc_port + 1 + r}" for r in range(dp)],
        f"tcp://{address}:{rpc_port + 1 + dp}",
    )


def spawn_rank(proc_cfg: EngineProcessConfig) -> Any:
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        args=(msgspec.msgpack.encode(proc_cfg),),
        name=f"phalanx-engine-{proc_cfg.rank}",
        daemon=True,
    )
    proc.start()
    return proc


FRONT_END_CORES = 1  # cores a node running the API server keeps free of engine threads


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_threads(num_local: int, requested: int | None = None, reserved: int = FRONT_END_CORES) -> int:
    """torch threads per rank: as requested, else the node's usable cores less `reserved`, split
    between its ranks (at least one each).

    A node that runs the API server reserves one core for it (HTTP, tokenization, detokenization,
    streaming) as vLLM's CPU backend does: engine threads that share every core with the front end
    stall each other at every OpenMP barrier (measured on 2 cores, demo model, `bench serve` chat:
    2 engine threads 876 / 2206 output tok/s at concurrency 1 / 16, 1 thread 1328 / 2889).
    ``phalanx serve --headless`` nodes run no front end and reserve nothing."""
    if requested is not None:
        return requested
    return max(1, (usable_cores() - reserved) // num_local)


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
        self._addresses = rank_addresses(
            config.data_parallel_size, config.data_parallel_address, config.data_parallel_rpc_port, self._ipc_dir
        )
        self._output_socket = self._ctx.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.LINGER, 0)
        self._output_address = self._addresses.output
        self._output_socket.bind(self._output_address)
        self.dead_message: str | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    # ---- start-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn every rank and wait until all report ready. Raises EngineStartupError otherwise."""
        cfg = self.config
        dp = cfg.data_parallel_size
        local = range(cfg.data_parallel_start_rank, cfg.data_parallel_start_rank + (cfg.data_parallel_size_local or dp))
        threads = local_threads(len(local), cfg.num_threads)
        engine_args = dataclasses.asdict(cfg.engine_args)
        for rank in range(dp):
            address = self._addresses.inputs[rank]
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            proc = None
            if rank in local:
                proc = spawn_rank(
                    EngineProcessConfig(
                        engine_args=engine_args,
                        rank=rank,
                        data_parallel_size=dp,
                        input_address=address,
                        output_address=self._output_address,
                        log_level=cfg.log_level,
                        num_threads=threads,
                        dist_init_method=self._addresses.dist_init_method,
                    )
                )
            self.ranks.append(RankHandle(rank, proc, sock))
        if len(local) < dp:
            logger.info("waiting for %d remote engine rank(s) to connect", dp - len(local))
        await self._wait_ready()
        if len(local) < dp:
            self._heartbeat = asyncio.create_task(self._ping_remote_ranks())

    async def _ping_remote_ranks(self) -> None:
        """Remote ranks cannot watch this process; they stop when these pings stop."""
        ping = self._encoder.encode(Ping())
        while True:
            for r in self.ranks:
                if r.process is None:
                    try:
                        r.input_socket.send(ping, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # a queue full of pings: the rank is gone or stuck; its peers notice
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

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
        """A local rank whose process is gone (remote ranks report EngineFailed themselves, and a
        lockstep peer of a vanished remote rank fails its next collective)."""
        for r in self.ranks:
            if r.process is not None and not r.process.is_alive():
                return r
        return None

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        logger.info("shutting down %d engine rank(s)", len(self.ranks))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for r in self.ranks:
            if r.process is None or r.process.is_alive():
                try:
                    r.input_socket.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            if r.process is None:
                continue
            while r.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(2)
            if r.process.is_alive():
                r.process.kill()
                r.process.join(1)
        if any(r.process is None for r in self.ranks):
            await asyncio.sleep(0.2)  # let Shutdown reach remote ranks before the sockets close
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


def run_headless(
    engine_args: Any,
    data_parallel_size: int,
    size_local: int,
    start_rank: int,
    address: str,
    rpc_port: int,
    log_level: str = "info",
    num_threads: int | None = None,
) -> int:
    """`phalanx serve --headless`: run this node's ranks, connected to the head's API server.
    Returns 0 when all ranks stopped cleanly, 1 if any failed."""
    addresses = rank_addresses(data_parallel_size, address, rpc_port, "")
    threads = local_threads(size_local, num_threads, reserved=0)
    procs = []
    for rank in range(start_rank, start_rank + size_local):
        procs.append(
            spawn_rank(
                EngineProcessConfig(
                    engine_args=dataclasses.asdict(engine_args),
                    rank=rank,
                    data_parallel_size=data_parallel_size,
                    input_address=addresses.inputs[rank],
                    output_address=addresses.output,
                    log_level=log_level,
                    num_threads=threads,
                    dist_init_method=addresses.dist_init_method,
                    head_timeout_s=max(engine_args.dp_timeout, 5 * HEARTBEAT_INTERVAL_S),
                )
            )
        )
    logger.info("headless node: ranks %d..%d connect to %s", start_rank, start_rank + size_local - 1, address)
    code = 0
    try:
        while procs:
            for p in list(procs):
                p.join(0.2)
                if p.exitcode is not None:
                    procs.remove(p)
                    if p.exitcode != 0:
                        logger.error("engine %s exited with code %s; stopping this node", p.name, p.exitcode)
                        code = 1
            if code:
                break
    except KeyboardInterrupt:
        pass
    for p in procs:
        p.terminate()
        p.join(3)
        if p.is_alive():
            p.kill()
    return code
