"""`phalanx bench latency | throughput`: in-process benchmarks through the offline `LLM` API.

Owns: `latency` (one batch of N fixed-length prompts, timed over repeated iterations after
warm-ups; avg and percentile latency) and `throughput` (many prompts at once; requests/s and
tokens/s), both with greedy, EOS-ignoring requests so every run produces the same token counts;
speculative acceptance from `LLM.get_metrics()`.
Does not own: the engine (``phalanx.engine``), the HTTP benchmark (``serve``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from phalanx.bench.datasets import BenchPrompt, load_jsonl, random_prompts
from phalanx.bench.metrics import describe
from phalanx.cli_types import json_object_arg as _json_object


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder or built-in model name")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-space", type=float, default=1.0, help="GiB")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    p.add_argument("--seed", type=int, default=0, help="seeds the engine and the random prompts")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", default=None, metavar="OUT", help="write all results to this file")
    p.add_argument("--label", default=None, help="a name for this run, stored in --json output")


def add_latency_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=5)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    p.add_argument("--dataset", default=None, help="JSONL with a question/prompt/text field or a chat 'messages' list (default: random)")


def make_llm(args: argparse.Namespace):  # -> phalanx.LLM
    import torch

    from phalanx import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_space=args.kv_cache_space,
        speculative_config=args.speculative_config,
    )


def _vocab(llm: Any) -> tuple[Any, int]:
    return llm.get_tokenizer(), int(llm.config.model.vocab_size)


def _engine_inputs(prompts: list[BenchPrompt]) -> tuple[list[dict[str, Any]], list[Any]]:
    from phalanx import SamplingParams

    inputs = [{"prompt_token_ids": p.prompt} if isinstance(p.prompt, list) else {"prompt": p.prompt} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=p.output_len, ignore_eos=True) for p in prompts]
    return inputs, params


def _spec(llm: Any, before: dict[str, Any] | None = None) -> dict[str, Any] | None:
    m = llm.get_metrics()
    drafts = m.get("spec_num_drafts", 0) - (before or {}).get("spec_num_drafts", 0)
    if drafts <= 0:
        return None
    accepted = m["spec_num_accepted_tokens"] - (before or {}).get("spec_num_accepted_tokens", 0)
    draft_tokens = m["spec_num_draft_tokens"] - (before or {}).get("spec_num_draft_tokens", 0)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else float("nan"),
    }


def _header(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "benchmark": kind,
        "label": args.label,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
    }


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(args)
    tokenizer, vocab = _vocab(llm)
    prompts = random_prompts(args.batch_size, args.input_len, args.output_len, 0.0, args.seed,
                             as_ids=True, vocab_size=vocab, tokenizer=tokenizer)
    inputs, params = _engine_inputs(prompts)
    for _ in range(args.num_iters_warmup):
        llm.generate(inputs, params, use_tqdm=False)
    before = llm.get_metrics()
    latencies = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        latencies.append(time.perf_counter() - t0)
    stats = describe(latencies, (10, 25, 50, 75, 90, 99))
    out_tokens = args.batch_size * args.output_len
    return {
        **_header(args, "latency"),
        "latencies_s": latencies,
        "avg_latency_s": stats["mean"],
        "percentiles_s": {k: v for k, v in stats.items() if k.startswith("p")},
        "output_throughput": out_tokens / stats["mean"],
        "spec_decode": _spec(llm, before),
    }


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(args)
    tokenizer, vocab = _vocab(llm)
    if args.dataset:
        prompts = load_jsonl(args.dataset, args.num_prompts, args.output_len, tokenizer=tokenizer)
    else:
        prompts = random_prompts(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                                 as_ids=True, vocab_size=vocab, tokenizer=tokenizer)
    inputs, params = _engine_inputs(prompts)
    from phalanx import SamplingParams

    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        **_header(args, "throughput"),
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(outputs) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "spec_decode": _spec(llm, before),
    }


def _print_and_save(res: dict[str, Any], args: argparse.Namespace) -> None:
    if res["benchmark"] == "latency":
        print(f"Avg latency: {res['avg_latency_s']:.4f} s  (batch {args.batch_size}, "
              f"{args.input_len} in / {args.output_len} out, {args.num_iters} iterations)")
        for k, v in res["percentiles_s"].items():
            print(f"{k} latency: {v:.4f} s")
        print(f"Output throughput: {res['output_throughput']:.2f} tok/s")
    else:
        print(f"Throughput: {res['request_throughput']:.2f} requests/s, {res['total_token_throughput']:.2f} "
              f"total tok/s, {res['output_throughput']:.2f} output tok/s ({res['num_requests']} requests, "
              f"{res['elapsed_s']:.2f} s)")
    spec = res.get("spec_decode")
    if spec:
        print(f"Speculative decoding: mean acceptance length {spec['mean_acceptance_length']:.2f}, "
              f"acceptance rate {spec['acceptance_rate'] * 100:.1f}%")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=str)


def main_latency(args: argparse.Namespace) -> int:
    _print_and_save(run_latency(args), args)
    return 0


def main_throughput(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        print(f"--num-prompts must be >= 1, got {args.num_prompts}", file=sys.stderr)
        return 2
    _print_and_save(run_throughput(args), args)
    return 0

