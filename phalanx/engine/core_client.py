"""The API server's handle on its engine-core processes: start, route, abort, watch, replace, stop.

Owns: spawning one engine-core process per data-parallel rank (``multiprocessing`` spawn context),
the ZMQ sockets to them (asyncio), the start-up handshake (every rank reports `EngineReady` or a
clear `EngineFailed` message), routing each request to the least-loaded serving rank (unfinished
engine requests routed there: running + waiting, as the client sees them), holding requests while
no rank serves (`pending`, each with a deadline), noticing a dead rank, and the mechanics of
recovery: retiring a dead rank (its process reaped, its input socket closed, its generation
retired so that its late messages are dropped, its requests handed back), starting a replacement
process, and re-forming a lockstep group (every rank restarted on a fresh rendezvous port).
Does not own: the message formats or the engine loop (``core_process``), when to restart and how
often (``recovery``, ``entrypoints.async_llm``), text, request state and streaming
(``entrypoints.async_llm``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
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
from phalanx.engine.protocol import EngineCoreRequest
from phalanx.engine.recovery import RankState
from phalanx.net import free_listen_ports

logger = logging.getLogger("phalanx.engine")


class EngineStartupError(RuntimeError):
    """An engine-core rank could not start (bad model path, bad config, crash while loading)."""


class EngineDeadError(RuntimeError):
    """An engine-core rank died or failed while serving, and the server cannot go on (fail-fast)."""


class EngineUnavailableError(EngineDeadError):
    """No engine rank could take a request within the recovery timeout (ranks restarting)."""


@dataclass
class RankHandle:
    rank: int
    process: Any  # multiprocessing.Process (spawn context); None for a rank on another node
    input_socket: zmq.asyncio.Socket
    ready: EngineReady | None = None
    num_unfinished: int = 0  # engine requests routed here and not finished yet
    state: RankState = RankState.STARTING
    generation: int = 0  # the generation of the current (or last) process; older ones are retired
    started_at: float = field(default_factory=time.monotonic)  # when the current process was spawned

    @property
    def exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode


@dataclass
class _Pending:
    """A group of engine requests (the samples of one parent) waiting for a serving rank."""

    requests: list[EngineCoreRequest]
    deadline: float


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
    # The model's compute per token (ModelConfig.active_parameters), which decides whether the
    # front end keeps a core of its own (front_end_cores); None: it does.
    model_active_params: int | None = None


@dataclass
class RankAddresses:
    output: str
    inputs: list[str]
    dist_init_method: str


def rank_addresses(dp: int, address: str | None, rpc_port: int | None, ipc_dir: str) -> RankAddresses:
    if address is None:
        return RankAddresses(
            f"ipc://{ipc_dir}/output", [f"ipc://{ipc_dir}/input-{r}" for r in range(dp)], f"tcp://127.0.0.1:{free_listen_ports(1)}"
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


def _run_when_configured(conn: Any) -> None:
    """A prestarted rank's entry point: import torch and the engine (most of a rank's fixed start-up
    cost, ~4 s of a 2-core CPU) while the API process is still loading the tokenizer, then run with
    the configuration it sends. A closed pipe without one (start-up cancelled, API process gone):
    exit quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as run_engine_core: the API process decides
    import torch  # noqa: F401

    import phalanx.engine.engine_core  # noqa: F401

    try:
        config_bytes = conn.recv_bytes()
    except (EOFError, OSError):
        return
    finally:
        conn.close()
    run_engine_core(config_bytes)


