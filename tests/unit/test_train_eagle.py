"""`phalanx train-eagle` on a tiny random target: the whole pipeline (prompts, the target's answers,
feature shards, training with the training-time test, the saved head) and its pieces.

A trained head must learn (validation loss falls, top-1 agreement rises), load in phalanx's engine,
draft losslessly and beat a random head's acceptance; its folder must be what vLLM loads. Bad input
gets a clear error (or skipped and counted rows), an existing output is refused, an interrupted
run resumes to the same head as an uninterrupted one, and no half-written head is ever loadable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.training.config import TrainEagleConfig, TrainEagleError
from phalanx.training.eagle import draft_vocabulary, train_eagle
from phalanx.training.features import FeatureShards, epoch_plan, make_batch, sequence
from phalanx.training.objective import IGNORE, chain_acceptance, expected_acceptance_length
from phalanx.training.prompts import builtin_prompt_set, builtin_prompts, read_prompt_file, split_of
from tests.tiny_models import make_eagle_head, make_model

VOCAB = 320
# Small enough to run in about a minute on 2 cores: 80 prompts, 24-token answers.
TINY = dict(num_prompts=80, max_tokens=24, max_len=128, val_prompts=4, eval_prompts=6, batch_tokens=512,
            dtype="float32", threads=2, eval_every=40, checkpoint_every=20, shard_tokens=1024, window=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # EOS is a rare id, so the random target's answers run to max_tokens instead of stopping at once
    return make_model("LlamaForCausalLM", tmp_path_factory.mktemp("train_eagle") / "target", num_hidden_layers=4,
                      eos_token_id=VOCAB - 1)


@pytest.fixture(scope="module")
def trained(target: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("trained") / "head"
    report = train_eagle(TrainEagleConfig(model=str(target), out=str(out), method="eagle3", steps=120, lr=3e-3,
                                          draft_vocab=200, **TINY), progress=False)
    return out, report


# ---- the pipeline ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_agreement(trained: tuple[Path, dict]) -> None:
    out, report = trained
    val = [json.loads(line) for line in (Path(str(out) + ".work") / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in val] == [40, 80, 120]
    assert val[-1]["loss"] < val[0]["loss"]
    assert val[-1]["acc"][0] > val[0]["acc"][0]
    assert report["training"]["steps"] == 120 and report["training"]["validation"] == val[-1]


@pytest.mark.slow
def test_saved_head_is_in_vllms_eagle3_format(trained: tuple[Path, dict], target: Path) -> None:
    from safetensors import safe_open

    out, report = trained
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "training.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert cfg["draft_vocab_size"] == 200 and cfg["target_hidden_size"] == cfg["hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert set(w) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                      *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                         "mlp.down_proj"))}
    assert all(t.dtype == torch.bfloat16 for k, t in w.items() if k not in ("d2t", "t2d"))
    assert w["fc.weight"].shape == (64, 3 * 64) and w["lm_head.weight"].shape == (200, 64)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)  # EAGLE-3 attends over [embed; hidden]
    # d2t: target id = draft id + d2t[draft id], increasing; t2d marks exactly those ids
    ids = torch.arange(200) + w["d2t"]
    assert w["d2t"].dtype == torch.int64 and bool((ids[1:] > ids[:-1]).all())
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (VOCAB,)
    assert torch.equal(torch.nonzero(w["t2d"]).flatten(), ids)
    assert bool(w["t2d"][VOCAB - 1])  # the stop token is always draftable
    assert report["draft_vocab"]["size"] == 200 and 0.5 < report["draft_vocab"]["coverage"] <= 1.0


@pytest.mark.slow
def test_trained_head_drafts_losslessly_and_beats_a_random_head(trained: tuple[Path, dict], target: Path,
                                                                  tmp_path: Path) -> None:
    from phalanx import LLM, SamplingParams
    from phalanx.training.eagle import engine_acceptance
    from phalanx.training.prompts import builtin_prompt_set

    out, report = trained
    held = builtin_prompt_set(80, 0, 0.05).held_out
    assert report["acceptance"]["prompts"] == len(held[:6]) > 0
    random_head = make_eagle_head(target, tmp_path / "random", "eagle3")
    args = (held[:6], 3, 24, "float32", 128)
    mine = engine_acceptance(str(target), str(out), "eagle3", *args)
    rand = engine_acceptance(str(target), str(random_head), "eagle3", *args)
    assert mine == report["acceptance"]  # what the trainer reported is what the engine does
    assert mine["mean_acceptance_length"] > rand["mean_acceptance_length"] + 0.2, (mine, rand)
    # the trainer's teacher-forced estimate (chain_acceptance) on the engine's own answers to these
    # prompts predicts what the engine accepted
    stats = _teacher_forced_stats(target, out, held[:6], max_tokens=24)
    assert stats.chain_steps == pytest.approx(mine["verification_steps"], rel=0.05)
    assert stats.acceptance_length == pytest.approx(mine["mean_acceptance_length"], abs=0.05), (stats.summary(), mine)
    # drafting changes nothing in the output (fp32, greedy)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(target), dtype="float32").generate(prompts, params, use_tqdm=False)
    spec = LLM(str(target), dtype="float32", speculative_config={"model": str(out), "num_speculative_tokens": 3}
               ).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def _teacher_forced_stats(target: Path, head_dir: Path, convs: list, max_tokens: int):  # noqa: ANN202
    """The objective's statistics for a saved EAGLE-3 head over the target's greedy answers to `convs`
    (fp32), with the features recorded as the trainer records them."""
    from phalanx import LLM, SamplingParams
    from phalanx.training.distill import _forward, load_target, prompt_token_ids
    from phalanx.training.features import Sequence
    from phalanx.training.head import load_head
    from phalanx.training.objective import LossStats, Objective

    llm = LLM(str(target), dtype="float32")
    prompts = [prompt_token_ids(llm.get_tokenizer(), c) for c in convs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    model = load_target(str(target), "float32")
    cfg = json.loads((head_dir / "config.json").read_text())
    seqs = []
    for p, o in zip(prompts, outs, strict=True):
        ids = p + list(o.outputs[0].token_ids)
        final, aux, greedy = _forward(model, [ids], tuple(cfg["eagle_aux_hidden_state_layer_ids"]))
        seqs.append(Sequence(torch.tensor(ids), greedy.long(), final, aux, len(p)))
    from safetensors.torch import load_file

    w = load_file(str(target / "model.safetensors"))
    head = load_head(head_dir, embed=w["model.embed_tokens.weight"].float(), lm_head=w["lm_head.weight"].float())
    keep = torch.arange(len(head.d2t)) + head.d2t
    to_draft = torch.full((cfg["vocab_size"],), IGNORE).index_put_((keep,), torch.arange(len(keep)))
    stats = LossStats()
    with torch.no_grad():
        stats.add(Objective(passes=3, labels="hard")(head, make_batch(seqs), None, to_draft)[1])
    return stats


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_head(target: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE-1: data once, then (a) 30 steps straight and (b) 30 steps interrupted at step 15 and run
    again: (b) resumes from its step-10 checkpoint, reuses the answers, and ends bitwise equal to (a).
    While interrupted, nothing at OUT exists and the work directory holds no head folder."""
    from safetensors.torch import load_file

    from phalanx.training import loop

    kw = dict(TINY, method="eagle", steps=30, checkpoint_every=10, eval_every=30, eval_prompts=0)
    data = tmp_path / "data.work"
    train_eagle(TrainEagleConfig(model=str(target), out=str(tmp_path / "unused"), work_dir=str(data),
                                 stop_after="features", **kw), progress=False)
    for name in ("a", "b"):
        shutil.copytree(data, tmp_path / f"{name}.work")
    train_eagle(TrainEagleConfig(model=str(target), out=str(tmp_path / "a"), **kw), progress=False)

    answers = (tmp_path / "b.work" / "answers-train.jsonl").read_bytes()
    real_step = loop.TrainLoop.train_step
    calls = {"n": 0}

    def interrupted(self, batch):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 16:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(loop.TrainLoop, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_eagle(TrainEagleConfig(model=str(target), out=str(tmp_path / "b"), **kw), progress=False)
    assert not (tmp_path / "b").exists()
    assert not list((tmp_path / "b.work").rglob("config.json"))  # no loadable head anywhere
    blob = torch.load(tmp_path / "b.work" / "checkpoint.pt", weights_only=True)
    assert blob["loop"]["step"] == 10
    monkeypatch.setattr(loop.TrainLoop, "train_step", real_step)
    train_eagle(TrainEagleConfig(model=str(target), out=str(tmp_path / "b"), **kw), progress=False)
    assert (tmp_path / "b.work" / "answers-train.jsonl").read_bytes() == answers
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and "lm_head.weight" not in b  # the target's lm_head


# ---- bad input ------------------------------------------------------------------------------------
def test_existing_output_is_refused_without_overwrite(target: Path, tmp_path: Path) -> None:
    from phalanx.entrypoints.cli import main

    out = tmp_path / "head"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(TrainEagleError, match="exists; pass --overwrite"):
        train_eagle(TrainEagleConfig(model=str(target), out=str(out), **TINY), progress=False)
    assert main(["train-eagle", str(target), "--out", str(out)]) == 2
    assert (out / "keep.txt").read_text() == "mine" and not Path(str(out) + ".work").exists()


@pytest.mark.parametrize("make", ["missing", "not-a-model", "bad-architecture"])
def test_a_target_the_trainer_cannot_read_is_a_clear_error(make: str, tmp_path: Path) -> None:
    path = tmp_path / "t"
    if make != "missing":
        path.mkdir()
        (path / "config.json").write_text("{}" if make == "bad-architecture" else "not json")
    cfg = TrainEagleConfig(model=str(path), out=str(tmp_path / "head"), **TINY)
    with pytest.raises(TrainEagleError, match="target") as e:
        train_eagle(cfg, progress=False)
    assert str(path) in str(e.value)
    assert not (tmp_path / "head.work").exists()


@pytest.mark.parametrize("field,value,message", [
    ("method", "medusa", "method = 'medusa' is invalid"),
    ("max_len", 16, "larger than max_tokens"),
    ("draft_vocab", 0, "draft_vocab = 0 is invalid"),
    ("held_out_fraction", 1.0, "fraction in"),
])
def test_settings_are_checked_at_the_boundary(field: str, value: object, message: str) -> None:
    with pytest.raises(TrainEagleError, match=message):
        TrainEagleConfig(model="m", out="o", **{**TINY, field: value})


def test_eagle1_has_no_draft_vocabulary() -> None:
    with pytest.raises(TrainEagleError, match="EAGLE-3 only"):
        TrainEagleConfig(model="m", out="o", method="eagle", draft_vocab=100)


def _bad_rows_file(path: Path) -> Path:
    rows = ['{"prompt": "What is a cat?"}', "not json at all", '{"messages": [{"role": "user", "content": "Hi"}]}',
            '{"prompt": ""}', '{"messages": [{"role": "robot", "content": "x"}]}', "",
            '[{"role": "user", "content": "List two birds."}, {"role": "assistant", "content": "Owl, crow."}]',
            '{"text": 5}', '{"answer": "no prompt"}', '{"prompt": "What is a cat?"}']
    path.write_text("\n".join(rows) + "\n")
    return path


def test_prompt_file_bad_rows_are_skipped_and_counted_with_line_numbers(tmp_path: Path) -> None:
    ps = read_prompt_file(_bad_rows_file(tmp_path / "p.jsonl"), held_out_fraction=0.0)
    assert [n for n, _ in ps.skipped] == [2, 4, 5, 8, 9]
    assert "not valid JSON" in ps.skipped[0][1] and "robot" in ps.skipped[2][1]
    assert [c[-1]["content"] for c in ps.train] == ["What is a cat?", "Hi", "List two birds."]  # duplicate once
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not valid JSON"):
        read_prompt_file(tmp_path / "p.jsonl", strict=True)
    (tmp_path / "bad.jsonl").write_text("nope\n[]\n")
    with pytest.raises(ValueError, match="no usable row .2 bad rows, first at line 1"):
        read_prompt_file(tmp_path / "bad.jsonl")


def test_prompt_file_rows_reach_the_trainer_and_the_skips_are_recorded(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "head"
    cfg = TrainEagleConfig(model=str(target), out=str(out), prompts=str(_bad_rows_file(tmp_path / "p.jsonl")),
                           held_out_fraction=0.0, stop_after="answers", **{**TINY, "num_prompts": None})
    train_eagle(cfg, progress=False)
    work = Path(str(out) + ".work")
    assert [n for n, _ in json.loads((work / "skipped-rows.json").read_text())] == [2, 4, 5, 8, 9]
    assert len((work / "answers-train.jsonl").read_text().splitlines()) == 3
    assert not out.exists()  # stopped after the answers: no head


def test_work_dir_made_with_other_data_settings_is_refused(target: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "run.json").write_text(json.dumps({"max_tokens": 999}))
    cfg = TrainEagleConfig(model=str(target), out=str(tmp_path / "h"), work_dir=str(work), **TINY)
    with pytest.raises(TrainEagleError, match=r"other settings \(.*max_tokens: 999 there, 24 now.*--restart"):
        train_eagle(cfg, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(TrainEagleError, match="not a train-eagle work directory"):
        train_eagle(TrainEagleConfig(model=str(target), out=str(tmp_path / "h"), work_dir=str(tmp_path / "other"),
                                     **TINY), progress=False)


# ---- the pieces -----------------------------------------------------------------------------------
def test_builtin_prompts_are_seeded_distinct_and_prefix_stable() -> None:
    a, b = builtin_prompts(300, seed=0), builtin_prompts(500, seed=0)
    assert a == b[:300] and a != builtin_prompts(300, seed=1)
    texts = [c[-1]["content"] for c in b]
    assert len(set(texts)) == len(texts)
    assert all(c[-1]["role"] == "user" for c in b) and any(c[0]["role"] == "system" for c in b)
    small, big = builtin_prompt_set(300), builtin_prompt_set(500)
    assert small.train == big.train[: len(small.train)] and small.held_out == big.held_out[: len(small.held_out)]
    assert 0.01 < len(big.held_out) / 500 < 0.1
    assert all(split_of(c, 0.05) == "held_out" for c in big.held_out)


def test_epoch_plan_covers_every_sequence_once_within_the_token_budget(tmp_path: Path) -> None:
    lengths = [[30, 90, 12, 50], [70, 8], [41, 41, 41], [100]]
    shards = FeatureShards([tmp_path / f"s{i}" for i in range(4)], lengths)
    plan = epoch_plan(shards, batch_tokens=128, window=2, seed=3, epoch=0, max_len=1000)
    refs = [r for pb in plan for r in pb.refs]
    assert sorted(refs) == sorted((s, j) for s, ls in enumerate(lengths) for j in range(len(ls)))
    for pb in plan:
        assert len(pb.refs) * max(lengths[s][j] for s, j in pb.refs) <= 128
        assert {s for s, _ in pb.refs} <= set(pb.window) and len(pb.window) <= 2
    assert plan == epoch_plan(shards, 128, 2, 3, 0, 1000)  # a resumed run sees the same batches
    assert plan != epoch_plan(shards, 128, 2, 3, 1, 1000)


def test_make_batch_aligns_tokens_features_and_labels() -> None:
    """[p0 p1 | a0 a1 a2] (answer from index 2): position t is fed x_{t+1} and the feature at t and
    learns the target's greedy token at t + 1, for t = 0 .. 2 (the tokens a0, a1, a2 are predicted)."""
    n, h = 5, 2
    shard = {"tokens": torch.tensor([10, 11, 20, 21, 22], dtype=torch.int32), "offsets": torch.tensor([0, 5]),
             "answer_start": torch.tensor([2]), "greedy": torch.tensor([50, 20, 21, 22, 99], dtype=torch.int32),
             "final": torch.arange(n * h, dtype=torch.float32).reshape(n, h).to(torch.bfloat16)}
    b = make_batch([sequence(shard, 0, aux=False, max_len=100)])
    assert b.tokens.tolist() == [[11, 20, 21, 22]]
    assert b.labels.tolist() == [[20, 21, 22, IGNORE]]
    assert torch.equal(b.features[0], shard["final"][:4].float())
    assert torch.equal(b.next_final[0], shard["final"][1:].float())
    assert b.first_draft.tolist() == [1]  # the engine's first chain is fed a0 (a1 is its first draft)
    shard["answer_start"] = torch.tensor([4])  # only a2 is an answer token: only t = 2 learns
    assert make_batch([sequence(shard, 0, aux=False, max_len=100)]).labels.tolist() == [[IGNORE, IGNORE, 22, IGNORE]]


def test_draft_vocabulary_keeps_the_most_frequent_tokens_and_the_stop_tokens() -> None:
    counts = torch.tensor([0, 50, 3, 20, 0, 7, 1])
    v = draft_vocabulary(counts, 3, always=(4,))
    assert v.keep.tolist() == [1, 3, 4]
    assert v.coverage == pytest.approx(70 / 81)
    assert (torch.arange(3) + v.d2t).tolist() == [1, 3, 4]
    assert v.target_to_draft(7).tolist() == [IGNORE, 0, IGNORE, 1, 2, IGNORE, IGNORE]


def test_chain_acceptance_follows_the_engines_chains() -> None:
    """k = 3 over one row of 10 labelled positions, the chains worked out by hand: a chain from s
    accepts pass j at s + j while they hit; the next chain starts after the accepted drafts and the
    target's own token."""
    T = 10
    h0 = torch.tensor([1, 1, 0, 0, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    h1 = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    h2 = torch.tensor([0, 0, 1, 0, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    lab = torch.ones(1, T, dtype=torch.bool)
    # s=0: h0[0] h1[1] h2[2] all hit -> 3, next s=4; s=4: h0[4] h1[5] hit, h2[6] misses -> 2, next 7;
    # s=7: h0[7] misses -> 0, next 8; s=8: misses -> 0, next 9; s=9: h0[9] hits, h1[10] is past the end
    steps, acc = chain_acceptance([h0[None], h1[None], h2[None]], lab)
    assert (steps, acc) == (5, [3, 2, 1])
    # the first chain where the batch says (s=1: h0[1] h1[2] hit, h2[3] misses -> 2, next 4; then as above)
    assert chain_acceptance([h0[None], h1[None], h2[None]], lab, torch.tensor([1])) == (5, [3, 2, 0])
    # an unlabelled position ends the row's chains: nothing is drafted past the answer
    cut = lab.clone()
    cut[0, 5:] = False
    assert chain_acceptance([h0[None], h1[None], h2[None]], cut) == (2, [2, 1, 1])
    # every draft hits: chains of k + 1 tokens; none hits: one chain per token
    ones = [torch.ones(2, 8, dtype=torch.bool)] * 3
    assert chain_acceptance(ones, torch.ones(2, 8, dtype=torch.bool)) == (4, [4, 4, 4])
    assert chain_acceptance([~o for o in ones], torch.ones(2, 8, dtype=torch.bool)) == (16, [0, 0, 0])


def test_expected_acceptance_length() -> None:
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_acceptance_length([0.0, 1.0]) == 1.0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_smaller_than_the_target_runs_the_same_in_the_engine(method: str, target: Path, tmp_path: Path) -> None:
    """The trainer's head config may narrow the MLP and use fewer attention heads (the committed
    SmolLM2 head does): the engine's head computes what the trainer's head computes."""
    from phalanx.attention.metadata import build_attention_metadata
    from phalanx.config import ModelConfig
    from phalanx.models.eagle import load_eagle_head
    from phalanx.models.registry import load_model
    from phalanx.training.head import EagleHead, head_config, load_head, save_head
    from phalanx.worker.model_runner import allocate_kv_caches
    from tests.tiny_models import load_hf

    hf = load_hf(target)
    eagle3 = method == "eagle3"
    cfg = head_config(hf.config.to_dict(), eagle3, 100 if eagle3 else None, [1, 2, 4] if eagle3 else None,
                      intermediate_size=40, num_heads=2, num_kv_heads=1)
    torch.manual_seed(0)
    emb, lm = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    head = EagleHead(cfg, eagle3, emb, lm)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
        if eagle3:
            head.d2t.copy_(torch.arange(100) * 2 - torch.arange(100))
    save_head(head, cfg, tmp_path / "h")
    ref = load_head(tmp_path / "h", hf)  # the bf16-rounded weights, as the engine reads them
    mcfg = ModelConfig.from_hf(str(target), "float32")
    engine_head = load_eagle_head(str(tmp_path / "h"), method, load_model(mcfg))
    assert engine_head.config.num_heads == 2 and engine_head.config.intermediate_size == 40
    t = 9
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (t,), generator=g)
    feats = torch.randn(t, 64, generator=g)
    ecfg = engine_head.config
    kv = allocate_kv_caches([(ecfg.num_kv_heads, ecfg.head_dim)], 4, 4, torch.float32)
    meta = build_attention_metadata(torch.tensor([t]), torch.tensor([0]), torch.tensor([[0, 1, 2]]), 4)
    with torch.inference_mode():
        normed, fed_back = engine_head(tokens, feats, kv, meta)
        drafted = engine_head.draft_token_ids(normed)
    with torch.no_grad():
        pre = ref.causal_forward(tokens, feats)
    torch.testing.assert_close(fed_back, pre, atol=2e-4, rtol=2e-4)
    assert drafted.tolist() == ref.target_logits(pre).argmax(-1).tolist()


@pytest.mark.parametrize("labels", ["soft", "hard"])
@pytest.mark.parametrize("eagle3", [True, False])
def test_objective_equals_the_dense_masked_loss(labels: str, eagle3: bool) -> None:
    """The objective takes logits at labelled positions only; it equals the loss computed over the
    whole [B, T] grid with a mask (its slow path), and its per-pass agreement counts are the same."""
    import torch.nn.functional as F

    from phalanx.training.head import EagleHead, head_config
    from phalanx.training.objective import EagleBatch, Objective

    torch.manual_seed(0)
    h, v, dv, B, T = 16, 40, 24, 3, 11
    tgt = {"hidden_size": h, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 24,
           "vocab_size": v, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
    cfg = head_config(tgt, eagle3, dv if eagle3 else None, [0, 1, 2] if eagle3 else None)
    emb, lm = torch.randn(v, h), torch.randn(v, h)
    head = EagleHead(cfg, eagle3, emb, lm)
    keep = torch.arange(dv) + 10
    to_draft = torch.full((v,), IGNORE).index_put_((keep,), torch.arange(dv)) if eagle3 else None
    if eagle3:
        head.d2t.copy_(keep - torch.arange(dv))
    rows = lm[keep] if eagle3 else lm
    lab = torch.randint(0, v, (B, T))
    lab[0, :4] = IGNORE  # a prompt
    lab[2, 7:] = IGNORE  # padding
    batch = EagleBatch(torch.randint(0, v, (B, T)), torch.randn(B, T, (3 if eagle3 else 1) * h), torch.randn(B, T, h),
                       lab, torch.arange(T)[None].expand(B, T))
    obj = Objective(passes=3, labels=labels)
    loss, stats = obj(head, batch, rows, to_draft)
    # the dense, masked reference
    dl = torch.where(lab >= 0, to_draft[lab.clamp(min=0)], lab) if eagle3 else lab
    outs = head.unrolled(batch.tokens, head.fuse(batch.features), batch.positions, 3)
    teacher = torch.softmax(batch.next_final @ rows.t(), dim=-1)
    total, w = 0.0, [1.0, 0.8, 0.64]
    for j, pre in enumerate(outs):
        valid = lab.clone()
        valid[:, :j] = IGNORE
        m = (valid != IGNORE).unsqueeze(-1).float()
        lj = torch.where(valid != IGNORE, dl, IGNORE)
        lg = head.logits(pre)
        if labels == "soft":
            tok = (-(teacher * torch.log_softmax(lg, -1)).sum(-1, keepdim=True) * m).sum() / m.sum()
        else:
            tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lj.reshape(-1), ignore_index=IGNORE)
        out = head.norm(pre) if eagle3 else pre
        reg = (F.smooth_l1_loss(out, batch.next_final, reduction="none") * m).sum() / (m.sum() * h)
        total = total + w[j] * (reg + 0.5 * tok)
        hits = ((lg.argmax(-1) == lj) & (lj != IGNORE)).sum()
        assert stats.passes[j].correct == int(hits) and stats.passes[j].count == int(m.sum())
    torch.testing.assert_close(loss, total / sum(w), rtol=1e-5, atol=1e-6)


def _dense_unrolled(head, tok: torch.Tensor, feat0: torch.Tensor, pos: torch.Tensor, passes: int) -> list[torch.Tensor]:
    """The training-time test written out with one dense [T, T * (j + 1)] mask per pass (pass 0's
    keys at <= t - j, then pass i's key at t - j + i): the reference for `EagleHead.unrolled`."""
    from phalanx.training.head import rope_cos_sin

    T = tok.shape[1]
    cos, sin = rope_cos_sin(pos, head.layers[0].self_attn.hd, head.cfg["rope_theta"])
    cos, sin = cos[:, None], sin[:, None]
    t = torch.arange(T)
    ks: list[list] = [[] for _ in head.layers]
    vs: list[list] = [[] for _ in head.layers]
    outs, feat = [], feat0
    for j in range(passes):
        mask = torch.cat([t[None, :] <= t[:, None] - j] + [t[None, :] == t[:, None] - j + i for i in range(1, j + 1)],
                         dim=1)
        pre = head.forward_layers(tok, feat, cos, sin, ks, vs, lambda attn, q, k, v, m=mask: attn.attend(q, k, v, m))
        outs.append(pre)
        feat = torch.cat([feat0[:, :1], pre[:, :-1]], dim=1)
    return outs


@pytest.mark.parametrize(("eagle3", "layers", "kv_heads", "T"),
                         [(True, 1, 1, 13), (True, 2, 3, 13), (False, 1, 2, 13), (True, 1, 3, 3)])
def test_unrolled_passes_equal_the_dense_masked_attention(eagle3: bool, layers: int, kv_heads: int, T: int) -> None:
    """Pass j's chain keys are scored as diagonals and pass 0's keys by the causal flash kernel
    (`ChainAttention`), not as j + 1 dense T x T blocks under a mask: the outputs and every
    parameter's gradient equal the dense reference's, at every position (the first j of pass j,
    and sequences shorter than the passes, included)."""
    from phalanx.training.head import EagleHead, head_config

    torch.manual_seed(1)
    h, v, B = 48, 40, 3
    tgt = {"hidden_size": h, "num_attention_heads": 6, "num_key_value_heads": kv_heads, "intermediate_size": 40,
           "vocab_size": v, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
    cfg = head_config(tgt, eagle3, 24 if eagle3 else None, [0, 1, 2] if eagle3 else None, num_layers=layers)
    head = EagleHead(cfg, eagle3, torch.randn(v, h), torch.randn(v, h))
    tok = torch.randint(0, v, (B, T))
    feat = head.fuse(torch.randn(B, T, (3 if eagle3 else 1) * h)).detach()
    pos = (torch.arange(T) + torch.tensor([0, 5, 2])[:, None]).long()  # rows that start mid-sequence, too
    got = head.unrolled(tok, feat, pos, 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the bf16 path: flash and chain in bf16
        low = head.unrolled(tok, feat, pos, 4)
    params = [p for name, p in head.named_parameters() if "layers" in name]  # what the passes use
    grads = torch.autograd.grad(sum((o * (j + 1)).sum() for j, o in enumerate(got)), params)
    want = _dense_unrolled(head, tok, feat, pos, 4)
    ref = torch.autograd.grad(sum((o * (j + 1)).sum() for j, o in enumerate(want)), params)
    for a, b, c in zip(got, want, low, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert float((c.float() - b.detach()).abs().max()) < 0.05 * float(b.detach().abs().max())
    for a, b in zip(grads, ref, strict=True):  # sums over every position and pass: float32 rounding
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_unrolled_pass_j_is_the_jth_draft_of_a_chain_whose_drafts_hit() -> None:
    """Pass j at position t is what drafting computes for its (j + 1)-th token after a chain started
    at t - j whose drafts were the true tokens: a causal forward over the true context up to t - j,
    then the chain's positions fed the true tokens and the head's own outputs as features."""
    from phalanx.training.head import EagleHead, head_config

    torch.manual_seed(2)
    h, v, T = 32, 30, 10
    tgt = {"hidden_size": h, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24,
           "vocab_size": v, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
    head = EagleHead(head_config(tgt, True, 16, [0, 1, 2]), True, torch.randn(v, h), torch.randn(v, h))
    tok = torch.randint(0, v, (T,))
    feat = head.fuse(torch.randn(T, 3 * h)).detach()
    with torch.no_grad():
        outs = head.unrolled(tok[None], feat[None], torch.arange(T)[None], 3)
        for t in (3, 6, 9):
            for j in range(3):
                s = t - j  # the chain's first position
                feats, pre = [feat[: s + 1]], None
                for step in range(j + 1):
                    pre = head.causal_forward(tok[: s + step + 1], torch.cat(feats))[-1]
                    feats.append(pre[None])
                torch.testing.assert_close(outs[j][0, t], pre, rtol=1e-4, atol=1e-5)


def test_soft_cross_entropy_equals_log_softmax_and_its_gradient() -> None:
    """The fused soft-label loss, taken a piece of rows at a time, equals
    -(teacher * log_softmax(logits)).sum() and has its gradient, in float32 and for bf16 logits."""
    from phalanx.training.objective import soft_cross_entropy

    torch.manual_seed(3)
    teacher = torch.softmax(torch.randn(300, 50) * 3, dim=-1)  # 300 rows: pieces of 128, 128 and 44
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        logits = (torch.randn(300, 50) * 4).to(dtype).requires_grad_()
        ref_logits = logits.detach().float().requires_grad_()
        got = soft_cross_entropy(logits, teacher)
        want = -(teacher * torch.log_softmax(ref_logits, dim=-1)).sum()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        (got * 0.5).backward()
        (want * 0.5).backward()
        assert logits.grad.dtype == dtype
        torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=tol, atol=tol)
