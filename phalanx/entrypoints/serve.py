"""`phalanx serve`: validate the configuration, start the engine ranks, run uvicorn, clean up.

Owns: the server's lifecycle and exit code -- 0 after a normal shutdown (Ctrl-C / SIGTERM), 1 when
an engine rank fails to start, or dies while serving and cannot be recovered from (recovery off
with `--no-recover`, ranks on other nodes, or every rank past its restart budget: in-flight
requests then get a 5xx, `/health` turns 503 and uvicorn is told to exit), 2 for a bad
configuration found before anything starts. A rank that dies while recovery is on is replaced and
its requests replayed (``entrypoints.async_llm``); the server keeps serving.
Does not own: command-line parsing (``cli``), routes (``openai.server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from phalanx.checkpoint import resolve_model_path
from phalanx.config import EngineConfig
from phalanx.engine.args import EngineArgs
from phalanx.engine.core_client import (
    EngineClientConfig,
    EngineCoreClient,
    EngineStartupError,
    cancel_prestarted,
    local_ranks,
    prestart_ranks,
)
from phalanx.engine.metrics import ServingMetrics
from phalanx.engine.recovery import RecoveryConfig
from phalanx.engine.tokenizer import eos_token_ids_of, load_tokenizer
from phalanx.entrypoints.async_llm import AsyncLLM
from phalanx.entrypoints.openai.server import build_app, make_state
from phalanx.net import ephemeral_port_range

logger = logging.getLogger("phalanx.server")


DEAD_EXIT_DELAY_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT / SIGTERM after its graceful shutdown; that
    KeyboardInterrupt would cancel our own clean-up (the engine ranks' Shutdown, which lockstep
    ranks must vote on together). Capture the signals without re-raising them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class ConfigError(ValueError):
    """A configuration problem found before any process starts (exit code 2)."""


@dataclass
class ServeConfig:
    engine_args: EngineArgs
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    log_stats_interval: float = 10.0
    startup_timeout: float = 600.0
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    headless: bool = False
    num_threads: int | None = None
    tokenizer: str | None = None  # tokenizer checkpoint (default: the model's own)
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)


def with_tokenizer(cfg: ServeConfig) -> tuple[EngineArgs, Any]:
    """The engine arguments with the model resolved to its local path (so every rank loads the same
    files) and the tokenizer's end-of-sequence ids merged in, and the tokenizer itself (loaded
    without torch: this process never imports it)."""
    args = cfg.engine_args
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(cfg.tokenizer or model_path, torch_free=True)
    args = dataclasses.replace(args, model=model_path, extra_eos_token_ids=tuple(eos_token_ids_of(tokenizer)))
    return args, tokenizer


def check_config(cfg: ServeConfig) -> EngineConfig:
    """Build the engine config once here so bad paths / values fail fast with their own message
    (with the dtype as a name: this process never imports torch); returns it."""
    try:
        engine_config = cfg.engine_args.create_engine_config(resolve_dtype=False)
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ConfigError(str(e)) from e
    dp = cfg.engine_args.data_parallel_size
    local = cfg.data_parallel_size_local if cfg.data_parallel_size_local is not None else dp
    if not 1 <= local <= dp or not 0 <= cfg.data_parallel_start_rank <= dp - local:
        raise ConfigError(
            f"data-parallel ranks [{cfg.data_parallel_start_rank}, {cfg.data_parallel_start_rank + local}) "
            f"do not fit in -dp {dp}"
        )
    if local < dp and (cfg.data_parallel_address is None or cfg.data_parallel_rpc_port is None):
        raise ConfigError(
            "a multi-node deployment (--data-parallel-size-local < -dp) needs --data-parallel-address and "
            "--data-parallel-rpc-port"
        )
    if cfg.data_parallel_rpc_port is not None:
        top = cfg.data_parallel_rpc_port + 1 + dp
        if cfg.data_parallel_rpc_port < 1 or top > 65535:
            raise ConfigError(
                f"--data-parallel-rpc-port {cfg.data_parallel_rpc_port} with -dp {dp} uses ports "
                f"{cfg.data_parallel_rpc_port}..{top}; they must lie in 1..65535"
            )
        low, high = ephemeral_port_range()
        if cfg.data_parallel_rpc_port <= high and top >= low:
            logger.warning(
                "--data-parallel-rpc-port %d..%d overlaps the ephemeral port range %d..%d: a remote rank that "
                "connects before the head binds can take one of these ports as its own source port; "
                "prefer a port below %d", cfg.data_parallel_rpc_port, top, low, high, low,
            )
    if cfg.num_threads is not None and cfg.num_threads < 1:
        raise ConfigError(f"--num-threads must be >= 1, got {cfg.num_threads}")
    if cfg.headless and local == dp:
        raise ConfigError("--headless runs some of the ranks for a head node elsewhere: set --data-parallel-size-local")
    return engine_config


async def serve(cfg: ServeConfig, engine_config: EngineConfig) -> int:
    """`engine_config`: `check_config`'s (the model's size sets the engines' default threads)."""
    logging.getLogger("phalanx").setLevel(cfg.log_level.upper())
    # The local ranks start importing torch and the engine now, while this process loads the
    # tokenizer (whose end-of-sequence ids complete the engine arguments): the two overlap.
    prestarted = prestart_ranks(local_ranks(cfg.engine_args.data_parallel_size, cfg.data_parallel_size_local,
                                            cfg.data_parallel_start_rank))
    try:
        args, tokenizer = with_tokenizer(cfg)
        client = EngineCoreClient(
            EngineClientConfig(
                engine_args=args,
                data_parallel_size=args.data_parallel_size,
                log_level=cfg.log_level,
                startup_timeout_s=cfg.startup_timeout,
                data_parallel_size_local=cfg.data_parallel_size_local,
                data_parallel_start_rank=cfg.data_parallel_start_rank,
                data_parallel_address=cfg.data_parallel_address,
                data_parallel_rpc_port=cfg.data_parallel_rpc_port,
                num_threads=cfg.num_threads,
                model_active_params=engine_config.model.active_parameters(),
            ),
            prestarted,
        )
    except BaseException:  # the tokenizer cannot load, the output address cannot be bound, ...
        cancel_prestarted(prestarted)
        raise
    model_path = args.model
    try:
        await client.start()
    except EngineStartupError as e:
        logger.error("%s", e)
        await client.shutdown()
        return 1
    except BaseException:  # e.g. a rank's input address cannot be bound: no rank may outlive this
        await client.shutdown()
        raise
    metrics = ServingMetrics(cfg.served_model_name)
    exit_code = 0
    server: uvicorn.Server | None = None

    def on_dead(message: str) -> None:
        nonlocal exit_code
        exit_code = 1

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        # A short grace period: in-flight requests get their 5xx and health checks see 503 first.
        asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY_S, stop)

    engine = AsyncLLM(client, tokenizer, metrics, on_dead=on_dead, recovery=cfg.recovery)
    app = build_app(make_state(engine, tokenizer, metrics, cfg.served_model_name, model_path, cfg.api_key))
    server = _Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=cfg.log_level,
            access_log=cfg.log_level == "debug",
            timeout_graceful_shutdown=3,
            timeout_keep_alive=5,
        )
    )
    engine.start(cfg.log_stats_interval)
    # Everything allocated so far (FastAPI, pydantic models, the tokenizer) lives as long as the
    # server: keep it out of the collector's way, as vLLM does. Full collections that walk it cost
    # the API process 10-15 % of its CPU time while streaming (256 chat requests at concurrency
    # 16 on the demo model: 0.85-0.96 CPU-s frozen, 0.99-1.16 not).
    gc.collect()
    gc.freeze()
    logger.info(
        "serving %r (%s) on http://%s:%d with %d engine rank(s)",
        cfg.served_model_name,
        model_path,
        cfg.host,
        cfg.port,
        len(client.ranks),
    )
    try:
        await server.serve()
        if not server.started and exit_code == 0:
            exit_code = 1  # e.g. the port was taken
    finally:
        await engine.stop()
        await client.shutdown()
    if exit_code:
        logger.error("exiting with code %d: %s", exit_code, engine.dead_message or "server failed")
    return exit_code


def run(cfg: ServeConfig) -> int:
    engine_config = check_config(cfg)
    if cfg.headless:
        from phalanx.engine.core_client import run_headless

        args, _ = with_tokenizer(cfg)
        assert cfg.data_parallel_size_local is not None and cfg.data_parallel_address is not None
        assert cfg.data_parallel_rpc_port is not None
        return run_headless(
            args,
            args.data_parallel_size,
            cfg.data_parallel_size_local,
            cfg.data_parallel_start_rank,
            cfg.data_parallel_address,
            cfg.data_parallel_rpc_port,
            cfg.log_level,
            cfg.num_threads,
        )
    try:
        return asyncio.run(serve(cfg, engine_config))
    except KeyboardInterrupt:
        return 0


def engine_args_from(**kwargs: object) -> EngineArgs:
    """EngineArgs from flag values; unknown engine options are a ConfigError, never dropped."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in kwargs if k not in names)
    if unknown:
        raise ConfigError(f"the engine does not support {', '.join(unknown)} yet")
    return EngineArgs(**kwargs)  # type: ignore[arg-type]
