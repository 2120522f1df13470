"""The fused C++ ops (`phalanx/ops/cpu.py`) against the PyTorch reference paths they replace:
microseconds per call, same inputs, same process. Prints a markdown table; asserts nothing.

    python benchmarks/kernel_bench.py [--threads 2] [--iters 200]

Decode attention: random bf16 KV cache, blocks in scattered order (like a served cache), 8 query /
4 KV heads of 64 (the 40M random Llama) or 4 / 2 (the demo model); each request's context uniform in
[L/2, L]. Elementwise ops: a 512-wide residual stream, 12 heads of 64 for rotary; SiLU-and-multiply
over 1408 and argmax over 32000 (the 40M Llama's MLP and vocabulary).
"""

from __future__ import annotations

import argparse
import time

import torch

from phalanx.attention.torch_paged import _decode_group_attention
from phalanx.layers.norm import RMSNorm
from phalanx.layers.rotary import RotaryEmbedding
from phalanx.ops import cpu


def timeit(fn, iters: int) -> float:
    for _ in range(max(3, iters // 20)):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def attention_case(kernel, iters: int, seqs: int, qlen: int, max_len: int, kvh: int, group: int):
    gen = torch.Generator().manual_seed(seqs * 100 + qlen)
    d, bs = 64, 16
    width = (max_len + bs - 1) // bs
    num_blocks = seqs * width + 8
    cache = torch.randn(2, kvh, num_blocks, bs, d, generator=gen).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width)
    lens = torch.randint(max(max_len // 2, qlen), max_len + 1, (seqs,), generator=gen)
    visible = lens[:, None] - qlen + torch.arange(qlen)[None, :] + 1
    mask = (torch.arange(width * bs)[None, None, :] >= visible[:, :, None])[:, :, None, :]
    q = torch.randn(seqs, qlen, kvh * group, d, generator=gen).bfloat16()
    memo: dict = {}
    ref = timeit(lambda: _decode_group_attention(q, cache, table, mask, d**-0.5, memo), iters)
    fused = timeit(lambda: kernel.decode_attention(q, cache, table, visible, d**-0.5, cpu.gemm_isa()), iters)
    return f"decode attention, {seqs} req x {qlen} q, ctx <= {max_len}, {kvh * group}/{kvh} heads", ref, fused


def elementwise_case(kernel, iters: int, t: int):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 512, generator=gen).bfloat16()
    res = torch.randn(t, 512, generator=gen).bfloat16()
    norm = RMSNorm(512).bfloat16()
    ref = timeit(lambda: norm(x + res), iters)
    norm.kernel = kernel
    fused = timeit(lambda: norm.add_forward(x, res), iters)
    rot = RotaryEmbedding(64, 4096, 10000.0, None)
    qk = torch.randn(t, 16 * 64, generator=gen).bfloat16()[:, : 12 * 64].view(t, 12, 64)
    pos = torch.arange(t)
    rot_ref = timeit(lambda: rot.rotate(pos, qk, {}), iters)
    rot.kernel = kernel
    rot_fused = timeit(lambda: rot.rotate(pos, qk, {}), iters)
    return [(f"residual add + RMSNorm, {t} x 512", ref, fused), (f"rotary, {t} tokens x 12 heads x 64", rot_ref, rot_fused)]


def mlp_and_argmax_cases(kernel, iters: int, t: int):
    gen = torch.Generator().manual_seed(t)
    gate_up = torch.randn(t, 2 * 1408, generator=gen).bfloat16()  # the 40M Llama's intermediate size

    def silu_ref():
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    logits = torch.randn(t, 32000, generator=gen).bfloat16()  # the 40M Llama's vocabulary
    return [
        (f"SiLU-and-multiply, {t} x 1408", timeit(silu_ref, iters), timeit(lambda: kernel.silu_mul(gate_up), iters)),
        (f"greedy argmax, {t} x 32000 bf16 logits (reference: float32 copy + argmax)",
         timeit(lambda: logits.float().argmax(dim=-1), iters), timeit(lambda: kernel.argmax_rows(logits), iters)),
    ]


ATTENTION_CASES = [(1, 1, 200, 2, 2), (1, 4, 200, 2, 2), (1, 1, 256, 4, 2), (16, 1, 256, 4, 2), (32, 1, 384, 4, 2),
                   (16, 4, 256, 4, 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu.load(required=True)
    print(f"{args.threads} threads, {args.iters} calls each (medians are not taken: one timed loop per cell)\n")
    print("| op | PyTorch reference (us) | fused C++ (us) | speed-up |")
    print("|---|---|---|---|")
    rows = [attention_case(kernel, args.iters, *c) for c in ATTENTION_CASES]
    rows += [r for t in (1, 20, 2048) for r in elementwise_case(kernel, args.iters, t)]
    rows += [r for t in (1, 32, 256) for r in mlp_and_argmax_cases(kernel, args.iters, t)]
    for name, ref, fused in rows:
        print(f"| {name} | {ref:.0f} | {fused:.0f} | {ref / fused:.1f}x |")


if __name__ == "__main__":
    main()
