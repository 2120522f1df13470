"""Prefill time and batch decode speed of one model, offline (`LLM`), prefix cache off: the time of a
request with `max_tokens=1` (its prompt's prefill and one token) on the first prompts of each
prompt set, each run `--repeats` times, and the output tokens/s of `--batch` 128-token prompts
decoding 128 tokens at once. Run two builds alternately (for example a worktree of an older commit
on PYTHONPATH, with its own PHALANX_KERNEL_CACHE) to compare them.

    python benchmarks/prefill_bench.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from phalanx import LLM, SamplingParams

DATA = Path(__file__).resolve().parent / "data"


def prompts(path: Path, n: int) -> list[str]:
    with path.open() as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sets", default="512,1900", help="prompt sets (benchmarks/data/text_prompts_N.jsonl)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts of each set")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each prompt")
    ap.add_argument("--batch", type=int, default=32, help="128-token prompts decoding together (0: skip)")
    ap.add_argument("--max-model-len", type=int, default=2304)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=args.max_model_len, enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=1)
    for name in args.sets.split(","):
        ps = prompts(DATA / f"text_prompts_{name}.jsonl", args.prompts)
        llm.generate(ps[:1], one, use_tqdm=False)  # warm-up
        times = []
        for p in ps:
            for _ in range(args.repeats):
                start = time.perf_counter()
                llm.generate([p], one, use_tqdm=False)
                times.append(time.perf_counter() - start)
        tokens = [len(llm.tokenizer.encode(p)) for p in ps]
        print(f"prefill, text_prompts_{name} ({min(tokens)}-{max(tokens)} tokens): median "
              f"{1e3 * statistics.median(times):.0f} ms, min {1e3 * min(times):.0f} ms", flush=True)
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
