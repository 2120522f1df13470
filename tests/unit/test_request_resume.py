"""A request resumed from the tokens it already produced continues exactly where it stood.

This is what the API server replays when the engine rank running a request dies
(docs/dp-protocol.md, "Failure model and recovery"): the same prompt plus the output tokens the
front end received (`EngineCoreRequest.output_token_ids`), on a fresh engine. The engine computes
prompt + produced tokens as context, counts the produced tokens as output (penalties, min_tokens,
max_tokens) and advances a seeded request's generator past them, so the tokens that follow — and
their logprobs — equal the undisturbed run's: greedy and seeded sampling, with penalties and a
min_tokens EOS ban, plain and under every speculative method, in fp32 and in bf16 (whose kernels
are batch-invariant: a replayed prefill computes the decoded tokens' bits).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import SamplingParams
from phalanx.engine.args import EngineArgs
from phalanx.engine.engine_core import EngineCore, EngineCoreRequest
from phalanx.ops import cpu as cpu_ops
from tests.tiny_models import VOCAB, make_eagle_head, make_model
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer

NEW_TOKENS = 14
CUTS = (1, 6, NEW_TOKENS - 1)  # tokens already produced when the rank "died"


def _flat_llama(folder: Path, seed: int, **overrides: int) -> Path:
    """A random-init Llama with near-flat logits (bf16 near-ties everywhere: any change in the order
    of a sum flips tokens, so equality here means the replayed prefill computed the same bits)."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=0, pad_token_id=0,
              tie_word_embeddings=False)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kw, **overrides})).eval().save_pretrained(str(folder))
    make_byte_bpe_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    fp32 = make_model("LlamaForCausalLM", root / "fp32")
    flat = _flat_llama(root / "flat", seed=0)
    return {
        "fp32": fp32,
        "fp32-eagle": make_eagle_head(fp32, root / "fp32-eagle", "eagle"),
        "fp32-draft": make_model("LlamaForCausalLM", root / "fp32-draft", seed=5, num_hidden_layers=1),
        "flat": flat,
        "flat-eagle3": make_eagle_head(flat, root / "flat-eagle3", "eagle3"),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    out = []
    for n in (3, 11, 26, 7):  # repetitive, so the n-gram proposer finds matches
        base = torch.randint(3, VOCAB, (max(n // 3, 1),), generator=g).tolist()
        out.append((base * 4)[:n])
    return out


def _params() -> list[SamplingParams]:
    """Greedy; seeded sampling; seeded sampling with every penalty; greedy with min_tokens banning
    EOS (it may stop at EOS after that) — all with top-2 logprobs."""
    return [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=2**63 - 1, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS - 2, max_tokens=NEW_TOKENS, logprobs=2,
                       logit_bias={0: 3.0}),  # EOS favoured: banned until min_tokens, then likely
    ]


def _run(args: EngineArgs, requests: list[EngineCoreRequest]) -> dict[str, tuple[list[int], list, str | None]]:
    """Step one engine until every request finished: request id -> (tokens, logprobs, finish reason)."""
    engine = EngineCore(args.create_engine_config())
    for r in requests:
        engine.add_request(r)
    out: dict[str, tuple[list[int], list, str | None]] = {r.req_id: ([], [], None) for r in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens, logprobs, _ = out[o.req_id]
            tokens.extend(o.new_token_ids)
            logprobs.extend((lp.token_ids, lp.logprobs) for lp in o.new_logprobs or [])
            out[o.req_id] = (tokens, logprobs, o.finish_reason)
    assert engine.scheduler.kv.num_free_blocks == engine.runner.num_blocks  # nothing left allocated
    return out


def _check_resume(args: EngineArgs, exact_logprobs: bool) -> None:
    """`exact_logprobs`: bitwise (bf16 on the batch-invariant kernels); else within 1e-4 (fp32 linears
    run on MKL, whose summation order depends on the row count: the last bits move, tokens do not)."""
    prompts, params = _prompts(), _params()
    ref = _run(args, [EngineCoreRequest(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    resumed = []
    for i, (p, s) in enumerate(zip(prompts, params)):
        tokens = ref[f"r{i}"][0]
        resumed += [EngineCoreRequest(f"r{i}@{m}", p, s, output_token_ids=tokens[:m]) for m in CUTS if m < len(tokens)]
    got = _run(args, resumed)  # all cut points of all requests in one batch
    for rid, (tokens, logprobs, finish) in got.items():
        base, m = rid.split("@")
        want_tokens, want_logprobs, want_finish = ref[base]
        m = int(m)
        assert tokens == want_tokens[m:], f"{rid}: resumed after {m} tokens, continued differently"
        if exact_logprobs:
            assert logprobs == want_logprobs[m:], f"{rid}: logprobs differ after resuming at {m}"
        else:
            assert [ids for ids, _ in logprobs] == [ids for ids, _ in want_logprobs[m:]], rid
            flat_got = [v for _, vs in logprobs for v in vs]
            flat_want = [v for _, vs in want_logprobs[m:] for v in vs]
            assert flat_got == pytest.approx(flat_want, abs=1e-4), f"{rid}: logprobs differ after resuming at {m}"
        assert finish == want_finish, rid
    assert len(ref["r3"][0]) >= NEW_TOKENS - 2  # min_tokens held EOS back


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "eagle": {"method": "eagle", "model": "fp32-eagle", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "model": "fp32-draft", "num_speculative_tokens": 2},
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_resumed_request_continues_exactly_fp32(spec: str, models: dict[str, Path]) -> None:
    config = SPECS[spec]
    if config is not None and "model" in config:
        config = {**config, "model": str(models[config["model"]])}
    _check_resume(EngineArgs(model=str(models["fp32"]), dtype="float32", max_model_len=128, kv_cache_space=0.02,
                             speculative_config=config), exact_logprobs=False)


@pytest.mark.skipif(cpu_ops.gemm_isa() == 0, reason="bf16 batch invariance needs the C++ GEMM (AVX2 or AVX512-BF16)")
@pytest.mark.parametrize("spec", ["plain", "eagle3"])
def test_resumed_request_continues_exactly_bf16(spec: str, models: dict[str, Path]) -> None:
    config = None
    if spec == "eagle3":
        config = {"method": "eagle3", "model": str(models["flat-eagle3"]), "num_speculative_tokens": 3}
    _check_resume(EngineArgs(model=str(models["flat"]), dtype="bfloat16", max_model_len=128, kv_cache_space=0.02,
                             speculative_config=config), exact_logprobs=True)


def test_a_resumed_request_at_its_max_tokens_is_refused(models: dict[str, Path]) -> None:
    engine = EngineCore(EngineArgs(model=str(models["fp32"]), dtype="float32", max_model_len=64,
                                   kv_cache_space=0.02).create_engine_config())
    params = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="fewer than its max_tokens"):
        engine.add_request(EngineCoreRequest("a", [5, 6], params, output_token_ids=[7, 8, 9]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(EngineCoreRequest("b", [5, 6], params, output_token_ids=[VOCAB]))
