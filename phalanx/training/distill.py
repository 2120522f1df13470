"""Self-distillation data: the target's own answers, then its features over prompt + answer.

Owns: `generate_answers` (the target answers each conversation through phalanx's engine, greedy by
default, a full batch kept in flight; each finished answer is appended to a JSONL as token ids, so an
interrupted run resumes where it stopped) and `record_features` (one teacher-forced forward of the
target over every prompt + answer, in phalanx's own kernels and dtype — the features the engine will
feed the head — written as bf16 safetensors shards, each shard written whole and renamed into place).
Does not own: which prompts (``training.prompts``), batching the shards for training
(``training.features``), or the objective (``training.objective``).

A shard holds, for S sequences of N tokens in all (see `SHARD_KEYS`):
    tokens [N] int32, offsets [S + 1] int64, answer_start [S] int64 (index of each sequence's first
    answer token), greedy [N] int32 (the target's argmax at each position: its prediction of the next
    token), final [N, H] bf16 (the target's final normed hidden state: EAGLE-1's feature and both
    heads' regression target), and for EAGLE-3 aux [N, 3 H] bf16 (the residual stream at the head's
    three target layers, in the head's order).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.training.prompts import Conversation

SHARD_KEYS = ("tokens", "offsets", "answer_start", "greedy", "final", "aux")


@dataclass(frozen=True)
class Answer:
    index: int  # the conversation's index in its prompt list
    prompt_ids: list[int]
    answer_ids: list[int]  # generated tokens, the stop token included when the answer stopped
    finish: str  # "stop" | "length"

    def to_json(self) -> str:
        return json.dumps({"i": self.index, "prompt_ids": self.prompt_ids, "answer_ids": self.answer_ids,
                           "finish": self.finish})


def read_answers(path: Path) -> list[Answer]:
    """The complete rows of an answers file; a torn last line (an interrupted write) is cut off so
    that appending resumes cleanly."""
    if not path.exists():
        return []
    rows: list[Answer] = []
    good_bytes = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                r = json.loads(line)
                rows.append(Answer(int(r["i"]), list(r["prompt_ids"]), list(r["answer_ids"]), str(r["finish"])))
            except (ValueError, KeyError, TypeError):
                break
            good_bytes += len(line)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return rows


def generate_answers(
    target: str,
    convs: Sequence[Conversation],
    out: Path,
    *,
    max_tokens: int,
    dtype: str = "bfloat16",
    max_num_seqs: int = 64,
    max_model_len: int = 2048,
    temperature: float = 0.0,
    seed: int = 0,
    desc: str = "answers",
    progress: bool = True,
) -> list[Answer]:
    """Answers of `target` to every conversation in `convs` (resuming `out`), in index order.

    An answer already in `out` is reused when its index and prompt tokens match (so the prompt list
    may grow or shrink between runs: rows past its end, or for another prompt, are left unused).
    Conversations whose prompt alone leaves no room for `max_tokens` in `max_model_len` are skipped
    (reported). The engine keeps `max_num_seqs` requests in flight: a new one starts as soon as one
    finishes, so no batch waits for its longest answer.
    """
    from tqdm.auto import tqdm

    from phalanx import LLM, SamplingParams
    from phalanx.checkpoint import resolve_model_path, tokenizer_path
    from phalanx.engine.engine_core import EngineCoreRequest
    from phalanx.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path(resolve_model_path(target)))
    prompts = [prompt_token_ids(tok, c) for c in convs]
    have = [a for a in read_answers(out) if a.index < len(prompts) and a.prompt_ids == prompts[a.index]]
    done = {a.index for a in have}
    fits = [i for i in range(len(prompts)) if len(prompts[i]) + max_tokens <= max_model_len]
    if len(fits) < len(prompts):
        print(f"{desc}: {len(prompts) - len(fits)} conversations skipped: prompt + {max_tokens} answer tokens "
              f"exceed {max_model_len}", flush=True)
    pending = [(i, prompts[i]) for i in fits if i not in done]
    if not pending:
        return sorted(have, key=lambda a: a.index)
    llm = LLM(target, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
              enable_prefix_caching=True)
    engine = llm.engine
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed if temperature > 0 else None)
    pending.reverse()  # pop() takes them in index order
    running: dict[str, tuple[int, list[int], list[int]]] = {}
    bar = tqdm(total=len(fits), initial=len(have), desc=desc, disable=not progress, dynamic_ncols=True, mininterval=2)
    num_tokens, t0 = 0, time.perf_counter()
    with open(out, "a", encoding="utf-8") as f:
        while pending or running:
            while pending and len(running) < max_num_seqs:
                i, ids = pending.pop()
                engine.add_request(EngineCoreRequest(str(i), ids, params, time.monotonic()))
                running[str(i)] = (i, ids, [])
            for o in engine.step():
                entry = running.get(o.req_id)
                if entry is None:
                    continue
                entry[2].extend(o.new_token_ids)
                num_tokens += len(o.new_token_ids)
                if o.finish_reason is not None:
                    del running[o.req_id]
                    a = Answer(entry[0], entry[1], entry[2], o.finish_reason)
                    f.write(a.to_json() + "\n")
                    f.flush()
                    have.append(a)
                    bar.update(1)
            bar.set_postfix_str(f"{num_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s", refresh=False)
    bar.close()
    return sorted(have, key=lambda a: a.index)


def prompt_token_ids(tokenizer: object, conv: Conversation) -> list[int]:
    """The conversation as the target's prompt: its chat template with the generation prompt, as
    the server renders a chat request; a tokenizer without a template (a base model) gets the
    messages' texts joined by blank lines, tokenized as a completion prompt would be."""
    from phalanx.engine.tokenizer import render_chat

    if getattr(tokenizer, "chat_template", None) is not None:
        text = render_chat(tokenizer, conv, True, False, None)
        return list(tokenizer(text, add_special_tokens=False).input_ids)  # type: ignore[operator]
    text = "\n\n".join(m["content"] for m in conv)
    return list(tokenizer(text).input_ids)  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# Features


