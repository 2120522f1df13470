"""Start-up of an expert-parallel engine whose draft model is an MoE: time and peak RSS per rank.

Builds (once, in `--workdir`) a small random Mixtral target and a larger random Mixtral draft
(`--draft-experts` experts of `--draft-intermediate` x `--draft-hidden`, `--draft-layers` layers, bf16),
then starts `--ranks` lockstep ranks with `--enable-expert-parallel`, each in its own process (gloo
group on loopback), and reports for each rank the seconds to build its `EngineCore` (target, draft,
KV cache) and the process's peak resident memory (VmHWM) once built.

The engine code comes from `--repo` (default: this checkout; point it at a `git worktree` of another
commit to compare versions):

    .venv/bin/python benchmarks/moe_draft_startup.py
    .venv/bin/python benchmarks/moe_draft_startup.py --repo /tmp/older-worktree
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_models(workdir: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    import torch
    import transformers

    def build(folder: Path, hidden: int, inter: int, layers: int, experts: int) -> Path:
        if (folder / "config.json").is_file():
            return folder
        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(
            vocab_size=320, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=2,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=0, pad_token_id=0,
            tie_word_embeddings=False, sliding_window=None,
        )
        transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(folder))
        return folder

    target = build(workdir / "target", 128, 256, 2, 4)
    draft = build(workdir / "draft", args.draft_hidden, args.draft_intermediate, args.draft_layers, args.draft_experts)
    return target, draft


def rank_main(rank: int, size: int, port: int, target: str, draft: str, out: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import dataclasses

    import torch

    torch.set_num_threads(1)
    from phalanx.config import ParallelConfig
    from phalanx.distributed.group import DPGroup
    from phalanx.engine.args import EngineArgs
    from phalanx.engine.engine_core import EngineCore

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    cfg = EngineArgs(model=target, dtype="bfloat16", max_model_len=256, kv_cache_space=0.05,
                     speculative_config=spec).create_engine_config()
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(data_parallel_size=size, data_parallel_rank=rank,
                                                           enable_expert_parallel=True, dp_timeout_s=120))
    group = DPGroup(rank, size, f"tcp://127.0.0.1:{port}", 120.0, False)
    rss_before = peak_rss_kib()
    t0 = time.perf_counter()
    EngineCore(cfg, group)
    seconds = time.perf_counter() - t0
    out.put((rank, seconds, rss_before, peak_rss_kib()))
    group.close()


def peak_rss_kib() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, it does not carry over the
    parent's peak through fork + exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(REPO))
    ap.add_argument("--workdir", default="/tmp/phalanx-moe-draft-startup")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--draft-hidden", type=int, default=512)
    ap.add_argument("--draft-intermediate", type=int, default=2048)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--draft-experts", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, args.repo)  # the spawned ranks inherit it and import phalanx from there
    from phalanx.net import free_port

    target, draft = make_models(Path(args.workdir), args)
    draft_mb = sum(f.stat().st_size for f in draft.glob("*.safetensors")) / 2**20
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, str(target), str(draft), out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(30)
    import phalanx

    print(f"engine code: {Path(phalanx.__file__).parent}")
    print(f"MoE draft: {draft_mb:.0f} MiB on disk ({args.draft_experts} experts), {args.ranks} expert-parallel ranks")
    for rank, seconds, rss_before, rss_after in results:
        print(f"rank {rank}: EngineCore built in {seconds:6.2f} s; peak RSS {rss_after / 1024:7.0f} MiB "
              f"({rss_before / 1024:.0f} MiB before building)")


if __name__ == "__main__":
    main()
