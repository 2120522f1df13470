"""Prefill time and batch decode speed of one model, offline (`LLM`), prefix cache off: the time of a
request with `max_tokens=1` (its prompt's prefill and one token) on the first prompts of each
prompt set, each run `--repeats` times, and the output tokens/s of `--batch` 128-token prompts
decoding 128 tokens at once. Run two builds alternately (for example a worktree of an older commit
on PYTHONPATH, with its own PHALANX_KERNEL_CACHE) to compare them.

With `--gemm-rate`, each prompt set's prefill is also put against oneDNN's bf16 GEMM on the model's
own linear shapes at the prompt's token count (`torch.nn.functional.linear`, 2 threads; AMX tiles
where the CPU has them): after each prefill run, a whole forward's linears as one timed span, so
both see the same machine. Printed: the prefill's FLOP rate (linears 2 x their weights' elements a
token, attention 4 x heads x head_dim a visible key), the GEMMs' rate, and each run's ratio.

    python benchmarks/prefill_bench.py --model smollm2-135m-instruct --gemm-rate --batch 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from invariance import model_shapes

from phalanx import LLM, SamplingParams

DATA = Path(__file__).resolve().parent / "data"


def prompts(path: Path, n: int) -> list[str]:
    with path.open() as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def linear_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears: invariance.py's shapes without the logits head."""
    return [(n, k) for name, n, k in model_shapes(model) if name != "lm_head"]


def prefill_flop(m, shapes: list[tuple[int, int]], tokens: int) -> float:  # noqa: ANN001 - ModelConfig
    linears = 2 * tokens * sum(o * i for o, i in shapes) * m.num_layers
    attention = 4 * m.num_heads * m.head_dim * (tokens * (tokens + 1) // 2) * m.num_layers
    return float(linears + attention)


def gemm_seconds(m, tokens: int, weights: list) -> float:  # noqa: ANN001 - ModelConfig
    """A whole forward's linears (every layer's) as oneDNN bf16 GEMMs at `tokens` rows, timed as
    one span like a prefill (a best of short bursts would catch this VM's fast moments only)."""
    x = {w.shape[1]: torch.randn(tokens, w.shape[1]).bfloat16() for w in weights}
    for w in weights:  # warm
        torch.nn.functional.linear(x[w.shape[1]], w)
    start = time.perf_counter()
    for _ in range(m.num_layers):
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sets", default="512,1900", help="prompt sets (benchmarks/data/text_prompts_N.jsonl)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts of each set")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each prompt")
    ap.add_argument("--batch", type=int, default=32, help="128-token prompts decoding together (0: skip)")
    ap.add_argument("--max-model-len", type=int, default=2304)
    ap.add_argument("--gemm-rate", action="store_true",
                    help="also measure oneDNN's bf16 GEMM rate on the model's linear shapes (see above)")
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=args.max_model_len, enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=1)
    for name in args.sets.split(","):
        ps = prompts(DATA / f"text_prompts_{name}.jsonl", args.prompts)
        llm.generate(ps[:1], one, use_tqdm=False)  # warm-up
        tokens = [len(llm.tokenizer.encode(p)) for p in ps]
        m = llm.config.model
        shapes = linear_shapes(args.model)
        weights = [torch.randn(o, i).bfloat16() for o, i in shapes]
        times, rates, gemm = [], [], []
        for p, n in zip(ps, tokens):
            for _ in range(args.repeats):
                start = time.perf_counter()
                llm.generate([p], one, use_tqdm=False)
                times.append(time.perf_counter() - start)
                rates.append(prefill_flop(m, shapes, n) / times[-1])
                if args.gemm_rate:
                    g = gemm_seconds(m, n, weights)
                    gemm.append(2 * n * sum(w.numel() for w in weights) * m.num_layers / g)
        print(f"prefill, text_prompts_{name} ({min(tokens)}-{max(tokens)} tokens): median "
              f"{1e3 * statistics.median(times):.0f} ms, min {1e3 * min(times):.0f} ms", flush=True)
        if args.gemm_rate:
            paired = [r / g for r, g in zip(rates, gemm)]
            print(f"  prefill {statistics.median(rates) / 1e12:.2f} TFLOP/s, oneDNN bf16 GEMM on its linears "
                  f"{statistics.median(gemm) / 1e12:.2f} TFLOP/s (medians); prefill / GEMM, each run against "
                  f"the GEMMs after it: median {statistics.median(paired):.2f} "
                  f"({min(paired):.2f}-{max(paired):.2f})", flush=True)
    if args.batch:
        ps = prompts(DATA / "text_prompts_128.jsonl", args.batch)
        sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm.generate(ps[:2], sp, use_tqdm=False)
        for _ in range(2):
            start = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
            print(f"decode, {len(ps)} prompts x 128 tokens at once: {rate:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
