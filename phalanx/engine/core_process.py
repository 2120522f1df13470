"""The engine-core process: one `EngineCore` (one data-parallel rank) behind two ZMQ sockets.

Owns: the wire protocol between the API server and engine cores (the msgspec message structs
below; the request an `AddRequest` carries is ``engine.protocol.EngineCoreRequest``), the process
entry point `run_engine_core`, and the busy/idle loop that feeds requests into the engine and
streams its outputs back. Importing this module imports no torch (the API server imports it).
Does not own: scheduling or execution (``engine_core``), routing between ranks, process start-up
and death detection (``core_client``), anything text-level (engine cores see token ids only).

Wire protocol (msgpack via msgspec, never pickle). Per rank the client binds a PUSH socket that the
rank connects a PULL to (its *input*); all ranks PUSH into one PULL socket the client binds (the
*output*). Messages are tagged unions:

    client -> rank:  AddRequest(request) | AbortRequests(req_ids) | Shutdown()
                     Ping()   every HEARTBEAT_INTERVAL_S, to ranks on other nodes only
    rank -> client:  EngineReady(rank, ...)          once, after the model is loaded
                     EngineOutputs(rank, outputs, stats)   after each step that produced output, and
                                                           whenever scheduler stats changed (throttled)
                     RequestFailed(rank, req_id, message)  AddRequest rejected by the engine
                     EngineFailed(rank, message)           start-up or step error; the process exits(1)

Every rank -> client message also carries the rank's `generation`: 0 for the first process of a
rank, one more for each process that replaced a dead one (the API server respawns ranks,
docs/dp-protocol.md "Failure model and recovery"). The client drops messages of a generation it
has retired, so a dead process's last outputs, still queued in the socket, cannot reach requests
that were already replayed elsewhere.

The loop, once per iteration: poll the input socket (a short timeout when idle so shutdown, parent
death and new work are noticed quickly; no wait at all while requests are in flight), drain every
pending message, take one engine step if there is work, send outputs.

Lockstep ranks (MoE expert parallelism, or --dp-lockstep) run the same loop but replace "step if
there is work" by `EngineCore.step_lockstep`: every iteration, busy or idle, votes once and then
runs what the vote decided (a real step, a padded dummy step, or nothing). A Shutdown, or the loss
of the parent process, is voted too, so all ranks leave at the same iteration; a collective that
fails (dead peer, timeout) raises DPError, reported as EngineFailed before the process exits 1.
See docs/dp-protocol.md.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from phalanx.core.outputs import EngineCoreOutput, SchedulerStats
from phalanx.engine import fault_injection
from phalanx.engine.protocol import EngineCoreRequest

logger = logging.getLogger("phalanx.engine")

# ---- messages: client -> engine ------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """The head's heartbeat to ranks on other nodes (they cannot watch its process)."""


ClientMessage = AddRequest | AbortRequests | Shutdown | Ping

# ---- messages: engine -> client ------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    rank: int
    pid: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    lockstep: bool = False  # this rank runs the lockstep loop (MoE expert parallel, --dp-lockstep)
    generation: int = 0
    num_speculative_tokens: int = 0  # the most drafts per request and step (0: no speculative decoding)
    adaptive_speculation: bool = False  # the draft length is the adaptive policy's


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    rank: int
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    generation: int = 0


class RequestFailed(msgspec.Struct, tag="failed", array_like=True):
    rank: int
    req_id: str
    message: str
    generation: int = 0


class EngineFailed(msgspec.Struct, tag="dead", array_like=True):
    rank: int
    message: str
    generation: int = 0


EngineMessage = EngineReady | EngineOutputs | RequestFailed | EngineFailed


class EngineProcessConfig(msgspec.Struct):
    """What a rank needs at start-up; passed msgspec-encoded as the process argument."""

    engine_args: dict[str, Any]  # EngineArgs fields
    rank: int
    data_parallel_size: int
    input_address: str
    output_address: str
    log_level: str = "info"
    idle_poll_ms: int = 50
    stats_interval_s: float = 0.1
    num_threads: int | None = None
    # torch.distributed rendezvous of the DP group (lockstep only), e.g. tcp://127.0.0.1:29500
    dist_init_method: str | None = None
    # Ranks on another node than the API server (``--headless``) cannot watch its process: once the
    # head has been heard from, silence (no message, not even a Ping) this long means it is gone.
    head_timeout_s: float | None = None
    generation: int = 0  # which process of this rank this is (0 first, +1 per respawn)


HEARTBEAT_INTERVAL_S = 1.0  # the head pings remote ranks this often

STEP_DELAY_ENV = "PHALANX_DEBUG_STEP_DELAY_MS"


