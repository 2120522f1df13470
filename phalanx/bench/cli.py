"""The `bench` command: `phalanx bench serve | latency | throughput` (also `python -m phalanx.bench`).

Owns: the `bench` subparser and its dispatch. The `phalanx` CLI hooks it in with
`add_bench_subparser(subparsers)` and, for `args.command == "bench"`, `return run_bench(args)`.
Does not own: what the benchmarks do (``serve``, ``offline``).
"""

from __future__ import annotations

import argparse
import sys

from phalanx.bench.offline import add_latency_args, add_throughput_args, main_latency, main_throughput
from phalanx.bench.serve import add_serve_args, run_serve


def add_bench_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: an OpenAI-compatible server under load, or the offline engine",
        description="Benchmarks. `serve` drives any OpenAI-compatible server (phalanx, vLLM) over HTTP; "
        "`latency` and `throughput` run the engine in-process through the offline LLM API.",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server", formatter_class=fmt)
    add_serve_args(p)
    p.set_defaults(bench_func=run_serve)
    p = sub.add_parser("latency", help="latency of one batch, offline", formatter_class=fmt)
    add_latency_args(p)
    p.set_defaults(bench_func=main_latency)
    p = sub.add_parser("throughput", help="tokens/s over many prompts, offline", formatter_class=fmt)
    add_throughput_args(p)
    p.set_defaults(bench_func=main_throughput)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    return int(args.bench_func(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_bench_subparser(sub)
    # `python -m phalanx.bench serve ...` means `bench serve ...`
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_bench(parser.parse_args(["bench", *argv]))
