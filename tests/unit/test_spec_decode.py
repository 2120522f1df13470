"""Speculative decoding is lossless: spec == no spec for every method and k, acceptance is right
for drafters that always / never agree, and every edge case (clipping, stops inside accepted runs,
chunked prefill, prefix caching, preemption, n > 1, aborts) ends exactly where plain decoding does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.engine.engine_core import EngineCoreRequest
from tests.tiny_models import VOCAB, find_stop_string, make_agreeing_eagle_pair, make_eagle_head, make_model

LENS = [3, 17, 40, 9, 1, 25, 60, 5, 33, 12, 7, 50, 2, 19, 28, 44]
EOS = 0  # the tiny models' eos_token_id


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = make_model("LlamaForCausalLM", root / "target", num_hidden_layers=4)
    return {
        "target": target,
        "draft": make_model("LlamaForCausalLM", root / "draft", seed=5, num_hidden_layers=1),
        "eagle": make_eagle_head(target, root / "eagle", "eagle"),
        "eagle3": make_eagle_head(target, root / "eagle3", "eagle3"),
    }


def _prompts(lens: list[int] = LENS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    # Repetitive prompts give the n-gram proposer something to find.
    out = []
    for n in lens:
        base = torch.randint(3, VOCAB, (max(1, n // 3),), generator=g).tolist()
        out.append({"prompt_token_ids": (base * 3)[:n]})
    return out


def _spec(method: str, models: dict[str, Path], k: int) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    return {"method": method, "model": str(models["draft" if method == "draft_model" else method]),
            "num_speculative_tokens": k}


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> list[list[int]]:
    llm = LLM(str(models["target"]), dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_greedy_spec_equals_no_spec(method: str, k: int, models: dict[str, Path], reference) -> None:  # noqa: ANN001
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec(method, models, k),
              max_num_batched_tokens=96, block_size=8)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.get_metrics()
    assert m["spec_num_drafts"] > 0 and m["spec_num_draft_tokens"] >= m["spec_num_drafts"]


@pytest.mark.parametrize("k", [1, 3])
def test_self_draft_accepts_everything(k: int, models: dict[str, Path], reference) -> None:  # noqa: ANN001
    spec = {"method": "draft_model", "model": str(models["target"]), "num_speculative_tokens": k}
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=spec)
    # 1 + m (k + 1) new tokens: the first from the prompt, then full verification steps, no clipping.
    params = SamplingParams(temperature=0.0, max_tokens=1 + 4 * (k + 1), ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[: params.max_tokens] for r in reference]
    m = llm.get_metrics()
    assert m["spec_num_accepted_tokens"] == m["spec_num_draft_tokens"]
    assert m["spec_mean_acceptance_length"] == pytest.approx(k + 1)
    assert m["spec_acceptance_rate_per_pos"] == pytest.approx([1.0] * k)
    assert all(o.outputs[0].mean_acceptance_length == pytest.approx(k + 1) for o in outs)


def test_agreeing_eagle_head_accepts_everything(tmp_path: Path) -> None:
    target, head = make_agreeing_eagle_pair(tmp_path)
    k = 3
    prompts = _prompts([5, 9, 30, 2], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=1 + 3 * (k + 1), ignore_eos=True)
    ref = LLM(str(target), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), dtype="float32", speculative_config={"model": str(head), "num_speculative_tokens": k})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_metrics()["spec_mean_acceptance_length"] == pytest.approx(k + 1)


def test_random_drafter_low_acceptance_still_exact(models: dict[str, Path], reference) -> None:  # noqa: ANN001
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("draft_model", models, 3))
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.get_metrics()["spec_mean_acceptance_length"] < 1.5


def _self_spec(models: dict[str, Path], k: int = 3, **extra) -> dict:  # noqa: ANN003
    return {"method": "draft_model", "model": str(models["target"]), "num_speculative_tokens": k, **extra}


def test_drafts_clipped_at_max_model_len_and_max_tokens(models: dict[str, Path]) -> None:
    prompts = _prompts([50, 58, 61, 30], seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 2, 3)]
    plain = LLM(str(models["target"]), dtype="float32", max_model_len=64)
    spec = LLM(str(models["target"]), dtype="float32", max_model_len=64, speculative_config=_self_spec(models, 5))
    ref = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].finish_reason == "length"
    caps = [min(p.max_tokens, 64 - len(x["prompt_token_ids"])) for p, x in zip(params, prompts)]
    assert caps[0] < 20  # max_model_len, not max_tokens, ends the first one
    assert [len(g.outputs[0].token_ids) for g in got] == caps


def test_drafter_max_model_len_stops_drafting(models: dict[str, Path], reference) -> None:  # noqa: ANN001
    for method in ("draft_model", "eagle"):
        spec = {**_spec(method, models, 3), "max_model_len": 40}
        llm = LLM(str(models["target"]), dtype="float32", speculative_config=spec)
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        # Requests longer than the drafter's limit never drafted.
        long = [o for o, n in zip(outs, LENS) if n + 3 > 40]
        assert long and all(o.outputs[0].num_draft_tokens == 0 for o in long)
        # ... and the limit is the drafter's, not speculation switched off: the others drafted.
        short = [o for o, n in zip(outs, LENS) if n + 3 <= 40]
        assert short and all(o.outputs[0].num_draft_tokens > 0 for o in short), method


@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_disable_by_batch_size_drafts_only_in_small_batches(method: str, models: dict[str, Path], reference) -> None:  # noqa: ANN001
    """vLLM's `disable_by_batch_size`: no drafts after a step of more than N requests, drafts again
    once the batch shrinks; the output stays exactly the target's."""
    spec = {**_spec(method, models, 3), "disable_by_batch_size": 4}
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=spec, max_num_batched_tokens=512)
    proposer = llm.engine.runner.proposer
    calls: list[tuple[int, int]] = []  # (requests in the step, requests given drafts)
    propose = proposer.propose

    def spy(batch):  # noqa: ANN001, ANN202
        drafts = propose(batch)
        calls.append((len(batch.req_ids), sum(1 for d in drafts if d)))
        return drafts

    proposer.propose = spy
    # Staggered lengths: the batch shrinks from 16 requests to 1 as they finish.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(9, 25)]
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[:m] for r, m in zip(reference, range(9, 25))]
    assert any(n > 4 for n, _ in calls) and all(d == 0 for n, d in calls if n > 4)
    assert any(d > 0 for n, d in calls if n <= 4)
    assert llm.get_metrics()["spec_num_drafts"] > 0


