"""Each fast path equals its slow path: chunked == unchunked, prefix hit == miss, preempted ==
not preempted, a seeded request alone == inside a batch; n > 1 samples differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from tests.tiny_models import VOCAB, load_hf, make_model, middle_stop_string


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def _prompts(lens: list[int], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lens]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LENS = [5, 30, 17, 64, 2, 45, 9, 23]


def _tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_equals_unchunked(model_dir: Path) -> None:
    prompts = _prompts(LENS)
    whole = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=4096)
    chunked = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(
        whole.generate(prompts, GREEDY, use_tqdm=False)
    )


def test_prefix_hit_equals_miss_and_skips_compute(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    prompts = [{"prompt_token_ids": shared + [10 + i, 20 + i]} for i in range(4)]
    cached = LLM(str(model_dir), dtype="float32", block_size=8)
    uncached = LLM(str(model_dir), dtype="float32", block_size=8, enable_prefix_caching=False)
    ref = _tokens(uncached.generate(prompts, GREEDY, use_tqdm=False))
    cached.generate(prompts[:1], GREEDY, use_tqdm=False)  # warm the cache with the shared prefix
    before = cached.engine.runner.num_tokens_run
    outs = cached.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref
    assert all(o.num_cached_tokens == 40 for o in outs)
    # 4 prompts x 42 tokens, 40 of each served from the cache; decode adds 15 per request.
    assert cached.engine.runner.num_tokens_run - before == 4 * (2 + 15)


def test_preemption_equals_no_preemption(model_dir: Path) -> None:
    prompts = _prompts([30, 28, 25, 33, 20, 31])
    params = [GREEDY, SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)] * 3
    roomy = LLM(str(model_dir), dtype="float32", block_size=4)
    tight = LLM(str(model_dir), dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=24)
    ref = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    got = _tokens(tight.generate(prompts, params, use_tqdm=False))
    assert tight.get_metrics()["num_preemptions"] > 0
    assert got == ref
    assert tight.engine.scheduler.kv.num_free_blocks == 24


def test_seeded_request_same_alone_and_in_batch(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    target = _prompts([12], seed=9)[0]
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts([7, 40, 3, 15], seed=10)
    batch = others[:2] + [target] + others[2:]
    unseeded = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    outs = llm.generate(batch, [unseeded, unseeded, seeded, unseeded, unseeded], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone


def test_n_samples_are_distinct_and_reproducible(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    out = llm.generate(_prompts([10]), params, use_tqdm=False)[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len(set(samples)) == 4
    again = llm.generate(_prompts([10]), params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_n_samples_share_prompt_blocks(model_dir: Path) -> None:
    """Siblings reuse the prompt's full KV blocks through the prefix cache."""
    llm = LLM(str(model_dir), dtype="float32", block_size=8)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True)
    before = llm.engine.runner.num_tokens_run
    out = llm.generate(_prompts([41]), params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)
    # The prompt's 5 full blocks (40 tokens) are computed once, not once per sample: the first sample
    # computes all 41 prompt tokens, each sibling only the last one (never served from the cache),
    # then every sample decodes 3 more tokens (its first came from the prompt's forward).
    assert llm.engine.runner.num_tokens_run - before == 41 + 2 * 1 + 3 * 3