@dataclass(frozen=True)
class FeatureSpec:
    """What `record_features` stores: EAGLE-3's aux layer ids (empty for EAGLE-1)."""

    aux_layer_ids: tuple[int, ...]
    max_len: int  # sequences are cut to this many tokens (prompt + answer)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of sequences holding about `shard_tokens` tokens each (a
    pure function of the lengths, so a resumed run writes the same shards).
    [300, 300, 300, 50] with 600 -> [(0, 2), (2, 4)]."""
    ranges: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            ranges.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths):
        ranges.append((start, len(lengths)))
    return ranges


def record_features(
    target: str,
    answers: Sequence[Answer],
    folder: Path,
    split: str,
    spec: FeatureSpec,
    *,
    dtype: str = "bfloat16",
    shard_tokens: int = 16384,
    forward_tokens: int = 2048,
    progress: bool = True,
    model: torch.nn.Module | None = None,
) -> list[Path]:
    """Shards `<split>-NNNNN.safetensors` in `folder` for `answers` (prompt + answer each, cut to
    `spec.max_len`); shards already there are kept (resume). Returns every shard's path."""
    from tqdm.auto import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    seqs = [(a.prompt_ids + a.answer_ids)[: spec.max_len] for a in answers]
    starts = [min(len(a.prompt_ids), spec.max_len) for a in answers]
    ranges = plan_shards([len(s) for s in seqs], shard_tokens)
    paths = [folder / shard_name(split, i) for i in range(len(ranges))]
    todo = [i for i, p in enumerate(paths) if not p.exists()]
    if not todo:
        return paths
    run = model or load_target(target, dtype)
    bar = tqdm(total=sum(len(s) for s in seqs), desc=f"features ({split})", unit="tok", disable=not progress,
               dynamic_ncols=True, mininterval=2)
    bar.update(sum(len(s) for i, (a, b) in enumerate(ranges) if i not in todo for s in seqs[a:b]))
    for i in todo:
        a, b = ranges[i]
        tensors = _features_of(run, seqs[a:b], starts[a:b], spec, forward_tokens, bar)
        _write_atomic(tensors, paths[i])
    bar.close()
    return paths