def step_delay_s(environ: dict[str, str] | os._Environ = os.environ) -> float:
    """Seconds to sleep after every forward step (``PHALANX_DEBUG_STEP_DELAY_MS``, default 0).

    A debugging / testing aid that makes a tiny model behave like a slow one, so that races between
    clients and generation (disconnects, aborts, engine deaths mid-request) can be reproduced
    deterministically instead of depending on how fast the machine happens to be."""
    raw = environ.get(STEP_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not 0.0 <= ms <= 60_000.0:  # also rejects nan
        raise ValueError(f"{STEP_DELAY_ENV}={raw!r}: expected a number of milliseconds in [0, 60000]")
    return ms / 1000.0


# ---- the process ---------------------------------------------------------------------------------


def run_engine_core(config_bytes: bytes) -> None:
    """Process entry point (multiprocessing spawn target). Exits non-zero on any error."""
    cfg = msgspec.msgpack.decode(config_bytes, type=EngineProcessConfig)
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(levelname)s %(asctime)s [engine rank {cfg.rank}] %(message)s"
    )
    # Ctrl-C goes to the whole process group: the API server decides when we stop (Shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    def on_term(*_: object) -> None:
        logger.warning("engine rank %d terminated by SIGTERM", cfg.rank)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(cfg.output_address)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(cfg.input_address)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        delay = step_delay_s()
        engine = _build_engine(cfg)
        kill_switch = fault_injection.arm(engine, cfg.rank, cfg.generation)
        frozen = freeze_start_up_heap()
        logger.info("engine rank %d: %d start-up objects frozen out of the collector's reach", cfg.rank, frozen)
    except Exception as e:  # noqa: BLE001 - start-up errors (bad path, bad config, OOM) are reported, not raised
        out_sock.send(encoder.encode(EngineFailed(cfg.rank, f"{type(e).__name__}: {e}", cfg.generation)))
        code = 1
    else:
        out_sock.send(
            encoder.encode(
                EngineReady(
                    cfg.rank,
                    os.getpid(),
                    engine.runner.num_blocks,
                    engine.max_model_len,
                    engine.cfg.model.vocab_size,
                    engine.lockstep,
                    cfg.generation,
                    engine.num_speculative_tokens,
                    engine.adaptive_speculation,
                )
            )
        )
        try:
            EngineCoreLoop(engine, cfg, in_sock, out_sock, step_delay=delay, kill_switch=kill_switch).run()
        except Exception as e:  # noqa: BLE001 - any step error kills this rank; the client must hear why
            logger.error("engine core failed:\n%s", traceback.format_exc())
            out_sock.send(encoder.encode(EngineFailed(cfg.rank, f"{type(e).__name__}: {e}", cfg.generation)))
            code = 1
        else:
            # The loop ended cleanly (a shutdown vote, a Shutdown, or a head gone silent): tear the
            # data-parallel group down before the interpreter does. Left to its finalisation, a
            # headless rank aborted once in a full test run ("terminate called without an active
            # exception", exit -6) after leaving the loop on the shutdown vote.
            if engine.group is not None:
                engine.group.close()
    in_sock.close()
    out_sock.close()
    ctx.term()
    sys.exit(code)