def test_stop_token_and_stop_string_inside_accepted_run(models: dict[str, Path], reference) -> None:  # noqa: ANN001
    prompts = _prompts()
    spec = LLM(str(models["target"]), dtype="float32", speculative_config=_self_spec(models, 5))
    plain = LLM(str(models["target"]), dtype="float32")
    for i, prompt in enumerate(prompts[:6]):
        stop_tok = reference[i][9]  # well inside a run of 5 accepted drafts
        p = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok])
        a = plain.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        b = spec.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.finish_reason, b.stop_reason) == (a.token_ids, "stop", stop_tok)
    # Stop strings past the first step's tokens (inside a run of drafts). Random byte-level text is
    # often all U+FFFD there; the prompts whose text has a stop string are fixed (fp32, seeded).
    texts = [o.outputs[0].text for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    checked = 0
    for prompt, text in zip(prompts, texts):
        stop = find_stop_string(text, start=12)
        if stop is None or text.index(stop) < 8:
            continue
        p = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
        a = plain.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        b = spec.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert a.text == text[: text.index(stop)]
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, "stop", stop)
        # The request ends at the step whose tokens complete the stop string (as vLLM, the token ids
        # keep the rest of that step: at most k = 5 more than plain decoding's).
        assert b.token_ids[: len(a.token_ids)] == a.token_ids and len(b.token_ids) <= len(a.token_ids) + 5
        checked += 1
    assert checked >= 3, texts


