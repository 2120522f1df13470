"""`phalanx train-eagle`'s settings: `TrainEagleConfig` (frozen, every field validated on construction,
errors naming the value and what is valid) and `TrainEagleError`.

Owns: the settings and their defaults, which of them define the data in a work directory
(`DATA_FIELDS`: a resumed run must match them) and which the training (`TRAIN_FIELDS`: a change
restarts training on the same data). Does not own: running anything (``training.eagle``).
Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

METHODS = ("eagle", "eagle3")
DEFAULT_NUM_PROMPTS = 4000  # built-in prompt set


class TrainEagleError(Exception):
    """A setting, input or state the trainer cannot use; the message says what and what would work."""


@dataclass(frozen=True)
class TrainEagleConfig:
    model: str  # the target: HF folder, .gguf, hub id or built-in name
    out: str  # the head folder to write
    method: str = "eagle3"
    # data
    prompts: str | None = None  # JSONL of prompts or conversations; None: the built-in generator
    num_prompts: int | None = None  # built-in: how many to generate (default 4000); a file: its first N rows
    held_out_fraction: float = 0.05
    val_prompts: int = 48  # held-out conversations answered for the validation loss
    max_tokens: int = 320  # answer length cap
    max_len: int = 1024  # prompt + answer tokens kept per sequence
    temperature: float = 0.0  # 0: the target's greedy answers (what greedy serving verifies)
    dtype: str = "bfloat16"  # the target's dtype for answers and features (serve it in the same)
    gen_batch: int = 64  # requests in flight while answering
    aux_layer_ids: tuple[int, ...] | None = None  # EAGLE-3: target layers (default low, middle, last)
    # head
    draft_vocab: int | None = None  # EAGLE-3's reduced vocabulary (default min(vocab, 32768))
    num_layers: int = 1
    intermediate_size: int | None = None  # default: the target's
    num_heads: int | None = None  # attention heads (default: the target's; head_dim stays the target's)
    num_kv_heads: int | None = None
    # training
    epochs: float = 2.0
    steps: int | None = None  # overrides epochs
    batch_tokens: int = 4096  # padded tokens per batch
    lr: float = 1e-3
    warmup: int | None = None  # default: 5% of the steps, at most 200
    passes: int = 3  # drafting passes unrolled (training-time test)
    labels: str | None = None  # soft (default for EAGLE-3) | hard (default for EAGLE-1)
    window: int = 4  # shards in memory at once
    shard_tokens: int = 16384
    threads: int = 2
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 100
    # evaluation and files
    eval_prompts: int = 32  # held-out conversations served with the head at the end (0: skip)
    eval_k: int = 3
    work_dir: str | None = None  # default: OUT + ".work"
    overwrite: bool = False  # replace an existing OUT
    restart: bool = False  # discard the work directory's data and start over
    keep_work_dir: bool = True
    stop_after: str | None = None  # "answers" | "features": prepare the data only

    def __post_init__(self) -> None:
        def bad(name: str, value: object, valid: str) -> TrainEagleError:
            return TrainEagleError(f"{name} = {value!r} is invalid: {valid}")

        if self.method not in METHODS:
            raise bad("method", self.method, f"one of {list(METHODS)}")
        for name in ("num_layers", "max_tokens", "max_len", "gen_batch", "batch_tokens", "passes", "window",
                     "shard_tokens", "threads", "eval_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, v, "an integer >= 1")
        for name in ("val_prompts", "eval_prompts", "eval_every", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise bad(name, v, "an integer >= 0")
        if self.num_prompts is not None and (not isinstance(self.num_prompts, int) or self.num_prompts < 1):
            raise bad("num_prompts", self.num_prompts, "an integer >= 1 (or unset)")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise bad("held_out_fraction", self.held_out_fraction, "a fraction in [0, 1)")
        if self.max_len <= self.max_tokens:
            raise bad("max_len", self.max_len, f"larger than max_tokens ({self.max_tokens}) to leave room for the prompt")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", self.temperature, "in [0, 2]")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise bad("dtype", self.dtype, "bfloat16, float32 or float16")
        for name in ("draft_vocab", "intermediate_size", "num_heads", "num_kv_heads", "steps", "warmup"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < (0 if name == "warmup" else 1)):
                raise bad(name, v, "a positive integer (or unset)")
        if self.draft_vocab is not None and self.method != "eagle3":
            raise bad("draft_vocab", self.draft_vocab, "EAGLE-3 only (an EAGLE-1 head drafts with the target's lm_head)")
        if self.aux_layer_ids is not None and (self.method != "eagle3" or len(self.aux_layer_ids) != 3):
            raise bad("aux_layer_ids", self.aux_layer_ids, "three target layer ids, EAGLE-3 only")
        if not self.epochs > 0:
            raise bad("epochs", self.epochs, "> 0")
        if not self.lr > 0:
            raise bad("lr", self.lr, "> 0")
        if self.stop_after not in (None, "answers", "features"):
            raise bad("stop_after", self.stop_after, "'answers' or 'features'")
        if self.labels not in (None, "soft", "hard"):
            raise bad("labels", self.labels, "'soft' or 'hard'")

    @property
    def label_kind(self) -> str:
        return self.labels or ("soft" if self.method == "eagle3" else "hard")

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(str(Path(self.out)) + ".work")

    # settings that define the data in the work directory (a resumed run must match them)
    # (not num_prompts: both prompt sources are prefix-stable, so the prompt list may grow or shrink
    # between runs and every answer already made for a prompt still in it is kept)
    DATA_FIELDS = ("method", "prompts", "held_out_fraction", "val_prompts", "max_tokens", "max_len",
                   "temperature", "dtype", "aux_layer_ids", "seed", "shard_tokens")
    # settings that define the training (a change restarts training on the same data)
    TRAIN_FIELDS = ("draft_vocab", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "epochs", "steps",
                    "batch_tokens", "lr", "warmup", "passes", "labels", "window", "seed")
