"""bf16 batch invariance and its cost, on this CPU: the batch-invariant GEMM (csrc/gemm.cpp, on the
path ``PHALANX_CPU_ISA`` selects) against oneDNN's packed linear, side by side in one process.

    python benchmarks/invariance.py MODEL [MODEL ...] [--threads 2] [--paths auto,onednn]
                                    [--sections invariance,kernels,scaling,e2e,memory] [--repeats 3]
                                    [--clock wall|cpu]

Invariance (one table per path): the LLM's 16 prompts, 48 greedy tokens each; each of the first 8
requests run alone against the same request (a) in the batch of 16, (b) in that batch with n-gram
speculation k = 3, (c) in that batch with the model drafting for itself (k = 3: it must accept every
draft). A cell counts the requests whose tokens are identical to the lone run.

Scaling: the GEMM's wall-clock time over the model's layer shapes at 1 thread and at --threads, and
the speed-up (how evenly the threads share the work; --threads is the ideal).

Kernel cost: microseconds per call of every linear shape of each model at 1-2048 rows (oneDNN's
packed linear vs the GEMM), the fastest of 25 calls, and their sum per row count; 1 thread and
--threads.

End-to-end cost (offline LLM, the two paths loaded side by side, repeats interleaved, medians):
prefill tokens/s (16 prompts of 256 tokens, one output token each), decode tokens/s at concurrency 1
(one request, 128 tokens after its first) and 16 (16 requests, 64 tokens after their first); decode
time is a run's time minus the time of the same requests with one output token.

Memory: for each path, a fresh process loads the model (``kv_cache_space=0.05``) and reports the
bytes of the model's tensors (packed weights included, each counted once) and its resident set.

Kernel cost on a CPU where oneDNN cannot pack bf16 weights (AVX2 without AVX512BW/VL/DQ): against
the float32 matmul (MKL) of the same weights in float32 instead.

Paths: auto (the best GEMM path this CPU has), avx512_bf16, avx2, onednn (on a CPU without oneDNN
bf16: the layers stay nn.Linear), float32 (the model loaded in float32: no GEMM, MKL's matmul).

Clock: wall (default) or cpu — the process's CPU time, which on a machine shared with other work
measures the work itself rather than the waits for a core; meaningful with --threads 1 (with more
threads it also counts the time OpenMP threads spin at barriers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

CLOCK = time.perf_counter  # or time.process_time (--clock cpu)

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "Explain how a refrigerator keeps food cold.",
    "List five facts about the planet Mars:",
    "In a small village by the sea, there lived",
    "The recipe for a simple tomato soup is",
    "Describe the water cycle in a few sentences.",
    "Once upon a time, a clever fox",
    "The three most important inventions of the twentieth century are",
    "How do bees make honey?",
    "A letter to a friend about a summer trip:",
    "The rules of chess say that a knight",
    "Why is the sky blue? Because",
    "Here is a poem about autumn leaves:",
    "The capital cities of Europe include",
    "To learn a new language quickly, you should",
]


def _llm(model: str, path: str, **kwargs: Any):  # noqa: ANN202
    """An LLM whose bf16 linears all take GEMM `path` (chosen when the model is packed at load);
    path "float32": the model in float32 (PyTorch's matmul, MKL), the alternative on a CPU whose
    bf16 arithmetic is emulated."""
    from phalanx import LLM

    if path == "float32":
        return LLM(model, dtype="float32", **{"max_model_len": 1024, **kwargs})
    os.environ["PHALANX_CPU_ISA"] = path
    try:
        return LLM(model, dtype="bfloat16", **{"max_model_len": 1024, **kwargs})
    finally:
        os.environ.pop("PHALANX_CPU_ISA", None)


def path_name(path: str) -> str:
    from phalanx.layers.linear import onednn_bf16_supported
    from phalanx.ops import cpu

    if path == "float32":
        return "float32 model (MKL)"
    os.environ["PHALANX_CPU_ISA"] = path
    try:
        isa = cpu.gemm_isa()
    finally:
        os.environ.pop("PHALANX_CPU_ISA", None)
    return {3: "GEMM amx", 2: "GEMM avx512_bf16", 1: "GEMM avx2"}.get(isa) or (
        "oneDNN" if onednn_bf16_supported() else "F.linear (no oneDNN bf16 on this CPU)")


# ---- invariance -------------------------------------------------------------------------------------
def invariance(model: str, path: str) -> dict[str, tuple[int, int]]:
    from phalanx import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS
    llm = _llm(model, path, enable_prefix_caching=False)
    lone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:8]]
    cases = {"batch of 16": llm}
    cases["n-gram k=3"] = _llm(model, path, enable_prefix_caching=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    cases["self-draft k=3"] = _llm(model, path, enable_prefix_caching=False, speculative_config={
        "method": "draft_model", "model": model, "num_speculative_tokens": 3})
    out = {}
    for name, engine in cases.items():
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)[:8]]
        out[name] = (sum(a == b for a, b in zip(got, lone)), len(lone))
    return out


# ---- kernel cost ------------------------------------------------------------------------------------
def model_shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of every distinct linear of the model and its logits head."""
    from phalanx.checkpoint import resolve_model_path
    from phalanx.config import ModelConfig

    cfg = ModelConfig.from_hf(resolve_model_path(model), "bfloat16")
    h, hd = cfg.hidden_size, cfg.head_dim
    return [("qkv", (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), ("o", h, cfg.num_heads * hd),
            ("gate_up", 2 * cfg.intermediate_size, h), ("down", h, cfg.intermediate_size),
            ("lm_head", cfg.vocab_size, h)]


def _time_us(fn, calls: int = 25) -> float:  # noqa: ANN001
    """The fastest of `calls` calls: on a shared machine a slower call measures the neighbours."""
    fn()
    fn()
    times = []
    for _ in range(calls):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times) * 1e6


def kernel_costs(model: str, isa: int, rows_list: list[int]) -> None:
    from phalanx.layers.linear import onednn_bf16_supported
    from phalanx.ops import cpu

    module = cpu.load(required=True)
    totals: dict[int, list[float]] = {}
    clock = "CPU time" if CLOCK is time.process_time else "wall clock"
    # the baseline: oneDNN's packed bf16 linear, or where this CPU cannot run it (AVX2 without
    # AVX512BW/VL/DQ) the float32 matmul (MKL) of a float32 model
    onednn = onednn_bf16_supported()
    base = "oneDNN" if onednn else "float32 MKL"
    print(f"\n{Path(model).name}, {torch.get_num_threads()} threads, {clock}, us per call ({base} / GEMM = the GEMM's time as a share of {base}'s)\n")
    print("| layer (N x K) | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    for name, n, k in model_shapes(model):
        g = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        ref_w = torch.ops.mkldnn._reorder_linear_weight(w) if onednn else w.float()
        pairs = module.pack_pairs(w, isa)
        cells = []
        for rows in rows_list:
            if name == "lm_head" and rows > 64:  # logits are computed for sampled rows only
                cells.append("-")
                continue
            x = torch.randn(rows, k, generator=g).bfloat16()
            if onednn:
                a = _time_us(lambda: torch.ops.mkldnn._linear_pointwise(x, ref_w, None, "none", [], ""))  # noqa: B023
            else:
                xf = x.float()
                a = _time_us(lambda: torch.nn.functional.linear(xf, ref_w))  # noqa: B023
            b = _time_us(lambda: module.gemm(x, pairs, n, None, isa))  # noqa: B023
            totals.setdefault(rows, [0.0, 0.0])
            totals[rows][0] += a
            totals[rows][1] += b
            cells.append(f"{a:.0f} / {b:.0f} = {b / a:.2f}")
        print(f"| {name} ({n} x {k}) | " + " | ".join(cells) + " |")
    print("| all of the above | " + " | ".join(
        f"{a:.0f} / {b:.0f} = {b / a:.2f}" for a, b in (totals[r] for r in rows_list)) + " |")


def gemm_scaling(model: str, isa: int, rows_list: list[int], threads: int) -> None:
    """The GEMM's wall-clock time per call at 1 thread and at `threads`, every linear shape of the
    model summed (the head left out: its logits rows are few), and the speed-up: how evenly the
    threads share the rows and column blocks (`threads` is the ideal)."""
    from phalanx.ops import cpu

    module = cpu.load(required=True)
    shapes = [(n, k) for name, n, k in model_shapes(model) if name != "lm_head"]
    cases = []
    for n, k in shapes:
        g = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        cases.append((n, module.pack_pairs(w, isa), {r: torch.randn(r, k, generator=g).bfloat16() for r in rows_list}))
    print(f"\n{Path(model).name}: the GEMM over its layers' shapes, us per call (fastest of 25), wall clock\n")
    print("| rows | 1 thread | " + f"{threads} threads | speed-up |")
    print("|---|---|---|---|")
    before = torch.get_num_threads()
    try:
        for rows in rows_list:
            times = []
            for t in (1, threads):
                torch.set_num_threads(t)
                times.append(sum(_time_us(lambda: module.gemm(xs[rows], packed, n, None, isa))  # noqa: B023
                                 for n, packed, xs in cases))
            print(f"| {rows} | {times[0]:.0f} | {times[1]:.0f} | {times[0] / times[1]:.2f}x |", flush=True)
    finally:
        torch.set_num_threads(before)


# ---- end-to-end cost --------------------------------------------------------------------------------
def _run(llm, prompts: list[list[int]], max_tokens: int) -> float:  # noqa: ANN001
    from phalanx import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = CLOCK()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return CLOCK() - t0


def e2e_costs(model: str, paths: list[str], repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    engines = {p: _llm(model, p, enable_prefix_caching=False) for p in paths}
    vocab = next(iter(engines.values())).engine.runner.model.config.vocab_size
    long = [torch.randint(3, vocab, (256,), generator=g).tolist() for _ in range(16)]
    short = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(16)]
    results: dict[str, dict[str, list[float]]] = {p: {"prefill": [], "c1": [], "c16": []} for p in paths}
    for _ in range(repeats):
        for p, llm in engines.items():  # interleaved: both paths see the same machine load
            _run(llm, short[:1], 2)  # warm-up
            results[p]["prefill"].append(16 * 256 / _run(llm, long, 1))
            results[p]["c1"].append(128 / max(_run(llm, short[:1], 129) - _run(llm, short[:1], 1), 1e-9))
            results[p]["c16"].append(16 * 64 / max(_run(llm, short, 65) - _run(llm, short, 1), 1e-9))
    base = paths[-1]
    clock = "CPU time" if CLOCK is time.process_time else "wall clock"
    print(f"\n{Path(model).name}, {torch.get_num_threads()} threads, {clock}, medians of {repeats} "
          f"(ratio: against {path_name(base)})\n")
    print("| GEMM | prefill tok/s | decode c=1 tok/s | decode c=16 tok/s |")
    print("|---|---|---|---|")
    for p in paths:
        cells = []
        for key in ("prefill", "c1", "c16"):
            v, ref = statistics.median(results[p][key]), statistics.median(results[base][key])
            cells.append(f"{v:.0f} ({v / ref:.2f}x)")
        print(f"| {path_name(p)} | " + " | ".join(cells) + " |")


# ---- memory -----------------------------------------------------------------------------------------
def _memory_child(model: str, path: str) -> None:
    """Runs in a fresh process: load, then print 'tensors MiB, RSS MB'."""
    llm = _llm(model, path, enable_prefix_caching=False, kv_cache_space=0.05, max_model_len=256)
    seen, total = set(), 0
    for m in llm.engine.runner.model.modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        tensors += [t for t in (getattr(m, "packed", None),) if isinstance(t, torch.Tensor)]
        for t in tensors:
            try:
                key = t.data_ptr()
            except RuntimeError:  # oneDNN's packed weight has no plain storage
                key = id(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024
    print(f"{total / 2**20:.0f} {rss:.0f}")


def memory(models: list[str], paths: list[str]) -> None:
    import subprocess

    print("\nMemory after load (kv_cache_space=0.05)\n")
    print("| model | linears | model tensors MiB | resident set MB |")
    print("|---|---|---|---|")
    for model in models:
        for p in paths:
            out = subprocess.run([sys.executable, __file__, "--memory-child", model, p], capture_output=True,
                                 text=True, check=True).stdout.split()
            print(f"| {Path(model).name} | {path_name(p)} | {out[-2]} | {out[-1]} |", flush=True)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--memory-child":
        _memory_child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="auto,onednn")
    ap.add_argument("--sections", default="invariance,kernels,e2e")
    ap.add_argument("--rows", default="1,4,16,64,128,512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    paths, sections = args.paths.split(","), args.sections.split(",")
    from phalanx.ops import cpu

    flags = open("/proc/cpuinfo").read()
    isas = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    print(f"CPU: {' '.join(isas)}; kernels: {cpu.backend()}; paths: {', '.join(path_name(p) for p in paths)}")
    if "invariance" in sections:
        for p in paths:
            print(f"\nInvariance, {path_name(p)}: requests identical to the lone run (greedy, 48 tokens)\n")
            print("| model | batch of 16 | n-gram k=3 | self-draft k=3 | all |")
            print("|---|---|---|---|---|")
            for model in args.models:
                res = invariance(model, p)
                same, total = sum(a for a, _ in res.values()), sum(b for _, b in res.values())
                print(f"| {Path(model).name} | " + " | ".join(f"{a}/{b}" for a, b in res.values())
                      + f" | {same}/{total} |", flush=True)
    if "kernels" in sections:
        gemm_paths = [p for p in paths if path_name(p).startswith("GEMM")]
        if gemm_paths:
            os.environ["PHALANX_CPU_ISA"] = gemm_paths[0]
            isa = cpu.gemm_isa()
            os.environ.pop("PHALANX_CPU_ISA")
            for threads in sorted({1, args.threads}):
                torch.set_num_threads(threads)
                for model in args.models:
                    kernel_costs(model, isa, [int(r) for r in args.rows.split(",")])
            torch.set_num_threads(args.threads)
    if "scaling" in sections:
        os.environ["PHALANX_CPU_ISA"] = next((p for p in paths if path_name(p).startswith("GEMM")), "auto")
        isa = cpu.gemm_isa()
        os.environ.pop("PHALANX_CPU_ISA")
        for model in args.models:
            gemm_scaling(model, isa, [int(r) for r in args.rows.split(",")], args.threads)
    if "e2e" in sections:
        for model in args.models:
            e2e_costs(model, paths, args.repeats)
    if "memory" in sections:
        memory(args.models, paths)


if __name__ == "__main__":
    main()
