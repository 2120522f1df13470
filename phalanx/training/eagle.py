"""`phalanx train-eagle`: an EAGLE-1 / EAGLE-3 head for any target phalanx loads, by self-distillation.

Owns: `TrainEagleConfig` (every setting, validated at the boundary), the work directory (`WorkDir`:
what a resumed run finds, and the check that it was made with the same data settings), and
`train_eagle`, which runs the stages in order, each skipped when its output is already there:

  prompts   the built-in generated chat prompts or a JSONL file, split into train / held-out
  answers   the target answers them (phalanx's engine, greedy by default)     -> answers-*.jsonl
  features  the target runs over prompt + answer; hidden states as bf16 shards -> features/
  train     the head learns EAGLE's objective with the training-time test    -> checkpoint.pt
  evaluate  acceptance through phalanx's engine on held-out prompts (k passes, greedy)
  save      the head folder (vLLM's format + training.json), renamed into place at the end

Does not own: the prompt sources (``prompts``), the data files (``distill``, ``features``), the head
module and its format (``head``), the loss (``objective``) or the loop (``loop``).

Interrupt it at any point and run the same command again: finished answers, shards and the last
checkpoint are kept. The output folder appears only when everything is done, whole: a half-written
head is never loadable.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from phalanx.training.config import DEFAULT_NUM_PROMPTS, TrainEagleConfig, TrainEagleError
from phalanx.training.prompts import (
    Conversation,
    PromptSet,
    builtin_prompt_set,
    read_prompt_file,
    write_jsonl,
)

# ---------------------------------------------------------------------------------------------
# The target


@dataclass(frozen=True)
class Target:
    name: str  # as the user gave it
    path: str  # resolved folder or .gguf
    hf: dict[str, Any]  # its Hugging Face config
    num_layers: int
    hidden_size: int
    vocab_size: int
    identity: str  # path + weight-file sizes: what a resumed run must find again

    @classmethod
    def resolve(cls, name: str) -> Target:
        from phalanx.checkpoint import hf_config, is_gguf, resolve_model_path
        from phalanx.config import SUPPORTED_ARCHITECTURES

        try:
            path = resolve_model_path(name)
            hf = hf_config(path)
        except (OSError, ValueError) as e:
            raise TrainEagleError(f"cannot read the target {name!r}: {e}") from None
        arch = (hf.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise TrainEagleError(f"the target {name!r} is a {arch!r}; phalanx serves (and trains heads for): "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        text = hf.get("text_config") or {}
        hf = {**text, **hf}
        files = [Path(path)] if is_gguf(path) else sorted(Path(path).glob("*.safetensors"))
        identity = f"{Path(path).resolve()}|" + ",".join(str(f.stat().st_size) for f in files)
        return cls(name, path, hf, int(hf["num_hidden_layers"]), int(hf["hidden_size"]), int(hf["vocab_size"]), identity)

    def default_aux_ids(self) -> tuple[int, ...]:
        """Low / middle / last (vLLM's ids: j is the stream after j layers, n the last layer's output)."""
        n = self.num_layers
        ids = (1, n // 2, n) if n >= 4 else (0, max(1, n // 2), n)
        if len(set(ids)) != 3:
            raise TrainEagleError(f"an EAGLE-3 head needs three distinct target layers; the target has {n}")
        return ids


# ---------------------------------------------------------------------------------------------
# The work directory


class WorkDir:
    """`<out>.work/`: run.json (the settings), prompts, answers, feature shards, checkpoint, stage
    times. Nothing in it is a head folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.features = path / "features"
        self.checkpoint = path / "checkpoint.pt"

    def file(self, name: str) -> Path:
        return self.path / name

    def open(self, cfg: TrainEagleConfig, target: Target) -> bool:
        """Create it, or check that an existing one holds data made with these settings. Returns
        True when resuming."""
        settings = {"target": target.identity, **{k: _jsonable(getattr(cfg, k)) for k in cfg.DATA_FIELDS}}
        if cfg.prompts is not None:
            settings["prompts_sha256"] = _sha256(Path(cfg.prompts))
        run = self.file("run.json")
        if cfg.restart and self.path.exists():
            shutil.rmtree(self.path)
        if run.exists():
            old = json.loads(run.read_text())
            diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            if diff:
                what = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                raise TrainEagleError(
                    f"the work directory {str(self.path)!r} holds data made with other settings ({what}); "
                    "pass --restart to discard it, or --work-dir to use another")
            return True
        if self.path.exists() and any(self.path.iterdir()):
            raise TrainEagleError(f"the work directory {str(self.path)!r} exists but has no run.json (not a "
                                  "train-eagle work directory); remove it or pass --work-dir")
        self.path.mkdir(parents=True, exist_ok=True)
        _write_json(run, settings)
        return False

    def times(self) -> dict[str, float]:
        f = self.file("times.json")
        return json.loads(f.read_text()) if f.exists() else {}

    def add_time(self, stage: str, seconds: float) -> None:
        t = self.times()
        t[stage] = round(t.get(stage, 0.0) + seconds, 1)
        _write_json(self.file("times.json"), t)


