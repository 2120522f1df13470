"""The `phalanx train-eagle` command's flags and its run (``entrypoints.cli`` hooks them in).

Owns: flag names, help and defaults, turning flags into a `TrainEagleConfig`, and exit codes:
0 done, 1 a failure while running, 2 a setting or input the trainer cannot use, 130 interrupted
(the same command resumes).
Does not own: the training (``training.eagle``).
"""

from __future__ import annotations

import argparse
import sys

from phalanx.training.config import DEFAULT_NUM_PROMPTS, TrainEagleConfig, TrainEagleError

DESCRIPTION = (
    "Train an EAGLE-1 or EAGLE-3 draft head for MODEL by self-distillation: the target answers a prompt set, "
    "its hidden states over prompt + answer are recorded (bf16 shards on disk), and the head learns EAGLE's "
    "objective (feature regression + token cross-entropy, unrolled over several drafting passes). The output "
    "is a head folder in vLLM's format (config.json + model.safetensors; EAGLE-3 with a reduced vocabulary "
    "and d2t), usable as --speculative-config '{\"method\": \"eagle3\", \"model\": OUT, ...}'. Interrupted "
    "runs resume when the same command is run again."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainEagleConfig.__dataclass_fields__  # defaults shown in --help come from the config itself

    def default(name: str) -> object:
        return d[name].default

    p.add_argument("model", metavar="MODEL",
                   help="the target: a Hugging Face folder, a .gguf file, a hub id or a built-in name")
    p.add_argument("--out", required=True, help="the head folder to write (refused if it exists, see --overwrite)")
    p.add_argument("--method", choices=["eagle", "eagle3"], default=default("method"))
    g = p.add_argument_group("data")
    g.add_argument("--prompts", default=None, metavar="JSONL",
                   help="prompts or conversations, one JSON object a line: {\"prompt\": ...} or "
                        "{\"messages\": [{\"role\", \"content\"}, ...]}; bad rows are skipped and counted "
                        "(default: phalanx's built-in generated chat prompts)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"built-in prompts to generate (default {DEFAULT_NUM_PROMPTS}); with --prompts: use the "
                        "first N rows (default: all)")
    g.add_argument("--held-out-fraction", type=float, default=default("held_out_fraction"),
                   help="prompts never trained on (validation and the final acceptance check)")
    g.add_argument("--val-prompts", type=int, default=default("val_prompts"),
                   help="held-out prompts answered for the validation loss")
    g.add_argument("--max-tokens", type=int, default=default("max_tokens"), help="answer length cap")
    g.add_argument("--max-len", type=int, default=default("max_len"), help="prompt + answer tokens per sequence")
    g.add_argument("--temperature", type=float, default=default("temperature"),
                   help="the target's sampling temperature for its answers (0: greedy)")
    g.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=default("dtype"),
                   help="the target's dtype while answering and recording features (serve it in the same)")
    g.add_argument("--gen-batch", type=int, default=default("gen_batch"), help="requests in flight while answering")
    g.add_argument("--aux-layer-ids", default=None, metavar="A,B,C",
                   help="EAGLE-3: the three target layers the head reads (default: 1, the middle, the last)")
    h = p.add_argument_group("head")
    h.add_argument("--draft-vocab", type=int, default=None,
                   help="EAGLE-3: the reduced vocabulary's size (the most frequent answer tokens; default "
                        "min(vocab, 32768)); smaller drafts faster")
    h.add_argument("--num-layers", type=int, default=default("num_layers"), help="decoder layers in the head")
    h.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    h.add_argument("--num-heads", type=int, default=None, help="attention heads (default: the target's)")
    h.add_argument("--num-kv-heads", type=int, default=None, help="key/value heads (default: the target's)")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=default("epochs"))
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    t.add_argument("--batch-tokens", type=int, default=default("batch_tokens"), help="padded tokens per batch")
    t.add_argument("--lr", type=float, default=default("lr"), help="peak learning rate (warm-up, then cosine)")
    t.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 5%% of the steps, at most 200)")
    t.add_argument("--passes", type=int, default=default("passes"),
                   help="drafting passes unrolled in training (train for the k you serve with)")
    t.add_argument("--labels", choices=["soft", "hard"], default=None,
                   help="token loss against the target's distribution (soft, EAGLE-3's default) or its greedy "
                        "token (hard, EAGLE-1's default)")
    t.add_argument("--threads", type=int, default=default("threads"), help="torch threads")
    t.add_argument("--seed", type=int, default=default("seed"))
    t.add_argument("--eval-every", type=int, default=default("eval_every"), help="validation every N steps")
    t.add_argument("--checkpoint-every", type=int, default=default("checkpoint_every"),
                   help="save a resumable checkpoint every N steps")
    t.add_argument("--window", type=int, default=default("window"), help="feature shards in memory at once")
    e = p.add_argument_group("evaluation and files")
    e.add_argument("--eval-prompts", type=int, default=default("eval_prompts"),
                   help="held-out prompts served with the head at the end to measure acceptance (0: skip)")
    e.add_argument("--eval-k", type=int, default=default("eval_k"), help="draft tokens per step in that check")
    e.add_argument("--work-dir", default=None, help="answers, features and checkpoints (default: OUT.work)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    e.add_argument("--restart", action="store_true", help="discard the work directory and start over")
    e.add_argument("--no-keep-work-dir", dest="keep_work_dir", action="store_false",
                   help="delete the work directory (answers, features) after success")
    e.add_argument("--stop-after", choices=["answers", "features"], default=None,
                   help="prepare the data only (run again without it to train)")
    e.add_argument("--quiet", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> TrainEagleConfig:
    aux = None
    if args.aux_layer_ids:
        try:
            aux = tuple(int(x) for x in args.aux_layer_ids.split(","))
        except ValueError:
            raise TrainEagleError(f"--aux-layer-ids {args.aux_layer_ids!r} must be comma-separated integers") from None
    return TrainEagleConfig(
        model=args.model, out=args.out, method=args.method, prompts=args.prompts, num_prompts=args.num_prompts,
        held_out_fraction=args.held_out_fraction, val_prompts=args.val_prompts, max_tokens=args.max_tokens,
        max_len=args.max_len, temperature=args.temperature, dtype=args.dtype, gen_batch=args.gen_batch,
        aux_layer_ids=aux, draft_vocab=args.draft_vocab, num_layers=args.num_layers,
        intermediate_size=args.intermediate_size, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        epochs=args.epochs, steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, warmup=args.warmup,
        passes=args.passes, labels=args.labels, window=args.window, threads=args.threads, seed=args.seed,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, eval_prompts=args.eval_prompts,
        eval_k=args.eval_k, work_dir=args.work_dir, overwrite=args.overwrite, restart=args.restart,
        keep_work_dir=args.keep_work_dir, stop_after=args.stop_after,
    )


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from phalanx.training.eagle import train_eagle

    try:
        cfg = config_from_args(args)
        train_eagle(cfg, progress=not args.quiet, argv=argv)
    except TrainEagleError as e:
        print(f"phalanx train-eagle: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phalanx train-eagle: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0