def test_logprobs_come_from_the_target(models: dict[str, Path]) -> None:
    prompts = _prompts()[:5]
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    a = LLM(str(models["target"]), dtype="float32").generate(prompts, p, use_tqdm=False)
    # A random EAGLE head (drafts rejected: recovered tokens) and a self-draft (runs accepted: bonus tokens).
    for spec in (_spec("eagle", models, 3), _self_spec(models, 3)):
        b = LLM(str(models["target"]), dtype="float32", speculative_config=spec).generate(prompts, p, use_tqdm=False)
        assert len(a) == len(b) == 5
        for x, y in zip(a, b):
            assert y.outputs[0].token_ids == x.outputs[0].token_ids
            assert len(x.outputs[0].logprobs) == len(y.outputs[0].logprobs) == 12  # one entry per token
            for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert da.keys() == db.keys() and len(da) >= 3
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank for t in da)
        assert all(o.outputs[0].num_draft_tokens > 0 for o in b)
    assert all(o.outputs[0].num_accepted_tokens > 0 for o in b)  # the self-draft's logprobs of accepted runs


def test_spec_with_chunked_prefill_prefix_cache_and_preemption(models: dict[str, Path], reference) -> None:  # noqa: ANN001
    spec = _self_spec(models, 3)
    chunked = LLM(str(models["target"]), dtype="float32", speculative_config=spec, max_num_batched_tokens=10)
    assert [o.outputs[0].token_ids for o in chunked.generate(_prompts(), GREEDY, use_tqdm=False)] == reference
    # Prefix cache: the second round hits the cache and still matches.
    cached = LLM(str(models["target"]), dtype="float32", speculative_config=spec, block_size=4)
    cached.generate(_prompts(), GREEDY, use_tqdm=False)
    again = cached.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert sum(o.num_cached_tokens for o in again) > 0
    # Preemption forced by a tiny cache.
    tight = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("eagle", models, 3),
                block_size=4, max_model_len=96, num_kv_blocks=40)
    assert [o.outputs[0].token_ids for o in tight.generate(_prompts(), GREEDY, use_tqdm=False)] == reference
    assert tight.get_metrics()["num_preemptions"] > 0


def test_random_sampling_with_spec_n_samples(models: dict[str, Path]) -> None:
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_spec("draft_model", models, 3))
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    a = llm.generate(_prompts()[:4], params, use_tqdm=False)
    b = llm.generate(_prompts()[:4], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]  # seeded: reproducible
        assert len({tuple(c.token_ids) for c in x.outputs}) == 3
        assert all(len(c.token_ids) == 16 for c in x.outputs)
    # Greedy and random requests mixed in one batch: the greedy ones still match plain decoding.
    mixed = [GREEDY, SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)] * 8
    outs = llm.generate(_prompts(), mixed, use_tqdm=False)
    plain = LLM(str(models["target"]), dtype="float32").generate(_prompts()[::2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[::2]] == [o.outputs[0].token_ids for o in plain]


def test_n_samples_with_spec_end_where_plain_decoding_does(models: dict[str, Path]) -> None:
    """n > 1 with drafts (k = 5, a self-draft accepts whole runs): each greedy sample is exactly plain
    decoding's output, cut at max_tokens or at max_model_len like it; each random sample ends at its
    first stop token (the last token, nowhere before it) or runs to its length cap without one."""
    prompts = _prompts([50, 58, 61, 30, 9], seed=4)
    caps = [min(20, 64 - len(p["prompt_token_ids"])) for p in prompts]  # 14, 6, 3, 20, 20
    plain = LLM(str(models["target"]), dtype="float32", max_model_len=64)
    spec = LLM(str(models["target"]), dtype="float32", max_model_len=64, speculative_config=_self_spec(models, 5))
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    assert [len(r) for r in ref] == caps
    got = spec.generate(prompts, greedy.clone(n=3), use_tqdm=False)
    for r, o in zip(ref, got):
        assert [(c.index, c.token_ids, c.finish_reason) for c in o.outputs] == [(j, r, "length") for j in range(3)]
    assert spec.get_metrics()["spec_num_accepted_tokens"] > 0
    # Random samples with a stop token the target often picks (its greedy 3rd token of each prompt),
    # EOS (token 0) stopping them too.
    stopped = 0
    for prompt, r, cap in zip(prompts, ref, caps):
        stop_tok = r[min(2, len(r) - 1)]
        params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20, stop_token_ids=[stop_tok])
        for c in spec.generate(prompt, params, use_tqdm=False)[0].outputs:
            ends = [i for i, t in enumerate(c.token_ids) if t in (stop_tok, EOS)]
            if c.finish_reason == "stop":
                stopped += c.stop_reason == stop_tok
                assert ends == [len(c.token_ids) - 1], c  # the first stop is the last token
                assert c.stop_reason == (stop_tok if c.token_ids[-1] == stop_tok else None), c  # EOS: None
            else:
                assert (c.finish_reason, len(c.token_ids), ends) == ("length", cap, []), c
    assert stopped > 0  # the stop-token branch ran


