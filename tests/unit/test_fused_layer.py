"""The one-call decoder layer (``ops.cpu.fused_layer``) and the drafting chains
(``ops.cpu.eagle_chain`` / ``model_chain``): each must give bitwise the module path's hidden states,
KV writes and drafts, since the engine switches between them by batch shape (a request's tokens
must not depend on whether its step ran fused). They run on whatever GEMM path the linears took
(``ops.cpu.gemm_isa``), so these tests hold on every CPU the kernels build on; the attention plan's
grouping needs no kernel at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.attention.metadata import build_attention_metadata
from phalanx.layers.linear import prepack_supported
from phalanx.ops import cpu as cpu_ops
from tests.tiny_models import make_eagle_head, make_model

needs_kernels = pytest.mark.skipif(
    not prepack_supported(torch.bfloat16) or cpu_ops.kernel_for(torch.bfloat16) is None,
    reason="the one-call layer and the chains are C++ kernels: they need a C++ compiler (PHALANX_KERNELS not torch)",
)

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    # head_dim 32: the attention kernel's register-tiled path, as the demo model's 64
    target = make_model("LlamaForCausalLM", tmp_path_factory.mktemp("fused") / "m", hidden_size=128,
                        intermediate_size=160, num_hidden_layers=3)
    return LLM(str(target), dtype="bfloat16", max_model_len=256, num_kv_blocks=64)


def _caches(llm: LLM, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c.shape, generator=g).to(c.dtype) for c in llm.engine.runner.kv_caches]


def _forward(model, ids, caches, q_lens, num_computed, table, fused: bool, num_pad: int = 0):  # noqa: ANN001, ANN202
    meta = build_attention_metadata(torch.tensor(q_lens), torch.tensor(num_computed), table, BLOCK, num_pad)
    saved = [layer._fused for layer in model.model.layers]
    if not fused:
        for layer in model.model.layers:
            layer._fused = None
    try:
        return model(ids, caches, meta, aux_layer_ids=(1, 3))
    finally:
        for layer, s in zip(model.model.layers, saved):
            layer._fused = s


@pytest.mark.parametrize(
    "q_lens,num_computed",
    [
        ([1], [5]),  # plain decode at c = 1
        ([1, 1, 1], [20, 3, 47]),
        ([4], [9]),  # verifying 3 drafts
        ([3, 3], [17, 40]),
        ([1] * 8, list(range(8, 64, 7))),  # eight decodes: past the GEMM's 6-row register tile
        ([4] * 5, [30, 2, 60, 17, 9]),
        ([40], [0]),  # a lone prompt
        ([25], [16]),  # a lone later chunk of a prompt
        ([30, 1], [0, 7]),  # a prompt joining a decode: the decode group gathered, the chunk in place
        ([1, 4, 1, 25], [10, 20, 3, 0]),  # a padded [3, 4] decode group around a prompt
        ([2, 1, 4, 1, 3], [11, 30, 5, 19, 44]),  # ragged verification (adaptive draft lengths): a padded [5, 4] grid
        ([30, 20], [0, 0]),  # two prompts
        ([1, 3, 40, 2, 17, 1], [33, 12, 0, 50, 16, 5]),  # 17 tokens: past the decode group's 16
    ],
)
@needs_kernels
def test_fused_layer_is_bitwise_the_module_path(llm: LLM, q_lens: list[int], num_computed: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = llm.engine.runner.model
    kernel = model.model.layers[0].fused_form().parts.kernel
    calls = []
    real = kernel.fused_layer
    monkeypatch.setattr(kernel, "fused_layer", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    g = torch.Generator().manual_seed(sum(q_lens))
    ids = torch.randint(0, 320, (sum(q_lens),), generator=g)
    table = torch.arange(1, 1 + 6 * len(q_lens)).view(len(q_lens), 6)  # 6 blocks each, distinct
    fused_caches, module_caches = _caches(llm, 1), _caches(llm, 1)
    got, got_aux = _forward(model, ids, fused_caches, q_lens, num_computed, table, fused=True)
    assert calls == [sum(q_lens)] * model.num_layers  # every layer took the one call
    want, want_aux = _forward(model, ids, module_caches, q_lens, num_computed, table, fused=False)
    assert len(calls) == model.num_layers
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_aux, want_aux))
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, module_caches))  # the same KV writes


def test_fused_plan_groups_attention_as_the_module_path() -> None:
    table = torch.arange(1, 13).view(3, 4)
    uniform = build_attention_metadata(torch.tensor([2, 2, 2]), torch.tensor([5, 9, 0]), table, BLOCK)
    block_table, visible, *rest = uniform.fused_plan()
    assert torch.equal(visible, torch.tensor([[6, 7], [10, 11], [1, 2]])) and rest == [None, None, None, [], [], []]
    lone = build_attention_metadata(torch.tensor([30]), torch.tensor([4]), table[:1], BLOCK)
    block_table, visible, *rest = lone.fused_plan()
    assert torch.equal(visible[0], torch.arange(5, 35)) and block_table.shape == (1, 3) and rest[0] is None
    # [p0 .. p29 | d30 | v31 v32 v33]: a prompt, then a decode and a 3-token verification (the group)
    mixed = build_attention_metadata(torch.tensor([30, 1, 3]), torch.tensor([0, 7, 9]), table, BLOCK)
    dec_table, dec_visible, idx, sel, rows, bounds, tables, visibles = mixed.fused_plan()
    assert torch.equal(dec_visible, torch.tensor([[8, 1, 1], [10, 11, 12]]))  # padding sees one key
    assert idx.tolist() == [30, 0, 0, 31, 32, 33] and sel.tolist() == [0, 3, 4, 5] and rows.tolist() == [30, 31, 32, 33]
    assert bounds == [0, 30] and len(tables) == 1 and torch.equal(visibles[0][0], torch.arange(1, 31))
    two_prompts = build_attention_metadata(torch.tensor([30, 20]), torch.tensor([0, 0]), table[:2], BLOCK)
    assert two_prompts.fused_plan()[:5] == (None,) * 5 and two_prompts.fused_plan()[5] == [0, 30, 30, 50]
    padded = build_attention_metadata(torch.tensor([1, 1]), torch.tensor([3, 4]), table[:2], BLOCK, num_pad=2)
    assert padded.fused_plan() is None  # lockstep padding: the module path


@needs_kernels
def test_padded_batch_takes_the_module_path(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    model = llm.engine.runner.model
    kernel = model.model.layers[0].fused_form().parts.kernel
    monkeypatch.setattr(kernel, "fused_layer", lambda *a: pytest.fail("lockstep padding has no cache rows"))
    table = torch.arange(1, 13).view(2, 6)
    out, _ = _forward(model, torch.arange(33), _caches(llm, 2), [30, 1], [0, 7], table, fused=True, num_pad=2)
    assert out.shape == (33, 128)


@needs_kernels
def test_fused_layer_refuses_inconsistent_arguments(llm: LLM) -> None:
    layer = llm.engine.runner.model.model.layers[0]
    ln1, p = layer.fused_form()
    kernel, ln2, eps, linears, widths, heads, scale, isa, rotary = p
    x = torch.randn(3, 128).bfloat16()
    cos, sin = rotary.tables(torch.arange(3), torch.bfloat16, {})
    cache = _caches(llm, 3)[0]
    one = torch.ones(1, 1, dtype=torch.int64)
    grid = (one, torch.full((1, 3), 3), None, None, None, [], [], [])
    args = (cos, sin, cache, torch.arange(3), *grid)
    with pytest.raises(RuntimeError, match="qkv width disagrees with the heads"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears, widths, [heads[0] + 1, *heads[1:]], scale, isa, *args)
    with pytest.raises(RuntimeError, match="3 tokens are not whole requests of 2"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears, widths, heads, scale, isa, cos, sin, cache,
                           torch.arange(3), one, torch.full((1, 2), 2), None, None, None, [], [], [])
    with pytest.raises(RuntimeError, match="linears are"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears[:-1], widths, heads, scale, isa, *args)
    with pytest.raises(RuntimeError, match=r"prefill chunk \[1, 5\) outside the batch's 3 tokens"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears, widths, heads, scale, isa, cos, sin, cache,
                           torch.arange(3), None, None, None, None, None, [1, 5], [one], [torch.full((1, 4), 4)])
    with pytest.raises(RuntimeError, match="the attention plan covers 2 of the batch's 3 tokens"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears, widths, heads, scale, isa, cos, sin, cache,
                           torch.arange(3), None, None, None, None, None, [0, 2], [one], [torch.full((1, 2), 2)])
    ragged = (one, torch.full((1, 3), 3), torch.tensor([0, 1, 3]), torch.arange(3), torch.arange(3), [], [], [])
    with pytest.raises(RuntimeError, match=r"dec_idx\[2\] = 3 outside \[0, 3\)"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears, widths, heads, scale, isa, cos, sin, cache,
                           torch.arange(3), *ragged)
    with pytest.raises(RuntimeError, match="each prefill chunk needs its start and end"):
        kernel.fused_layer(x, None, ln1, ln2, eps, linears, widths, heads, scale, isa, cos, sin, cache,
                           torch.arange(3), None, None, None, None, None, [0], [one], [torch.full((1, 3), 3)])


@needs_kernels
@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("num_seqs,prompt_len", [(1, 5), (3, 5), (2, 20), (6, None)])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_drafting_chain_drafts_and_writes_what_the_passes_do(method: str, num_seqs: int, prompt_len: int | None,
                                                          tied: bool, tmp_path: Path) -> None:
    """The C++ drafting chains (EAGLE heads, draft models) against pass by pass: the same drafts at
    every step and the same drafter KV cache at the end wherever pass by pass wrote it (near
    max_tokens requests draft fewer tokens than the others; a chain drafts the deepest length for
    every row and also fills the positions past a shorter request's drafts, which the next
    catch-up overwrites before anything reads them). Requests feeding the same number of
    positions run all k passes in one call (pass 1 over the [R, q] grid, prompts included);
    otherwise pass 1 runs in Python and passes 2..k in one call. Tied models (target and draft model)
    look their tokens up in the logits head's packed table, in the chains too."""
    target = make_model("LlamaForCausalLM", tmp_path / "m", hidden_size=128, intermediate_size=160,
                        tie_word_embeddings=tied)
    if method == "draft_model":  # a 2-layer dense draft model: every layer and the final norm chained
        head = make_model("LlamaForCausalLM", tmp_path / "draft", seed=3, hidden_size=64, intermediate_size=96,
                          tie_word_embeddings=tied)
    else:
        head = make_eagle_head(target, tmp_path / "eagle", method)
    same_length = prompt_len is not None  # 20: a grid past the decode group's 16-token queries
    lens = [prompt_len] * num_seqs if same_length else [3 + i % 3 for i in range(num_seqs)]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 300 + 3 for j in range(lens[i])]} for i in range(num_seqs)]
    # staggered lengths: requests finish at different steps, so batches change shape
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 4 * i, ignore_eos=True) for i in range(num_seqs)]
    runs = [_run_spec(target, head, method, prompts, params, chain) for chain in (True, False)]
    (outs_a, drafts_a, kv_a, (grids, python_passes)), (outs_b, drafts_b, kv_b, (no_grids, _)) = runs
    if same_length:
        assert any(q > 1 for q in grids) and python_passes == 0  # every step one call, prompts included
    else:
        assert python_passes > 0 and grids  # the prompts' step: pass 1 in Python, then the chain
    assert no_grids == []
    assert outs_a == outs_b and drafts_a == drafts_b
    for a, b in zip(kv_a, kv_b):
        written = b != UNWRITTEN  # every slot the pass-by-pass drafter wrote
        assert written.any() and torch.equal(a[written], b[written])


