"""bf16 batch invariance end to end: a request's tokens and logprobs are bitwise the same whatever
else the engine runs with it — alone, in a mixed batch, chunked, after a prefix-cache hit, after a
preemption, verified by every speculative method at k = 1, 3, 5, and on a data-parallel rank in
lockstep with padding.

It holds because every reduction sums each row in one order of its own (csrc/gemm.cpp for the
linears, the logits head and the experts; the attention, norm and elementwise kernels), so it is
tested where those kernels serve: bf16 with the C++ kernels and a GEMM path (AMX, AVX512-BF16 or
AVX2), on the CPU's default path and, end to end, on each other path it has.
The random model has the small logits of a random init (std 0.02, no rescaled head), so near-ties
are everywhere and any order difference between two runs flips tokens (oneDNN's row-count-dependent
order does: see docs/batch-invariance.md). Every case runs greedy and seeded sampling requests side
by side (seeded verification draws what plain decoding draws: ``sample.rejection``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.ops import cpu as cpu_ops
from tests.dp.harness import RankJob, run_ranks
from tests.emulated_amx import emulated_amx_module
from tests.tiny_models import VOCAB, make_eagle_head
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer

pytestmark = pytest.mark.skipif(
    cpu_ops.gemm_isa() == 0,
    reason="bf16 batch invariance needs the C++ kernels' GEMM (a compiler, and AVX2 + FMA, AVX512-BF16 or AMX)",
)
DEFAULT_PATH = cpu_ops.gemm_isa()

NEW_TOKENS = 20
LENS = [3, 17, 40, 9, 1, 25, 52, 5]


def _random_llama(folder: Path, seed: int, **overrides: int) -> Path:
    """A random-init Llama as transformers initialises it (flat logits), saved with a tokenizer."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=0, pad_token_id=0,
              tie_word_embeddings=False)
    cfg = transformers.LlamaConfig(**{**kw, **overrides})
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(folder))
    make_byte_bpe_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    target = _random_llama(root / "target", seed=0)
    return {
        "target": target,
        "draft": _random_llama(root / "draft", seed=1, num_hidden_layers=1),
        "eagle": make_eagle_head(target, root / "eagle", "eagle"),
        "eagle3": make_eagle_head(target, root / "eagle3", "eagle3"),
    }


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENS:  # repetitive, so the n-gram proposer finds matches
        base = torch.randint(3, VOCAB, (max(n // 3, 1),), generator=g).tolist()
        out.append({"prompt_token_ids": (base * 4)[:n]})
    return out


def _params(seeded: bool = True) -> list[SamplingParams]:
    """Even requests greedy, odd ones seeded sampling; all with the top-3 logprobs of every token."""
    return [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3) if i % 2 == 0 or
            not seeded else
            SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
            for i in range(len(LENS))]


def _results(outs) -> list[tuple[list[int], list]]:  # noqa: ANN001
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _llm(model: Path, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(str(model), dtype="bfloat16", **{"max_model_len": 128, **kwargs})


@pytest.fixture(scope="module")
def alone(models: dict[str, Path]) -> list[tuple[list[int], list]]:
    """Each request run by itself: the reference every other way of running it must equal."""
    llm = _llm(models["target"], enable_prefix_caching=False)
    return [_results(llm.generate(p, s, use_tqdm=False))[0] for p, s in zip(_prompts(), _params())]


def _assert_same(got: list, want: list, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0], f"{what}: request {i}'s tokens differ from the request run alone"
        assert g[1] == w[1], f"{what}: request {i}'s logprobs differ from the request run alone"


def test_the_model_has_near_ties(alone: list) -> None:
    """The test would be weak on decisive logits: the random model's top-2 logprobs are close."""
    gaps = [sorted(lp.values(), key=lambda x: -x.logprob)[0].logprob - sorted(lp.values(), key=lambda x: -x.logprob)[1].logprob
            for _, lps in alone for lp in lps]
    assert min(gaps) < 0.02 and sum(g < 0.1 for g in gaps) > len(gaps) // 10


def test_mixed_batch(models: dict[str, Path], alone: list) -> None:
    llm = _llm(models["target"], enable_prefix_caching=False)
    _assert_same(_results(llm.generate(_prompts(), _params(), use_tqdm=False)), alone, "batched")


@pytest.fixture(scope="module")
def alone_shared_order(models: dict[str, Path], alone: list) -> list[tuple[list[int], list]]:
    """Each request alone in the order the AVX512-BF16 and AVX2 paths share: `alone` itself, unless
    the default path is AMX (its tiles sum in an order of their own); then alone on AVX512-BF16."""
    if DEFAULT_PATH != cpu_ops.GEMM_ISAS["amx"]:
        return alone
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHALANX_CPU_ISA", "avx512_bf16")
        llm = _llm(models["target"], enable_prefix_caching=False)
        assert llm.engine.runner.model.lm_head.isa == cpu_ops.GEMM_ISAS["avx512_bf16"]
        return [_results(llm.generate(p, s, use_tqdm=False))[0] for p, s in zip(_prompts(), _params())]


@pytest.mark.parametrize("path", ["avx512_bf16", "avx2"])
def test_the_other_paths_give_their_orders_tokens(path: str, models: dict[str, Path], alone_shared_order: list,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM's AVX512-BF16 and AVX2 paths (what CPUs without AMX, or without AVX512-BF16, run)
    share one order: a batch on either equals each request alone in that order. On an AMX CPU this
    runs its non-AMX paths end to end (their lone reference on AVX512-BF16); on an AVX512-BF16 CPU
    the AVX2 path against the default's lone runs."""
    monkeypatch.setenv("PHALANX_CPU_ISA", path)
    isa = cpu_ops.GEMM_ISAS[path]
    if cpu_ops.gemm_isa() != isa:
        pytest.skip(f"this CPU has no {path} path")
    if isa == DEFAULT_PATH:
        pytest.skip(f"{path} is this CPU's default path: test_mixed_batch covers it")
    llm = _llm(models["target"], enable_prefix_caching=False)
    assert llm.engine.runner.model.lm_head.isa == isa
    _assert_same(_results(llm.generate(_prompts(), _params(), use_tqdm=False)), alone_shared_order,
                 f"batched on {path}")


@pytest.fixture(scope="module")
def alone_amx(models: dict[str, Path]) -> list[tuple[list[int], list]]:
    """Each request alone on the emulated AMX tiles (PHALANX_CPU_ISA=amx_emulated): a CPU without
    AMX runs the GEMM's and the attention's AMX code, in AMX's order."""
    if DEFAULT_PATH == cpu_ops.GEMM_ISAS["amx"]:
        pytest.skip("this CPU's default path is AMX: the other tests cover it")
    emulated_amx_module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHALANX_CPU_ISA", "amx_emulated")
        llm = _llm(models["target"], enable_prefix_caching=False)
        assert llm.engine.runner.model.lm_head.isa == cpu_ops.GEMM_ISAS["amx"]
        return [_results(llm.generate(p, s, use_tqdm=False))[0] for p, s in zip(_prompts(), _params())]


def test_the_amx_order_is_batch_invariant_on_emulated_tiles(models: dict[str, Path], alone: list,
                                                            alone_amx: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without AMX, the emulated tiles run the AMX code end to end: a batch there equals each
    request alone there (the 16-row tiles and the attention's row groups do not leak into a row's
    result), and its tokens or logprobs are not the default order's (the two orders round
    differently on this model's near-ties). An AMX CPU's default path is covered by the other tests."""
    monkeypatch.setenv("PHALANX_CPU_ISA", "amx_emulated")
    llm = _llm(models["target"], enable_prefix_caching=False)
    _assert_same(_results(llm.generate(_prompts(), _params(), use_tqdm=False)), alone_amx, "batched on emulated AMX")
    assert alone_amx != alone


AMX_SPEC = [("draft_model", 3), ("eagle3", 3), ("ngram", 5)]


@pytest.mark.parametrize("method,k", AMX_SPEC, ids=[f"{m}-k{k}" for m, k in AMX_SPEC])
def test_speculative_decoding_is_exact_in_the_amx_order(method: str, k: int, models: dict[str, Path],
                                                        alone_amx: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """`test_speculative_decoding` on the emulated AMX tiles: an AMX CPU's verification rows (k + 1
    to a request, in its tiles) give the tokens and logprobs its one-row decoding gives; with the
    target as its own draft model every greedy draft is accepted."""
    monkeypatch.setenv("PHALANX_CPU_ISA", "amx_emulated")
    spec: dict = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    else:
        spec["model"] = str(models["target"] if method == "draft_model" else models[method])
    llm = _llm(models["target"], enable_prefix_caching=False, speculative_config=spec)
    raw = llm.generate(_prompts(), _params(), use_tqdm=False)
    _assert_same(_results(raw), alone_amx, f"{method} k={k} on emulated AMX")
    assert llm.get_metrics()["spec_num_drafts"] > 0
    if method == "draft_model":
        assert all(o.outputs[0].num_accepted_tokens == o.outputs[0].num_draft_tokens > 0 for o in raw[::2])


def test_chunked_prefill(models: dict[str, Path], alone: list) -> None:
    llm = _llm(models["target"], enable_prefix_caching=False, max_num_batched_tokens=16, block_size=8)
    _assert_same(_results(llm.generate(_prompts(), _params(), use_tqdm=False)), alone, "chunked")


def test_prefix_cache_hit(models: dict[str, Path], alone: list) -> None:
    llm = _llm(models["target"], block_size=8)
    llm.generate(_prompts(), _params(), use_tqdm=False)  # fills the cache with every prompt's blocks
    outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) >= 8 * 10
    _assert_same(_results(outs), alone, "prefix hit")


def test_preemption(models: dict[str, Path], alone: list) -> None:
    llm = _llm(models["target"], enable_prefix_caching=False, block_size=4, num_kv_blocks=40)
    outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    _assert_same(_results(outs), alone, "preempted")


SPEC = [(m, k) for m in ("ngram", "draft_model", "eagle", "eagle3") for k in (1, 3, 5)]


@pytest.mark.parametrize("method,k", SPEC, ids=[f"{m}-k{k}" for m, k in SPEC])
def test_speculative_decoding(method: str, k: int, models: dict[str, Path], alone: list) -> None:
    """Greedy and seeded sampled tokens, and the logprobs of every verified step, equal plain
    decoding's. The draft model is the target itself at k = 3 (every greedy draft must be accepted:
    a rejection would mean the target's k + 1 verification rows disagree with its one-row drafting
    passes) and a random one-layer model otherwise (mostly rejected: the recovery path)."""
    spec: dict = {"num_speculative_tokens": k}
    if method == "ngram":
        spec.update(method="ngram", prompt_lookup_max=3, prompt_lookup_min=1)
    elif method == "draft_model":
        spec.update(method="draft_model", model=str(models["target"] if k == 3 else models["draft"]))
    else:
        spec.update(method=method, model=str(models[method]))
    llm = _llm(models["target"], enable_prefix_caching=False, speculative_config=spec)
    raw = llm.generate(_prompts(), _params(), use_tqdm=False)
    _assert_same(_results(raw), alone, f"{method} k={k}")
    assert llm.get_metrics()["spec_num_drafts"] > 0
    if method == "draft_model" and k == 3:  # greedy requests (the even ones) accept every draft
        assert all(o.outputs[0].num_accepted_tokens == o.outputs[0].num_draft_tokens > 0 for o in raw[::2])


def test_seeded_sampling_with_speculation_is_batch_invariant(models: dict[str, Path]) -> None:
    """With speculation, a seeded request's sampled tokens are also the same alone and in a batch."""
    spec = {"method": "eagle", "model": str(models["eagle"]), "num_speculative_tokens": 3}
    llm = _llm(models["target"], enable_prefix_caching=False, speculative_config=spec)
    prompts, params = _prompts(), _params()
    lone = [_results(llm.generate(prompts[i], params[i], use_tqdm=False))[0] for i in (1, 5)]
    batch = _results(llm.generate(prompts, params, use_tqdm=False))
    _assert_same([batch[1], batch[5]], lone, "eagle, seeded")


def test_data_parallel_lockstep_with_padding(models: dict[str, Path], alone: list) -> None:
    """Two ranks in lockstep (EAGLE drafting, every pass padded to the voted size): each greedy
    request's tokens equal the request run alone on one rank."""
    prompts = _prompts()
    jobs = [RankJob(), RankJob()]
    for i in range(0, len(LENS), 2):
        rank = (i // 2) % 2  # rank 0 gets requests 0 and 4, rank 1 gets 2 and 6
        jobs[rank].requests.append((i, f"r{i}", prompts[i]["prompt_token_ids"],
                                    dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), -1))
    spec = {"method": "eagle", "model": str(models["eagle"]), "num_speculative_tokens": 3}
    llm_kwargs = dict(model=str(models["target"]), dtype="bfloat16", max_model_len=128, speculative_config=spec,
                      enable_prefix_caching=False)
    results = run_ranks(2, llm_kwargs, dict(dp_timeout_s=60, dp_lockstep=True), jobs, timeout_s=240)
    for rank, (status, payload) in results.items():
        assert status == "ok", f"rank {rank}: {status} {payload}"
    for rank, job in enumerate(jobs):
        for _, rid, *_ in job.requests:
            assert results[rank][1]["tokens"][rid] == alone[int(rid[1:])][0], f"{rid} on rank {rank}"


def test_smollm2_real_weights() -> None:
    """The real SmolLM2-135M-Instruct in bf16: chat prompts' greedy tokens alone equal those in a
    batch and with the model drafting for itself (k = 3: every draft accepted)."""
    from tests.real_model import CHAT_PROMPTS, messages, smollm2_gguf

    gguf = smollm2_gguf()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    chats = [messages(p) for p in CHAT_PROMPTS[:3]]
    llm = LLM(str(gguf), dtype="bfloat16", max_model_len=256, enable_prefix_caching=False)
    lone = [llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    assert [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)] == lone
    del llm
    spec = {"method": "draft_model", "model": str(gguf), "num_speculative_tokens": 3}
    self_draft = LLM(str(gguf), dtype="bfloat16", max_model_len=256, enable_prefix_caching=False,
                     speculative_config=spec)
    assert [o.outputs[0].token_ids for o in self_draft.chat(chats, params, use_tqdm=False)] == lone
    metrics = self_draft.get_metrics()
    assert metrics["spec_num_accepted_tokens"] == metrics["spec_num_draft_tokens"] > 0
