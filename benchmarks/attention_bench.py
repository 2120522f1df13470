"""The paged-attention kernel (`ops.cpu.decode_attention`) on SmolLM2's shapes (9 heads, 3 KV heads,
head_dim 64, bf16, 16-token blocks): long prefills, a prefill chunk after a cached prefix, decode and
speculative verification grids. Prints ms per call, GFLOP/s (4 x heads x head_dim per visible key)
and a digest of the output, so two builds of the kernel can be compared for identical results.

    python benchmarks/attention_bench.py [--threads 2] [--isa auto|amx|avx512_bf16|avx2] [--sdpa]

`--sdpa` also times PyTorch's scaled_dot_product_attention (its flash kernel on the CPU; causal,
contiguous bf16 tensors, not batch-invariant) on the fresh prefills, in the same run.

`--isa` picks the path as ``PHALANX_CPU_ISA`` does for a model (auto: the best; amx: bf16 on AMX
tiles; the others: the register-tiled task).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

from phalanx.ops import cpu as cpu_ops

H, KVH, D, BS = 9, 3, 64, 16
CASES = {  # name: (sequences, queries per sequence, keys of the last query, repeats)
    "prefill 1930": (1, 1930, 1930, 3),
    "prefill 512": (1, 512, 512, 10),
    "chunk 256 at 1024": (1, 256, 1024, 10),
    "decode 16 x 1 at 600": (16, 1, 600, 200),
    "verify 8 x 4 at 300": (8, 4, 300, 200),
}


def case(seqs: int, queries: int, keys: int) -> tuple[torch.Tensor, ...]:
    blocks = -(-keys // BS)
    kv = torch.randn(2, KVH, seqs * blocks + 3, BS, D).bfloat16()
    table = torch.stack([torch.randperm(seqs * blocks + 3)[:blocks] for _ in range(seqs)])
    q = torch.randn(seqs, queries, H, D).bfloat16()
    visible = torch.stack([torch.arange(keys - queries + 1, keys + 1) for _ in range(seqs)])  # causal
    return q, kv, table, visible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default="auto", choices=["auto", *cpu_ops.GEMM_ISAS])
    ap.add_argument("--sdpa", action="store_true", help="time SDPA on the fresh prefills too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernel = cpu_ops.kernel_for(torch.bfloat16)
    if kernel is None:
        raise SystemExit("the C++ kernels are not available here (PHALANX_KERNELS, or the build failed)")
    isa = cpu_ops.gemm_isa() if args.isa == "auto" else cpu_ops.GEMM_ISAS[args.isa]
    print(f"path {isa} ({'AMX tiles' if isa == cpu_ops.GEMM_ISAS['amx'] else 'register-tiled'})", flush=True)
    for name, (seqs, queries, keys, reps) in CASES.items():
        q, kv, table, visible = case(seqs, queries, keys)
        out = cpu_ops.decode_attention(kernel, q, kv, table, visible, 0.125, isa)  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            out = cpu_ops.decode_attention(kernel, q, kv, table, visible, 0.125, isa)
        dt = (time.perf_counter() - start) / reps
        flops = 4 * H * D * int(visible.sum())
        digest = hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
        print(f"{name:22s} {dt * 1e3:9.3f} ms  {flops / dt / 1e9:6.1f} GFLOP/s  {digest}", flush=True)
        if args.sdpa and seqs == 1 and queries == keys:
            qs = q.transpose(1, 2).contiguous()  # [1, H, T, D]
            own = torch.Generator().manual_seed(1)  # the global stream stays as without --sdpa (same digests)
            ks = torch.randn(1, KVH, keys, D, generator=own).bfloat16()
            vs = torch.randn(1, KVH, keys, D, generator=own).bfloat16()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            sdpa(qs, ks, vs, is_causal=True, scale=0.125, enable_gqa=True)
            start = time.perf_counter()
            for _ in range(reps):
                sdpa(qs, ks, vs, is_causal=True, scale=0.125, enable_gqa=True)
            ds = (time.perf_counter() - start) / reps
            print(f"{'  SDPA (flash)':22s} {ds * 1e3:9.3f} ms  {flops / ds / 1e9:6.1f} GFLOP/s  "
                  f"(this kernel / SDPA: {dt / ds:.2f}x the time)", flush=True)


if __name__ == "__main__":
    main()