UNWRITTEN = 8192.0  # the drafter's KV caches start filled with this (exact in bf16; no real K or V)


def _run_spec(target: Path, head: Path, method: str, prompts: list, params: list, chain: bool) -> tuple:
    """(outputs, drafts per step, the head's KV caches, (the grid width q of each chain call, the
    drafter passes run in Python in steps where every request drafts: a request left without room
    before max_tokens gets no drafts, and a step where some fed request does not draft runs pass 1
    in Python))."""
    llm = LLM(str(target), dtype="bfloat16", max_num_seqs=len(prompts), enable_prefix_caching=False, num_kv_blocks=64,
              speculative_config={"method": method, "model": str(head), "num_speculative_tokens": 3})
    proposer = llm.engine.runner.proposer
    drafter = proposer.model if method == "draft_model" else proposer.head
    assert drafter.chain_form() is not None
    drafts, grids, passes = [], [], []
    real_propose, real_chain, real_run = proposer.propose, drafter.draft_chain, proposer._run
    drafting = [False]  # whether every request of the current step drafts
    proposer._run = lambda *a: (passes.append(1) if drafting[0] else None) or real_run(*a)
    q_arg = 2 if method == "draft_model" else 3  # draft_chain(ids, [feed,] start, q, ...)
    if chain:
        drafter.draft_chain = lambda *a: grids.append(a[q_arg]) or real_chain(*a)
    else:
        proposer._chains = lambda batch: False
    proposer.propose = lambda batch: (drafting.__setitem__(0, all(batch.num_drafts))
                                      or drafts.append(real_propose(batch)) or drafts[-1])
    for cache in proposer.kv_caches:
        cache.fill_(UNWRITTEN)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs, drafts, [c.clone() for c in proposer.kv_caches], (grids, len(passes))