def load_target(target: str, dtype: str) -> torch.nn.Module:
    """phalanx's own model of the target (its kernels, its dtype): what the engine runs."""
    from phalanx.checkpoint import resolve_model_path
    from phalanx.config import ModelConfig
    from phalanx.models.registry import load_model

    return load_model(ModelConfig.from_hf(resolve_model_path(target), dtype))


def _write_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)  # a shard is there whole or not at all


@torch.inference_mode()
def _features_of(model: torch.nn.Module, seqs: list[list[int]], starts: list[int], spec: FeatureSpec,
                 forward_tokens: int, bar: object) -> dict[str, torch.Tensor]:
    """One shard's tensors: the sequences packed into forwards of about `forward_tokens` tokens."""
    finals, auxes, greedy = [], [], []
    for group in _pack(seqs, forward_tokens):
        f, a, g = _forward(model, [seqs[j] for j in group], spec.aux_layer_ids)
        finals.append(f)
        greedy.append(g)
        if a is not None:
            auxes.append(a)
        bar.update(sum(len(seqs[j]) for j in group))  # type: ignore[attr-defined]
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    out = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "answer_start": torch.tensor(starts, dtype=torch.int64),
        "greedy": torch.cat(greedy).to(torch.int32),
        "final": torch.cat(finals).to(torch.bfloat16).contiguous(),
    }
    if auxes:
        out["aux"] = torch.cat(auxes).to(torch.bfloat16).contiguous()
    return out


def _pack(seqs: list[list[int]], budget: int) -> list[list[int]]:
    """Consecutive groups of sequence indices of at most `budget` tokens (a longer sequence alone)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for j, s in enumerate(seqs):
        if cur and acc + len(s) > budget:
            groups.append(cur)
            cur, acc = [], 0
        cur.append(j)
        acc += len(s)
    if cur:
        groups.append(cur)
    return groups


def _forward(model: torch.nn.Module, seqs: list[list[int]], aux_ids: tuple[int, ...]
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The target over several whole sequences in one varlen forward (each from position 0, its own
    KV blocks): (final [N, H], aux [N, 3H] or None, greedy [N])."""
    from phalanx.attention.metadata import build_attention_metadata
    from phalanx.worker.model_runner import allocate_kv_caches

    cfg = model.config  # type: ignore[attr-defined]
    block = 16
    lens = [len(s) for s in seqs]
    widths = [-(-n // block) for n in lens]
    table = torch.zeros(len(seqs), max(widths), dtype=torch.int64)
    first = 0
    for r, w in enumerate(widths):  # request r owns blocks [first, first + w)
        table[r, :w] = torch.arange(first, first + w)
        first += w
    kv = allocate_kv_caches([(cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers, first, block, cfg.dtype)
    meta = build_attention_metadata(torch.tensor(lens), torch.zeros(len(seqs), dtype=torch.int64), table, block)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    normed, aux = model(ids, kv, meta, aux_layer_ids=aux_ids)  # type: ignore[operator]
    greedy = torch.cat([model.compute_logits(normed[i:i + 512], float32=False).argmax(-1)  # type: ignore[attr-defined]
                        for i in range(0, normed.shape[0], 512)])
    return normed, (torch.cat(aux, dim=-1) if aux else None), greedy


def count_tokens(answers: Sequence[Answer], vocab_size: int) -> torch.Tensor:
    """How often each target token appears in the answers ([vocab_size] int64): what the head drafts."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for a in answers:
        if a.answer_ids:
            counts += torch.bincount(torch.tensor(a.answer_ids), minlength=vocab_size)[:vocab_size]
    return counts