def _jsonable(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _say(msg: str) -> None:
    print(f"[train-eagle {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Stage:
    """Times a stage into times.json (added up over resumed runs)."""

    def __init__(self, work: WorkDir, name: str) -> None:
        self.work, self.name = work, name

    def __enter__(self) -> _Stage:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.work.add_time(self.name, time.perf_counter() - self.t0)


# ---------------------------------------------------------------------------------------------
# Stages


def stage_prompts(cfg: TrainEagleConfig, work: WorkDir) -> PromptSet:
    """The train / held-out conversations (regenerated when --num-prompts changed: the built-in
    generator and a file's first N rows are both prefix-stable, and the split is a hash of each
    conversation, so a larger set extends a smaller one)."""
    train_f, held_f, meta_f = work.file("prompts-train.jsonl"), work.file("prompts-held-out.jsonl"), work.file("prompts.json")
    wanted = {"num_prompts": cfg.num_prompts}
    if train_f.exists() and held_f.exists() and meta_f.exists() and json.loads(meta_f.read_text()) == wanted:
        return PromptSet(_read_all(train_f), _read_all(held_f))
    if cfg.prompts is None:
        ps = builtin_prompt_set(cfg.num_prompts or DEFAULT_NUM_PROMPTS, cfg.seed, cfg.held_out_fraction)
        _say(f"prompts: {len(ps.train)} train + {len(ps.held_out)} held-out generated conversations "
             f"(phalanx.training.prompts, seed {cfg.seed})")
    else:
        ps = read_prompt_file(cfg.prompts, cfg.held_out_fraction, limit=cfg.num_prompts)
        _say(f"prompts: {len(ps.train)} train + {len(ps.held_out)} held-out conversations from {cfg.prompts}")
        if ps.skipped:
            shown = "; ".join(f"line {n}: {why}" for n, why in ps.skipped[:5])
            _say(f"prompts: skipped {len(ps.skipped)} bad rows ({shown}{' ...' if len(ps.skipped) > 5 else ''})")
        _write_json(work.file("skipped-rows.json"), ps.skipped)
    if not ps.train:
        raise TrainEagleError("no training prompts: the prompt set's held-out split took every row")
    write_jsonl(train_f, ps.train)
    write_jsonl(held_f, ps.held_out)
    _write_json(meta_f, wanted)
    return ps


def _read_all(path: Path) -> list[Conversation]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def stage_answers(cfg: TrainEagleConfig, target: Target, work: WorkDir, ps: PromptSet, progress: bool):
    from phalanx.training.distill import generate_answers

    kw = dict(max_tokens=cfg.max_tokens, dtype=cfg.dtype, max_num_seqs=cfg.gen_batch, max_model_len=cfg.max_len,
              temperature=cfg.temperature, seed=cfg.seed, progress=progress)
    with _Stage(work, "answers"):
        train = generate_answers(target.path, ps.train, work.file("answers-train.jsonl"), desc="answers (train)", **kw)
        val = generate_answers(target.path, ps.held_out[: cfg.val_prompts], work.file("answers-val.jsonl"),
                               desc="answers (validation)", **kw) if cfg.val_prompts and ps.held_out else []
    if not train:
        raise TrainEagleError("the target produced no usable answer (every prompt longer than max_len - max_tokens?)")
    return train, val


def stage_features(cfg: TrainEagleConfig, target: Target, work: WorkDir, train: list, val: list,
                   aux_ids: tuple[int, ...], progress: bool) -> tuple[list[Path], list[Path]]:
    """Feature shards of the train and validation answers (kept while the answer set is the same;
    a missing shard is recorded again, a changed answer set records everything again)."""
    from phalanx.training.distill import FeatureSpec, load_target, record_features

    spec = FeatureSpec(aux_ids, cfg.max_len)
    key = {"train": [a.index for a in train], "val": [a.index for a in val]}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    done_f = work.features / "done.json"
    done = json.loads(done_f.read_text()) if done_f.exists() else {}
    if done.get("answers") != digest:
        if work.features.exists():
            shutil.rmtree(work.features)
        with _Stage(work, "features"):
            torch.set_num_threads(cfg.threads)
            model = load_target(target.path, cfg.dtype)
            tr = record_features(target.path, train, work.features, "train", spec, dtype=cfg.dtype,
                                 shard_tokens=cfg.shard_tokens, progress=progress, model=model)
            va = record_features(target.path, val, work.features, "val", spec, dtype=cfg.dtype,
                                 shard_tokens=cfg.shard_tokens, progress=progress, model=model) if val else []
            del model
        done = {"answers": digest, "train": [p.name for p in tr], "val": [p.name for p in va]}
        _write_json(done_f, done)
        work.checkpoint.unlink(missing_ok=True)  # a head trained on other data is not resumed
    return [work.features / n for n in done["train"]], [work.features / n for n in done["val"]]


@dataclass(frozen=True)
class DraftVocab:
    keep: torch.Tensor  # [dv] sorted target ids; draft id i -> target id keep[i]
    coverage: float  # fraction of answer tokens the head can draft

    @property
    def d2t(self) -> torch.Tensor:  # vLLM's table: target id = draft id + d2t[draft id]
        return self.keep - torch.arange(len(self.keep))

    def t2d(self, vocab: int) -> torch.Tensor:
        m = torch.zeros(vocab, dtype=torch.bool)
        m[self.keep] = True
        return m

    def target_to_draft(self, vocab: int) -> torch.Tensor:
        m = torch.full((vocab,), -100, dtype=torch.int64)
        m[self.keep] = torch.arange(len(self.keep))
        return m


def draft_vocabulary(counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> DraftVocab:
    """The `size` most frequent answer tokens (ties by id), with `always` (the stop tokens) in it."""
    score = counts.clone().double()
    for t in always:
        if 0 <= t < len(score):
            score[t] = float("inf")
    order = torch.argsort(-score, stable=True)[:size]
    keep = torch.sort(order).values
    total = max(1, int(counts.sum()))
    return DraftVocab(keep, float(counts[keep].sum()) / total)


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainResult:
    head: Any  # EagleHead
    head_cfg: dict
    steps: int
    seconds: float
    val: dict
    curve: dict
    vocab: DraftVocab | None = None
    fc_lr_scale: float = 1.0
    extra: dict = field(default_factory=dict)


def _target_tensors(target: Target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's (embedding [V, H], lm_head [V, H], final norm weight [H]), float32, without
    building the model (only these tensors are read)."""
    from phalanx.models.loader import iterate_weights

    want = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    got: dict[str, torch.Tensor] = {}
    for name, t in iterate_weights(target.path):
        if name in want:
            got[name] = t.float()
    if "model.embed_tokens.weight" not in got or "model.norm.weight" not in got:
        raise TrainEagleError(f"the target {target.name!r} has no model.embed_tokens / model.norm weights")
    emb = got["model.embed_tokens.weight"]
    return emb, got.get("lm_head.weight", emb), got["model.norm.weight"]


def stage_train(cfg: TrainEagleConfig, target: Target, work: WorkDir, train_shards: list[Path],
                val_shards: list[Path], aux_ids: tuple[int, ...], vocab: DraftVocab | None,
                progress: bool) -> TrainResult:
    from phalanx.training.features import BatchStream, FeatureShards, steps_per_epoch
    from phalanx.training.head import EagleHead, head_config
    from phalanx.training.loop import (
        LoopConfig,
        TrainLoop,
        bf16_autocast_fast,
        load_checkpoint,
        save_checkpoint,
    )
    from phalanx.training.objective import LossStats, Objective

    torch.manual_seed(cfg.seed)
    eagle3 = cfg.method == "eagle3"
    embed, lm_head, norm_w = _target_tensors(target)
    hcfg = head_config(target.hf, eagle3, len(vocab.keep) if vocab else None, list(aux_ids) if eagle3 else None,
                       cfg.num_layers, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads)
    head = EagleHead(hcfg, eagle3, embed, lm_head)
    teacher_rows = lm_head
    to_draft = None
    if eagle3:
        assert vocab is not None
        with torch.no_grad():
            head.d2t.copy_(vocab.d2t)
            head.t2d.copy_(vocab.t2d(target.vocab_size))
            head.lm_head.weight.copy_(lm_head[vocab.keep])  # start from the target's own rows
            head.norm.weight.copy_(norm_w)
        teacher_rows = lm_head[vocab.keep]
        to_draft = vocab.target_to_draft(target.vocab_size)
    shards = FeatureShards.open(train_shards)
    stream = BatchStream(shards, cfg.batch_tokens, cfg.window, cfg.seed, cfg.max_len, aux=eagle3)
    per_epoch = steps_per_epoch(shards, cfg.batch_tokens, cfg.window, cfg.seed, cfg.max_len)
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    warmup = cfg.warmup if cfg.warmup is not None else min(200, max(1, steps // 20))
    fc_lr_scale = 1.0
    if eagle3:
        # fc reads the target's raw residual stream (RMS often 10-100x the head's own activations):
        # start the fused feature at RMS 1, and move fc's weights in proportion to their size
        sample = stream.batch(0).features.reshape(-1, 3 * target.hidden_size)[:2048]
        rms = float(sample.pow(2).mean().sqrt())
        fc_lr_scale = 1.0 / max(rms, 1e-6)
        with torch.no_grad():
            head.fc.weight.mul_(1.0 / float(head.fc(sample).pow(2).mean().sqrt().clamp(min=1e-6)))
    other = [p for p in head.parameters() if p.requires_grad and p is not head.fc.weight]
    opt = torch.optim.AdamW([{"params": other, "lr_scale": 1.0}, {"params": [head.fc.weight], "lr_scale": fc_lr_scale}],
                            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    objective = Objective(passes=cfg.passes, labels=cfg.label_kind)
    train_settings = {k: _jsonable(getattr(cfg, k)) for k in cfg.TRAIN_FIELDS}
    state = None
    if work.checkpoint.exists():
        saved = torch.load(work.checkpoint, map_location="cpu", weights_only=True).get("extra", {})
        if saved.get("settings") == train_settings:
            state, _ = load_checkpoint(work.checkpoint, head, opt)
            _say(f"train: resuming from step {state.step} of {steps}")
        else:
            _say("train: the training settings changed since the checkpoint; training starts over on the same data")
            work.checkpoint.unlink()
            work.file("validation.jsonl").unlink(missing_ok=True)
    nparams = sum(p.numel() for p in head.parameters())
    precision = "bfloat16 autocast" if bf16_autocast_fast() else "float32"
    _say(f"train: {cfg.method} head, {nparams / 1e6:.2f}M parameters, {shards.num_sequences} sequences / "
         f"{shards.num_tokens} tokens, {per_epoch} batches per epoch, {steps} steps (lr {cfg.lr}, warm-up {warmup}, "
         f"{cfg.passes} passes, {cfg.label_kind} labels, {precision}"
         f"{'' if precision != 'float32' else ': this CPU has no fast bf16 matmul'})")
    val_stream, val_batches = None, 0
    if val_shards:
        val_stream = BatchStream(FeatureShards.open(val_shards), cfg.batch_tokens, 1, 0, cfg.max_len, aux=eagle3)
        val_batches = steps_per_epoch(val_stream.shards, cfg.batch_tokens, 1, 0, cfg.max_len)
    last_val: dict = {}

    def loss_fn(batch):  # noqa: ANN001, ANN202
        loss, _ = objective(head, batch, teacher_rows, to_draft, with_stats=False)
        return loss, ""

    def eval_fn(step: int) -> float:
        nonlocal last_val
        if val_stream is None:
            return float("nan")
        total = LossStats()
        for i in range(val_batches):
            total.add(objective(head, val_stream.batch(i), teacher_rows, to_draft)[1])
        last_val = {"step": step + 1, **total.summary()}
        _say(f"train: step {step + 1}/{steps} validation {json.dumps(total.summary())}")
        with open(work.file("validation.jsonl"), "a") as f:
            f.write(json.dumps(last_val) + "\n")
        return total.loss

    def checkpoint_fn(st) -> None:  # noqa: ANN001
        save_checkpoint(work.checkpoint, head, opt, st, {"settings": train_settings})

    loop = TrainLoop(LoopConfig(steps=steps, lr=cfg.lr, warmup=warmup, bf16=True, threads=cfg.threads,
                                eval_every=cfg.eval_every, checkpoint_every=cfg.checkpoint_every,
                                desc=f"train {cfg.method}"),
                     head, opt, stream.batch, loss_fn, eval_fn if val_stream else None, checkpoint_fn)
    with _Stage(work, "train"):
        state = loop.run(state, progress=progress)
    checkpoint_fn(state)
    if not last_val and val_stream is not None:
        head.eval()
        with torch.no_grad():
            eval_fn(steps - 1)
    head.eval()
    return TrainResult(head, hcfg, steps, state.seconds, last_val,
                       {"train": state.train_curve, "val": state.val_curve}, vocab, fc_lr_scale,
                       {"params": nparams, "precision": precision, "batches_per_epoch": per_epoch,
                        "warmup": warmup, "sequences": shards.num_sequences, "tokens": shards.num_tokens})


def engine_acceptance(target: str, head_folder: str, method: str, convs: list[Conversation], k: int,
                      max_tokens: int, dtype: str, max_model_len: int) -> dict:
    """Serve `convs` greedily through phalanx's engine with the head drafting k tokens: the mean
    acceptance length (1 + accepted drafts per verification step) and each position's acceptance."""
    from phalanx import LLM, SamplingParams
    from phalanx.training.distill import prompt_token_ids

    llm = LLM(target, dtype=dtype, max_model_len=max_model_len,
              speculative_config={"method": method, "model": head_folder, "num_speculative_tokens": k})
    prompts = [{"prompt_token_ids": prompt_token_ids(llm.get_tokenizer(), c)} for c in convs]
    prompts = [p for p in prompts if len(p["prompt_token_ids"]) + max_tokens <= max_model_len]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    m = llm.get_metrics()
    return {"prompts": len(prompts), "k": k, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "mean_acceptance_length": round(m.get("spec_mean_acceptance_length", 1.0), 4),
            "acceptance_per_position": [round(a, 4) for a in m.get("spec_acceptance_rate_per_pos", [])],
            "verification_steps": m.get("spec_num_drafts", 0)}


# ---------------------------------------------------------------------------------------------
# The whole run


def train_eagle(cfg: TrainEagleConfig, progress: bool = True, argv: list[str] | None = None) -> dict:
    """Run every stage (resuming what a previous run left) and write the head to `cfg.out`.
    Returns the report also saved as `training.json` in the head folder."""
    t_start = time.perf_counter()
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise TrainEagleError(f"the output folder {str(out)!r} exists; pass --overwrite to replace it")
    if cfg.prompts is not None and not Path(cfg.prompts).is_file():
        raise TrainEagleError(f"prompt file {cfg.prompts!r} does not exist")
    target = Target.resolve(cfg.model)
    eagle3 = cfg.method == "eagle3"
    aux_ids = (cfg.aux_layer_ids or target.default_aux_ids()) if eagle3 else ()
    if eagle3 and not all(0 <= i <= target.num_layers for i in aux_ids):
        raise TrainEagleError(f"aux_layer_ids {list(aux_ids)} must lie in 0..{target.num_layers} for this target")
    if cfg.draft_vocab is not None and cfg.draft_vocab > target.vocab_size:
        raise TrainEagleError(f"draft_vocab {cfg.draft_vocab} exceeds the target's vocabulary ({target.vocab_size})")
    work = WorkDir(cfg.work_path)
    resumed = work.open(cfg, target)
    _say(f"{'resuming in' if resumed else 'work directory'} {work.path}; target {target.path}")

    ps = stage_prompts(cfg, work)
    train_answers, val_answers = stage_answers(cfg, target, work, ps, progress)
    ans_tokens = sum(len(a.answer_ids) for a in train_answers)
    _say(f"answers: {len(train_answers)} train ({ans_tokens} answer tokens), {len(val_answers)} validation")
    if cfg.stop_after == "answers":
        return {"stopped_after": "answers", "work_dir": str(work.path)}
    train_shards, val_shards = stage_features(cfg, target, work, train_answers, val_answers, aux_ids, progress)
    if cfg.stop_after == "features":
        return {"stopped_after": "features", "work_dir": str(work.path)}

    vocab = None
    if eagle3:
        from phalanx.training.distill import count_tokens

        eos = target.hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        stops = tuple({a.answer_ids[-1] for a in train_answers if a.finish == "stop" and a.answer_ids} | set(eos_ids))
        size = min(cfg.draft_vocab or 32768, target.vocab_size)
        vocab = draft_vocabulary(count_tokens(train_answers, target.vocab_size), size, stops)
        _say(f"draft vocabulary: {size} of {target.vocab_size} tokens, covering {vocab.coverage * 100:.2f}% "
             "of the answer tokens")

    result = stage_train(cfg, target, work, train_shards, val_shards, aux_ids, vocab, progress)

    report: dict[str, Any] = {
        "target": cfg.model,
        "method": cfg.method,
        "command": "phalanx train-eagle " + " ".join(argv) if argv is not None else None,
        "settings": {k: _jsonable(v) for k, v in asdict(cfg).items() if k not in ("out", "work_dir", "overwrite",
                                                                                 "restart", "keep_work_dir", "stop_after")},
        "prompts": {"source": cfg.prompts or f"phalanx.training.prompts (built-in, seed {cfg.seed})",
                    "train": len(ps.train), "held_out": len(ps.held_out),
                    "skipped_rows": len(json.loads(work.file("skipped-rows.json").read_text()))
                    if work.file("skipped-rows.json").exists() else 0},
        "answers": {"train": len(train_answers), "validation": len(val_answers), "answer_tokens": ans_tokens},
        "training": {"steps": result.steps, **result.extra, "seconds": round(result.seconds, 1),
                     "validation": result.val},
        "aux_layer_ids": list(aux_ids) if eagle3 else None,
        "draft_vocab": {"size": len(vocab.keep), "coverage": round(vocab.coverage, 5)} if vocab else None,
    }
    candidate = work.path / "candidate"
    from phalanx.training.head import save_head

    save_head(result.head, result.head_cfg, candidate)
    if cfg.eval_prompts and ps.held_out:
        with _Stage(work, "evaluate"):
            _say(f"evaluate: {min(cfg.eval_prompts, len(ps.held_out))} held-out conversations through the engine, "
                 f"k = {cfg.eval_k}, greedy")
            report["acceptance"] = engine_acceptance(target.path, str(candidate), cfg.method,
                                                     ps.held_out[: cfg.eval_prompts], cfg.eval_k, cfg.max_tokens,
                                                     cfg.dtype, cfg.max_len)
        _say(f"evaluate: {json.dumps(report['acceptance'])}")
    report["seconds"] = {**work.times(), "this_run_total": round(time.perf_counter() - t_start, 1)}
    save_head(result.head, result.head_cfg, out, extra=report)
    shutil.rmtree(candidate, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    _say(f"saved {out} ({size / 1e6:.1f} MB)")
    if not cfg.keep_work_dir:
        shutil.rmtree(work.path, ignore_errors=True)
    return report