def freeze_start_up_heap() -> int:
    """Collect once, then move everything alive (torch's and numpy's modules, the model, the
    engine) out of the cyclic collector's reach for good (`gc.freeze`), as the API server does with
    its own: it lives as long as the process. Returns the objects frozen. Otherwise every full
    collection walks all of it and stalls the step loop meanwhile: the demo model with its EAGLE
    head leaves ~170,000-190,000 objects, ~75 ms a full collection (a whole decode step at 16
    requests takes ~2 ms). They come whenever enough objects outlived two younger collections:
    serving the demo's mixed workload at 16 requests, one in ~5 minutes (58 ms, every request in
    flight waiting it out); in one process with the detokenizer (`LLM`, offline) one in ~10-20 s,
    140-156 ms. Frozen, a full collection takes ~0.01 ms."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _build_engine(cfg: EngineProcessConfig):  # -> EngineCore (imported lazily: torch)
    import torch

    from phalanx.engine.args import EngineArgs
    from phalanx.engine.engine_core import EngineCore

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    logger.info("engine rank %d: %d torch thread(s)", cfg.rank, torch.get_num_threads())
    args = EngineArgs(**cfg.engine_args)
    config = args.create_engine_config()
    config = dataclasses.replace(
        config,
        parallel=dataclasses.replace(
            config.parallel, data_parallel_size=cfg.data_parallel_size, data_parallel_rank=cfg.rank
        ),
    )
    group = None
    if config.parallel.lockstep(config.model.is_moe):
        from phalanx.distributed.group import DPGroup

        if cfg.dist_init_method is None:
            raise ValueError("lockstep data parallelism needs dist_init_method")
        group = DPGroup(
            cfg.rank,
            cfg.data_parallel_size,
            cfg.dist_init_method,
            config.parallel.dp_timeout_s,
            config.parallel.check_collectives,
        )
    return EngineCore(config, group)


class EngineCoreLoop:
    """Busy/idle loop of one rank. `run` returns on Shutdown or when the parent process is gone."""

    def __init__(
        self,
        engine: Any,
        cfg: EngineProcessConfig,
        in_sock: zmq.Socket,
        out_sock: zmq.Socket,
        step_delay: float = 0.0,
        kill_switch: fault_injection.KillSwitch | None = None,
    ) -> None:
        self.engine = engine
        self.kill_switch = kill_switch  # PHALANX_DEBUG_KILL_AT (tests): dies at a chosen point
        self.cfg = cfg
        self.rank = cfg.rank
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.parent_pid = os.getppid()
        self.last_heard: float | None = None  # last message from the head (None: not yet)
        self.stats_dirty = True
        self.last_stats_time = 0.0
        self.step_delay_s = step_delay
        if self.step_delay_s:
            logger.warning("%s: every step sleeps %.0f ms (debugging aid)", STEP_DELAY_ENV, self.step_delay_s * 1e3)

    def run(self) -> None:
        if self.engine.lockstep:
            self._run_lockstep()
            return
        while True:
            busy = self.engine.has_unfinished_requests()
            if self.poller.poll(0 if busy else self.cfg.idle_poll_ms) and not self._drain_input():
                return
            if os.getppid() != self.parent_pid:  # orphaned: nobody reads our outputs any more
                logger.warning("the API server process is gone; engine rank %d exits", self.rank)
                return
            if self._head_silent():
                return
            outputs: list[EngineCoreOutput] = []
            if self.engine.has_unfinished_requests():
                if self.kill_switch is not None:
                    self.kill_switch.at_step()
                outputs = self.engine.step()
                self.stats_dirty = True
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
            self._send(outputs)

    def _run_lockstep(self) -> None:
        """Vote every iteration, idle or not (DESIGN §5 rule 6); leave when the vote says so."""
        poll_ms = min(self.cfg.idle_poll_ms, 10)  # idle ranks keep voting at this pace
        shutdown = False
        busy = False
        while True:
            busy = busy or self.engine.has_unfinished_requests()
            if self.poller.poll(0 if busy else poll_ms):
                if not self._drain_input():
                    logger.info("rank %d received Shutdown; voting to stop", self.rank)
                    shutdown = True
            elif os.getppid() != self.parent_pid:
                logger.warning("the parent process is gone; engine rank %d votes to stop", self.rank)
                shutdown = True
            elif self._head_silent():
                shutdown = True
            if self.kill_switch is not None:
                self.kill_switch.at_step()
            outputs, plan = self.engine.step_lockstep(shutdown=shutdown)
            if self.step_delay_s and plan.run_forward:
                time.sleep(self.step_delay_s)
            if outputs:
                self.stats_dirty = True
            self._send(outputs)
            if plan.shutdown:
                logger.info("rank %d leaves the lockstep loop at step %d (shutdown voted)", self.rank, plan.step)
                return
            busy = plan.run_forward  # others are busy: keep stepping without waiting

    def _head_silent(self) -> bool:
        """A remote rank's head went quiet for head_timeout_s (crashed, killed, network gone)."""
        limit = self.cfg.head_timeout_s
        if limit is None or self.last_heard is None or time.monotonic() - self.last_heard <= limit:
            return False
        logger.warning("the API server has been silent for %.0f s; engine rank %d stops", limit, self.rank)
        return True

    def _drain_input(self) -> bool:
        """Handle every pending message; False on Shutdown."""
        aborted: list[EngineCoreOutput] = []
        while True:
            try:
                raw = self.in_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.decoder.decode(raw)
            self.last_heard = time.monotonic()
            if isinstance(msg, Ping):
                continue
            self.stats_dirty = True
            if isinstance(msg, AddRequest):
                try:
                    self.engine.add_request(msg.request)
                except ValueError as e:
                    self.out_sock.send(
                        self.encoder.encode(RequestFailed(self.rank, msg.request.req_id, str(e), self.cfg.generation))
                    )
            elif isinstance(msg, AbortRequests):
                aborted.extend(self.engine.abort_requests(msg.req_ids))
            else:
                return False
        if aborted:
            self._send(aborted)
        return True

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        """Send outputs, with scheduler stats when they changed (at most every stats_interval_s while
        busy; always once the engine goes idle, so the client sees the final zero-usage state)."""
        stats = None
        now = time.monotonic()
        if self.stats_dirty and (
            now - self.last_stats_time >= self.cfg.stats_interval_s
            or not self.engine.has_unfinished_requests()
        ):
            stats = self.engine.stats()
            self.stats_dirty = False
            self.last_stats_time = now
        if outputs or stats is not None:
            self.out_sock.send(self.encoder.encode(EngineOutputs(self.rank, outputs, stats, self.cfg.generation)))