def test_abort_mid_run_frees_blocks(models: dict[str, Path], reference) -> None:  # noqa: ANN001
    """Aborted requests end with what they had (a prefix of plain decoding's output), the others
    run on to exactly plain decoding's output, and every block comes back."""
    llm = LLM(str(models["target"]), dtype="float32", speculative_config=_self_spec(models, 3))
    core = llm.engine
    for i, p in enumerate(_prompts()[:6]):
        core.add_request(EngineCoreRequest(f"a{i}", p["prompt_token_ids"], GREEDY))
    tokens: dict[str, list[int]] = {f"a{i}": [] for i in range(6)}
    finish: dict[str, str] = {}

    def step() -> None:
        for o in core.step():
            tokens[o.req_id].extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.req_id] = o.finish_reason

    for _ in range(3):
        step()
    aborted = [f"a{i}" for i in range(0, 6, 2)]
    assert all(0 < len(tokens[r]) < 24 for r in aborted)  # mid-run: some tokens, not all
    core.abort_requests(aborted)
    while core.has_unfinished_requests():
        step()
    step()  # the runner drops finished state on the next schedule
    for i in range(6):
        rid = f"a{i}"
        if rid in aborted:
            assert rid not in finish and tokens[rid] == reference[i][: len(tokens[rid])], rid
        else:
            assert (tokens[rid], finish[rid]) == (reference[i], "length"), rid
    assert core.scheduler.kv.num_free_blocks == core.runner.num_blocks
    assert not core.runner.requests


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs a draft 'model'"),
        ({"method": "medusa", "num_speculative_tokens": 3}, "'medusa' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 3, "foo": 1}, r"unknown speculative config field\(s\) \['foo'\]"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size must be 1"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1},
         "disable_by_batch_size must be an integer >= 2 \\(or null\\), got 1"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": "8"},
         "disable_by_batch_size must be an integer >= 2 \\(or null\\), got '8'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": True},
         "disable_by_batch_size must be an integer >= 2"),
    ],
)
def test_bad_speculative_config(spec: dict, message: str, models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(models["target"]), speculative_config=spec)


def test_incompatible_drafts_rejected(models: dict[str, Path], tmp_path: Path) -> None:
    other_vocab = make_model("LlamaForCausalLM", tmp_path / "v", vocab_size=VOCAB + 10)
    with pytest.raises(ValueError, match=f"vocabulary \\({VOCAB + 10}\\) differs"):
        LLM(str(models["target"]), speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2})
    wide = make_model("LlamaForCausalLM", tmp_path / "w", hidden_size=128)
    head = make_eagle_head(wide, tmp_path / "wide_eagle", "eagle")
    with pytest.raises(ValueError, match="EAGLE head hidden_size 128 does not match the target's hidden_size 64"):
        LLM(str(models["target"]), speculative_config={"model": str(head), "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError, match="none. does not exist"):
        LLM(str(models["target"]), speculative_config={"model": str(tmp_path / "none"), "num_speculative_tokens": 2})


def test_method_detected_from_checkpoint(models: dict[str, Path]) -> None:
    from phalanx.config import ModelConfig
    from phalanx.spec_decode.config import SpeculativeConfig

    target = ModelConfig.from_hf(str(models["target"]))
    for name, method in (("eagle", "eagle"), ("eagle3", "eagle3"), ("draft", "draft_model")):
        cfg = SpeculativeConfig.from_dict({"model": str(models[name]), "num_speculative_tokens": 2}, target)
        assert cfg.method == method