def test_stop_strings_and_stop_tokens(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    prompt = _prompts([8], seed=2)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    stop_tok = ids[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == ids[: ids.index(stop_tok) + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # As vLLM: the stop token is in token_ids, its text only with include_stop_str_in_output.
    cut_at = ids.index(stop_tok)
    before_text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=cut_at, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].text
    with_text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=cut_at + 1, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    assert with_text != before_text
    assert c.text == before_text
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == c.token_ids and kept.text == with_text
    # A stop string taken from the middle of the free-running text cuts the text right there.
    stop = middle_stop_string(text)
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)
    assert cut[0].outputs[0].text == text[: text.index(stop)]
    assert cut[0].outputs[0].finish_reason == "stop" and cut[0].outputs[0].stop_reason == stop
    incl = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert incl[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_min_tokens_and_max_tokens(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    prompt = _prompts([6], seed=4)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    first = free[0].outputs[0].token_ids[0]
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:3]
    assert len(llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 3
    # min_tokens beyond the room the context leaves after the prompt is refused, not run to the end
    # of the context with EOS banned.
    room = llm.engine.max_model_len - len(prompt[0]["prompt_token_ids"])
    with pytest.raises(ValueError, match=f"min_tokens is {room + 1}.* leaves {room} tokens"):
        llm.generate(prompt, SamplingParams(min_tokens=room + 1, max_tokens=None), use_tqdm=False)
    assert len(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs) == 1


def test_prompt_logprobs(model_dir: Path) -> None:
    """Prompt logprobs (computed over 3 chunks of at most 8 tokens) are transformers' log-softmax of
    the previous position's logits: the prompt token's value and rank, and the top 3 exactly."""
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=8)
    prompt = _prompts([20], seed=6)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 20 and out.prompt_logprobs[0] is None
    ids = prompt[0]["prompt_token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(load_hf(model_dir)(torch.tensor([ids])).logits[0].float(), -1)  # [20, vocab]
    for pos in range(1, 20):
        entry, row = out.prompt_logprobs[pos], ref[pos - 1]
        top = row.topk(3).indices.tolist()
        assert set(entry) == {ids[pos], *top}, pos  # the prompt token plus the top 3, nothing else
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4), (pos, token)
            assert lp.rank == 1 + int((row > row[token]).sum()), (pos, token)


def test_eos_finishes_with_stop_and_no_stop_reason(model_dir: Path) -> None:
    """Regression: EOS used to be reported as stop_reason (vLLM reports None; only stop_token_ids
    and stop strings set it)."""
    llm = LLM(str(model_dir), dtype="float32")
    prompt = _prompts([8], seed=2)
    ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    first = ids.outputs[0].token_ids[0]
    core = llm.engine  # make the first generated token this request's EOS
    from phalanx.engine.engine_core import EngineCoreRequest

    core.add_request(EngineCoreRequest("eos", prompt[0]["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=10)))
    core.scheduler.requests["eos"].eos_token_ids = (first,)
    finish = None
    while core.has_unfinished_requests():
        for o in core.step():
            if o.finish_reason:
                finish = (o.finish_reason, o.stop_reason, o.new_token_ids)
    assert finish == ("stop", None, [first])


def test_request_metrics_time_the_request(model_dir: Path) -> None:
    """RequestOutput.metrics (vLLM's RequestMetrics times): arrival <= first token <= last token <=
    finish for every request; a request with one output token has first == last."""
    import time

    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=2)
    t0 = time.time()
    outs = llm.generate(_prompts([5, 30, 17]), [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                                for m in (1, 8, 12)], use_tqdm=False)
    t1 = time.time()
    for o in outs:
        m = o.metrics
        assert t0 <= m["arrival_time"] <= m["first_token_time"] <= m["last_token_time"] <= m["finished_time"] <= t1
    assert outs[0].metrics["first_token_time"] == outs[0].metrics["last_token_time"]
    assert outs[1].metrics["last_token_time"] > outs[1].metrics["first_token_time"]


def test_data_parallel_ranks_draw_unseeded_rows_from_their_own_streams(model_dir: Path) -> None:
    """Two ranks of `-dp 2` given the same unseeded request at once sampled the same "random"
    completion (one engine seed for every rank); each rank now seeds its own stream. A seeded
    request is the same on either rank (its own generator)."""
    import dataclasses

    from phalanx.engine.args import EngineArgs
    from phalanx.engine.engine_core import EngineCore, EngineCoreRequest

    config = EngineArgs(model=str(model_dir), dtype="float32").create_engine_config()
    ids = _prompts([8], seed=3)[0]["prompt_token_ids"]

    def sample(rank: int, seed: int | None) -> list[int]:
        par = dataclasses.replace(config.parallel, data_parallel_size=2, data_parallel_rank=rank)
        core = EngineCore(dataclasses.replace(config, parallel=par))
        core.add_request(EngineCoreRequest("r", ids, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True,
                                                                   seed=seed)))
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for o in core.step():
                tokens += o.new_token_ids
        return tokens

    assert sample(0, None) != sample(1, None)
    assert sample(0, 7) == sample(1, 7)
