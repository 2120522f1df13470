"""`phalanx serve`: validate the configuration, start the engine ranks, run uvicorn, clean up.

Owns: the server's lifecycle and exit code -- 0 after a normal shutdown (Ctrl-C / SIGTERM), 1 when
an engine rank fails to start or dies while serving (in-flight requests then get a 5xx, `/health`
turns 503 and uvicorn is told to exit), 2 for a bad configuration found before anything starts.
Does not own: command-line parsing (``cli``), routes (``openai.server``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

import uvicorn

from phalanx.engine.args import EngineArgs, resolve_model_path
from phalanx.engine.core_client import EngineClientConfig, EngineCoreClient, EngineStartupError
from phalanx.engine.metrics import ServingMetrics
from phalanx.engine.tokenizer import eos_token_ids_of, load_tokenizer
from phalanx.entrypoints.async_llm import AsyncLLM
from phalanx.entrypoints.openai.server import build_app, make_state

logger = logging.getLogger("phalanx.server")


DEAD_EXIT_DELAY_S = 1.0


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


def check_config(cfg: ServeConfig) -> None:
    """Build the engine config once here so bad paths / values fail fast with their own message."""
    try:
        engine_config = cfg.engine_args.create_engine_config()
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ConfigError(str(e)) from e
    if cfg.engine_args.data_parallel_size > 1 and engine_config.model.is_moe:
        raise ConfigError(
            f"data_parallel_size={cfg.engine_args.data_parallel_size} with an MoE model needs the lockstep "
            "data-parallel loop, which is not implemented yet; use -dp 1 (dense models may use -dp N)"
        )


async def serve(cfg: ServeConfig) -> int:
    logging.getLogger("phalanx").setLevel(cfg.log_level.upper())
    args = cfg.engine_args
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    client = EngineCoreClient(
        EngineClientConfig(
            engine_args=args,
            data_parallel_size=args.data_parallel_size,
            extra_eos_token_ids=eos_token_ids_of(tokenizer),
            log_level=cfg.log_level,
            startup_timeout_s=cfg.startup_timeout,
        )
    )
    try:
        await client.start()
    except EngineStartupError as e:
        logger.error("%s", e)
        await client.shutdown()
        return 1
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

    engine = AsyncLLM(client, tokenizer, metrics, on_dead=on_dead)
    app = build_app(make_state(engine, tokenizer, metrics, cfg.served_model_name, model_path, cfg.api_key))
    server = uvicorn.Server(
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
    check_config(cfg)
    try:
        return asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        return 0


def engine_args_from(**kwargs: object) -> EngineArgs:
    """EngineArgs from flag values; unknown engine options are a ConfigError, never dropped."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in kwargs if k not in names)
    if unknown:
        raise ConfigError(f"the engine does not support {', '.join(unknown)} yet")
    return EngineArgs(**kwargs)  # type: ignore[arg-type]