class PrestartedRank:
    """An engine process started before its configuration exists (see `_run_when_configured`):
    `launch` hands it the configuration and returns the process, as `spawn_rank` would; `cancel`
    lets it exit. Only a rank's first start is prestarted; restarts use `spawn_rank`."""

    def __init__(self, rank: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        reader, self._writer = ctx.Pipe(duplex=False)
        self.rank = rank
        self.process = ctx.Process(target=_run_when_configured, args=(reader,), name=f"phalanx-engine-{rank}",
                                   daemon=True)
        self.process.start()
        reader.close()

    def launch(self, proc_cfg: EngineProcessConfig) -> Any:
        if proc_cfg.rank != self.rank:
            raise ValueError(f"prestarted rank {self.rank} cannot run rank {proc_cfg.rank}")
        try:
            self._writer.send_bytes(msgspec.msgpack.encode(proc_cfg))
        except OSError:  # it died before its configuration came (e.g. a broken import): start afresh
            self.cancel()
            return spawn_rank(proc_cfg)
        finally:
            self._writer.close()
        return self.process

    def cancel(self) -> None:
        """End it now: it holds nothing yet (mid-import it is simply terminated)."""
        self._writer.close()
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def local_ranks(dp: int, size_local: int | None, start_rank: int) -> range:
    """The ranks this node runs: [start_rank, start_rank + size_local), all of them by default."""
    return range(start_rank, start_rank + (size_local or dp))


def prestart_ranks(ranks: range) -> dict[int, PrestartedRank]:
    return {r: PrestartedRank(r) for r in ranks}


def cancel_prestarted(prestarted: dict[int, PrestartedRank]) -> None:
    for p in prestarted.values():
        p.cancel()
    prestarted.clear()


FRONT_END_CORES = 1  # cores a node running the API server keeps free of engine threads, when it does
# Below this compute per token, a step is so short that the front end's per-token work (HTTP,
# detokenization, streaming) competes with the engine for the step's critical path.
SMALL_MODEL_PARAMS = 32_000_000


def front_end_cores(active_params: int | None, cores: int) -> int:
    """Cores the API server keeps free of engine threads on a node with `cores` usable cores.

    On 4 or more cores it keeps one, as vLLM's CPU backend does (it costs the engine at most a
    quarter of the machine). On 2 or 3 it keeps one only for a small model: measured on 2 cores
    (docs/benchmarks.md, "Engine threads"), the 4.7M demo serves 1.3-1.5x faster with the engine on
    one thread and the front end on the other, while SmolLM2-135M loses 1.2-1.5x that way (its steps
    are long; the front end's work fits in their gaps). `--num-threads` overrides."""
    if cores >= 4:
        return FRONT_END_CORES
    return FRONT_END_CORES if active_params is None or active_params < SMALL_MODEL_PARAMS else 0


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

    def __init__(self, config: EngineClientConfig, prestarted: dict[int, PrestartedRank] | None = None) -> None:
        """`prestarted`: local ranks already importing (`prestart_ranks`); their first start uses them."""
        self.config = config
        self._prestarted = prestarted if prestarted is not None else {}
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
        self._pending: deque[_Pending] = deque()
        self._threads = 1
        self.lockstep = False  # the ranks run the lockstep loop (known once they are ready)
        self._first_ready: EngineReady | None = None

    # ---- start-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn every rank and wait until all report ready. Raises EngineStartupError otherwise."""
        cfg = self.config
        dp = cfg.data_parallel_size
        local = local_ranks(dp, cfg.data_parallel_size_local, cfg.data_parallel_start_rank)
        reserved = front_end_cores(cfg.model_active_params, usable_cores())
        self._threads = local_threads(len(local), cfg.num_threads, reserved)
        for rank in range(dp):
            address = self._addresses.inputs[rank]
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            proc = self._spawn(rank, address, 0) if rank in local else None
            self.ranks.append(RankHandle(rank, proc, sock))
        cancel_prestarted(self._prestarted)  # any the caller prestarted for a rank not local here
        if len(local) < dp:
            logger.info("waiting for %d remote engine rank(s) to connect", dp - len(local))
        await self._wait_ready()
        self.lockstep = any(r.ready is not None and r.ready.lockstep for r in self.ranks)
        if len(local) < dp:
            self._heartbeat = asyncio.create_task(self._ping_remote_ranks())

    def _spawn(self, rank: int, input_address: str, generation: int) -> Any:
        cfg = self.config
        prestarted = self._prestarted.pop(rank, None) if generation == 0 else None
        return (spawn_rank if prestarted is None else prestarted.launch)(
            EngineProcessConfig(
                engine_args=dataclasses.asdict(cfg.engine_args),
                rank=rank,
                data_parallel_size=cfg.data_parallel_size,
                input_address=input_address,
                output_address=self._output_address,
                log_level=cfg.log_level,
                num_threads=self._threads,
                dist_init_method=self._addresses.dist_init_method,
                generation=generation,
            )
        )

    @property
    def has_remote_ranks(self) -> bool:
        """Some ranks run on other nodes (``--headless``): this process cannot restart them."""
        return any(r.process is None for r in self.ranks)

    async def _ping_remote_ranks(self) -> None:
        """Remote ranks cannot watch this process; they stop when these pings stop."""
        ping = self._encoder.encode(Ping())
        while True:
            for r in self.ranks:
                if r.process is None:
                    # A queue full of pings: the rank is gone or stuck; its peers notice.
                    _send_nowait(r.input_socket, ping)
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
                    self._on_ready(msg)
                elif isinstance(msg, EngineFailed):
                    raise EngineStartupError(f"engine rank {msg.rank} failed to start: {msg.message}")
                continue
            dead = self.newly_dead()
            if dead:
                raise EngineStartupError(
                    f"engine rank {dead[0].rank} exited during start-up with code {dead[0].exitcode}"
                )

    def _on_ready(self, msg: EngineReady) -> None:
        if self._first_ready is None:
            self._first_ready = msg
        r = self.ranks[msg.rank]
        r.ready = msg
        r.state = RankState.READY
        took = time.monotonic() - r.started_at  # process start to ready: the model's load time
        again = f" again after {took:.1f} s (generation {msg.generation})" if msg.generation else f" in {took:.1f} s"
        logger.info("engine rank %d ready (pid %d, %d KV blocks)%s", msg.rank, msg.pid, msg.num_kv_blocks, again)

    @property
    def max_model_len(self) -> int:
        """Every rank loads the same model: the first ready report holds for all of them, also while
        rank 0 restarts."""
        assert self._first_ready is not None, "no engine rank has started yet"
        return self._first_ready.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self._first_ready is not None, "no engine rank has started yet"
        return self._first_ready.vocab_size

    @property
    def num_speculative_tokens(self) -> int:
        """The engine's speculative k (0: none), the same on every rank."""
        assert self._first_ready is not None, "no engine rank has started yet"
        return self._first_ready.num_speculative_tokens

    @property
    def adaptive_speculation(self) -> bool:
        """Whether the engine's draft length is the adaptive policy's, the same on every rank."""
        assert self._first_ready is not None, "no engine rank has started yet"
        return self._first_ready.adaptive_speculation

    # ---- requests ---------------------------------------------------------------------------
    def serving_ranks(self) -> list[RankHandle]:
        """Ranks that take requests now: the ready ones; lockstep ranks only all together (a
        lockstep group serves only when every rank is in it)."""
        ready = [r for r in self.ranks if r.state is RankState.READY]
        if self.lockstep and len(ready) < len(self.ranks):
            return []
        return ready

    @property
    def serving(self) -> bool:
        return self.dead_message is None and bool(self.serving_ranks())

    def least_loaded_rank(self, ranks: list[RankHandle] | None = None) -> RankHandle:
        """Fewest unfinished requests; ties go round-robin (so an idle server spreads sequential work)."""
        ranks = self.serving_ranks() if ranks is None else ranks
        n = len(self.ranks)
        rank = min(ranks, key=lambda r: (r.num_unfinished, (r.rank - self._next_rank) % n))
        self._next_rank = (rank.rank + 1) % n
        return rank

    def add_requests(self, requests: list[EngineCoreRequest], timeout_s: float | None = None) -> int | None:
        """Send a group of engine requests (the samples of one parent) to one rank; returns it. With
        no serving rank (all restarting) and a `timeout_s`, the group waits in `pending` (None is
        returned) until a rank is ready or `expire_pending` gives it up.

        The group stays together so the samples share prefix-cache blocks."""
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        serving = self.serving_ranks()
        if not serving:
            if timeout_s is None:
                raise EngineUnavailableError("no engine rank is serving")
            self._pending.append(_Pending(list(requests), time.monotonic() + timeout_s))
            return None
        rank = self.least_loaded_rank(serving)
        for req in requests:
            self._req_rank[req.req_id] = rank
            rank.num_unfinished += 1
            rank.input_socket.send(self._encoder.encode(AddRequest(req)))
        return rank.rank

    @property
    def num_pending(self) -> int:
        return sum(len(p.requests) for p in self._pending)

    def flush_pending(self) -> int:
        """Route the waiting groups, oldest first, once a rank serves; returns how many requests went."""
        sent = 0
        while self._pending and self.serving_ranks():
            group = self._pending.popleft()
            self.add_requests(group.requests)
            sent += len(group.requests)
        return sent

    def expire_pending(self, now: float) -> list[str]:
        """Drop the groups whose deadline passed; returns their engine request ids."""
        expired: list[str] = []
        keep: deque[_Pending] = deque()
        for group in self._pending:
            if group.deadline <= now:
                expired.extend(r.req_id for r in group.requests)
            else:
                keep.append(group)
        self._pending = keep
        return expired

    def abort_requests(self, req_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        ids = set(req_ids)
        if self._pending:
            for group in self._pending:
                group.requests = [r for r in group.requests if r.req_id not in ids]
            self._pending = deque(g for g in self._pending if g.requests)
        for req_id in req_ids:
            rank = self._req_rank.pop(req_id, None)
            if rank is not None:
                rank.num_unfinished -= 1
                by_rank.setdefault(rank.rank, []).append(req_id)
        if self.dead_message is not None:
            return
        for r, rids in by_rank.items():
            self.ranks[r].input_socket.send(self._encoder.encode(AbortRequests(rids)))

    def mark_finished(self, req_id: str) -> None:
        """An engine request finished (or was rejected); it no longer loads its rank."""
        rank = self._req_rank.pop(req_id, None)
        if rank is not None:
            rank.num_unfinished -= 1

    async def recv(self) -> EngineMessage:
        """The next message from a rank's current process. Messages of retired generations (a dead
        process's outputs still queued in the socket) are dropped here; an EngineReady marks its
        rank ready before it is returned."""
        while True:
            msg = self._decoder.decode(await self._output_socket.recv())
            r = self.ranks[msg.rank]
            if msg.generation != r.generation or r.state in (RankState.DEAD, RankState.GIVEN_UP):
                continue
            if isinstance(msg, EngineReady):
                self._on_ready(msg)
            return msg

    # ---- liveness and recovery --------------------------------------------------------------
    def newly_dead(self) -> list[RankHandle]:
        """Local ranks whose current process is gone, not yet retired (remote ranks report
        EngineFailed themselves, and a lockstep peer of a vanished remote rank fails its next
        collective)."""
        return [
            r
            for r in self.ranks
            if r.process is not None
            and r.state in (RankState.STARTING, RankState.READY, RankState.RESPAWNING)
            and not r.process.is_alive()
        ]

    def overdue(self, now: float) -> list[RankHandle]:
        """Replacement processes that did not report ready within the start-up timeout."""
        limit = self.config.startup_timeout_s
        return [r for r in self.ranks if r.state is RankState.RESPAWNING and now - r.started_at > limit]

    def retire(self, rank: int, state: RankState = RankState.DEAD) -> list[str]:
        """Take a dead (or failed) rank out of service: its process killed if still running and
        reaped, its input socket closed (whatever was queued for it is dropped), its generation
        retired (late messages from it are ignored), and the ids of the engine requests it held
        returned for replay."""
        r = self.ranks[rank]
        r.state = state
        r.ready = None
        if r.process is not None:
            if r.process.is_alive():
                r.process.kill()  # ours; e.g. a lockstep survivor whose group is broken
            r.process.join(5)
        r.input_socket.close(linger=0)
        held = [req_id for req_id, h in self._req_rank.items() if h is r]
        for req_id in held:
            del self._req_rank[req_id]
        r.num_unfinished = 0
        return held

    def give_up(self, rank: int) -> None:
        self.ranks[rank].state = RankState.GIVEN_UP

    def respawn(self, rank: int) -> None:
        """Start a replacement process for a retired local rank (next generation, new input socket).
        Lockstep ranks are restarted all together instead (`reform`)."""
        r = self.ranks[rank]
        assert r.state is RankState.DEAD and r.process is not None, f"rank {rank} is {r.state.value}"
        r.generation += 1
        address = f"ipc://{self._ipc_dir}/input-{rank}-g{r.generation}"
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        r.input_socket = sock
        r.started_at = time.monotonic()
        r.process = self._spawn(rank, address, r.generation)
        r.state = RankState.RESPAWNING
        logger.info("engine rank %d: replacement process started (pid %d, generation %d)", rank, r.process.pid,
                    r.generation)

    def reform(self) -> None:
        """Re-form a lockstep group: every rank restarted (fresh processes, a fresh torch.distributed
        group on a new rendezvous port), so the new group starts from a clean state everywhere."""
        for r in self.ranks:
            if r.state is not RankState.DEAD:
                self.retire(r.rank)
        self._addresses = dataclasses.replace(self._addresses, dist_init_method=f"tcp://127.0.0.1:{free_listen_ports(1)}")
        logger.info("re-forming the lockstep group of %d ranks at %s", len(self.ranks), self._addresses.dist_init_method)
        for r in self.ranks:
            self.respawn(r.rank)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every rank (also after a failed `start`: the ranks it spawned, and the prestarted
        ones it never reached)."""
        logger.info("shutting down %d engine rank(s)", len(self.ranks))
        cancel_prestarted(self._prestarted)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        live = [r for r in self.ranks if r.state not in (RankState.DEAD, RankState.GIVEN_UP)]
        for r in live:
            if r.state is RankState.RESPAWNING and r.process.is_alive():
                r.process.terminate()  # still loading, holds no work (and may not be connected yet)
            elif r.process is None or r.process.is_alive():
                _send_nowait(r.input_socket, self._encoder.encode(Shutdown()))
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
        for r in live:
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


def _send_nowait(sock: zmq.asyncio.Socket, data: bytes) -> None:
    """Send without waiting; a message that cannot go now (no peer connected yet, queue full) is
    dropped. (zmq.asyncio reports that through the returned future, which is consumed here.)"""
    try:
        future = sock.send(data, zmq.NOBLOCK)
    except zmq.ZMQError:
        return
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


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
