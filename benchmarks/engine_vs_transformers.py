"""phalanx's offline `LLM` vs transformers `generate` on the 40M random Llama, bf16, 2 threads.

Two workloads, greedy, EOS ignored so both sides produce the same number of tokens:
  (i)  batch 1: one prompt of --b1-input-len tokens, --b1-output-len new tokens;
  (ii) 32 requests with prompt lengths uniform in [16, 256] and output lengths in [32, 128]; phalanx
       gets them all at once (continuous batching, per-request max_tokens), transformers runs one
       static left-padded batch that must decode to the longest request's length.
tokens/s counts the tokens each request asked for (for transformers, padding and the tokens decoded
past a shorter request's length are waste). Targets: >= 1.0x at batch 1, >= 3x on (ii). Also prints
phalanx's engine overhead: the share of step time outside the model forwards (target: <= 20%).

    python benchmarks/make_random_llama.py /tmp/bench_llama
    python benchmarks/engine_vs_transformers.py /tmp/bench_llama [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch


def mixed_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(16, 257, size=n)
    out_lens = rng.integers(32, 129, size=n)
    return [(rng.integers(3, vocab, size=int(i)).tolist(), int(o)) for i, o in zip(in_lens, out_lens)]


class HFRunner:
    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.pad_id = 0

    @torch.inference_mode()
    def run(self, work: list[tuple[list[int], int]]) -> float:
        """One static left-padded batch; returns seconds."""
        width = max(len(p) for p, _ in work)
        ids = torch.full((len(work), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(work), width), dtype=torch.long)
        for row, (p, _) in enumerate(work):  # left padding: [pad, pad, p0, p1, ...]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(o for _, o in work)
        t0 = time.perf_counter()
        self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=self.pad_id)
        return time.perf_counter() - t0


class PhalanxRunner:
    def __init__(self, model_dir: str, dtype: str, max_num_seqs: int) -> None:
        from phalanx import LLM

        # No prefix caching: with --repeats > 1 every run after the first would find its prompts
        # cached, which transformers' `generate` cannot do; both sides prefill every run.
        self.llm = LLM(model_dir, dtype=dtype, max_num_seqs=max_num_seqs, enable_prefix_caching=False)

    def run(self, work: list[tuple[list[int], int]]) -> float:
        from phalanx import SamplingParams

        prompts = [{"prompt_token_ids": p} for p, _ in work]
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
        before = self.llm.get_metrics()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = self.llm.get_metrics()
        step = after["step_seconds"] - before.get("step_seconds", 0.0)
        model = after["forward_seconds"] - before.get("forward_seconds", 0.0)
        # everything but the model forwards (scheduling, batch building, sampling, bookkeeping)
        self.last_overhead = max(0.0, 1.0 - model / step) if step > 0 else None
        got = [len(o.outputs[0].token_ids) for o in outs]
        assert got == [o for _, o in work], f"phalanx produced {got} tokens, asked {[o for _, o in work]}"
        return elapsed


def measure(runner: Any, work: list[tuple[list[int], int]], repeats: int) -> dict[str, Any]:
    runner.run([(work[0][0][:8], 4)])  # warm-up
    tokens = sum(o for _, o in work)
    times, overheads = [], []
    for _ in range(repeats):
        times.append(runner.run(work))
        overheads.append(getattr(runner, "last_overhead", None))
    res = {"seconds": times, "tokens": tokens, "tok_s_median": tokens / statistics.median(times),
           "tok_s_best": tokens / min(times)}
    if overheads[0] is not None:
        res["engine_overhead_fraction"] = statistics.median(overheads)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--b1-input-len", type=int, default=32)
    p.add_argument("--b1-output-len", type=int, default=128)
    p.add_argument("--num-mixed", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["b1", "mixed"], default=None, help="run one workload")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    rng = np.random.default_rng(args.seed)
    workloads = {
        "b1": [(rng.integers(3, vocab, size=args.b1_input_len).tolist(), args.b1_output_len)],
        "mixed": mixed_workload(args.num_mixed, args.seed, vocab),
    }
    if args.only:
        workloads = {args.only: workloads[args.only]}
    hf = HFRunner(args.model, getattr(torch, args.dtype))
    ph = PhalanxRunner(args.model, args.dtype, max_num_seqs=max(args.num_mixed, 1))
    results: dict[str, Any] = {"config": vars(args), "torch_threads": torch.get_num_threads()}
    for name, work in workloads.items():
        # alternate the two engines so slow-downs from other jobs on the machine hit both
        ph_res, hf_res = measure(ph, work, args.repeats), measure(hf, work, args.repeats)
        ratio = ph_res["tok_s_median"] / hf_res["tok_s_median"]
        results[name] = {"phalanx": ph_res, "transformers": hf_res, "ratio": ratio}
        print(f"[{name}] {len(work)} requests, {ph_res['tokens']} output tokens: phalanx "
              f"{ph_res['tok_s_median']:.1f} tok/s, transformers {hf_res['tok_s_median']:.1f} tok/s, "
              f"ratio {ratio:.2f}x (target {'1.0' if name == 'b1' else '3'}x); phalanx engine overhead "
              f"{ph_res['engine_overhead_fraction'] * 100:.1f}% of step time (target <= 20%)", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
