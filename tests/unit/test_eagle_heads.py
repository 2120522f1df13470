"""EAGLE heads in the engine against an independent reference: the demo trainer's pure-PyTorch head
(`phalanx.demo.eagle.EagleHead`, the one the acceptance simulation uses), on random one- and
two-layer EAGLE-1 / EAGLE-3 checkpoints in vLLM's format. A two-layer head must also draft
losslessly end to end (greedy spec == no spec) and its checkpoint must be complete."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.attention.metadata import build_attention_metadata
from phalanx.config import ModelConfig
from phalanx.models.eagle import load_eagle_head
from phalanx.models.registry import load_model
from phalanx.worker.model_runner import allocate_kv_caches
from tests.tiny_models import load_hf, make_eagle_head, make_model


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("LlamaForCausalLM", tmp_path_factory.mktemp("heads") / "target", num_hidden_layers=4)


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_engine_head_matches_reference_head(method: str, num_layers: int, target: Path, tmp_path: Path) -> None:
    from phalanx.demo.eagle import load_head

    folder = make_eagle_head(target, tmp_path / "head", method, seed=3, num_layers=num_layers)
    cfg = ModelConfig.from_hf(str(target), "float32")
    head = load_eagle_head(str(folder), method, load_model(cfg))
    assert len(head.layers) == num_layers
    ref = load_head(folder, load_hf(target))
    assert len(ref.layers) == num_layers

    t, block = 11, 4
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (t,), generator=g)
    feats = torch.randn(t, cfg.hidden_size, generator=g)
    specs = [(head.config.num_kv_heads, head.config.head_dim)] * num_layers
    kv = allocate_kv_caches(specs, 8, block, torch.float32)
    table = torch.tensor([[5, 2, 7]])  # scattered blocks
    meta = build_attention_metadata(torch.tensor([t]), torch.tensor([0]), table, block)
    with torch.inference_mode():
        normed, fed_back = head(tokens, feats, kv, meta)
        drafted = head.draft_token_ids(normed)
    with torch.no_grad():
        pre = ref.causal_forward(tokens, feats)
        ref_ids = ref.target_logits(pre).argmax(dim=-1)
    torch.testing.assert_close(fed_back, pre, atol=2e-4, rtol=2e-4)
    assert drafted.tolist() == ref_ids.tolist()
    # decode one more position over the cached keys: the same as the reference over t + 1 tokens
    nxt_tok, nxt_feat = torch.tensor([9]), torch.randn(1, cfg.hidden_size, generator=g)
    meta2 = build_attention_metadata(torch.tensor([1]), torch.tensor([t]), table, block)
    with torch.inference_mode():
        _, fed2 = head(nxt_tok, nxt_feat, kv, meta2)
    with torch.no_grad():
        pre2 = ref.causal_forward(torch.cat([tokens, nxt_tok]), torch.cat([feats, nxt_feat]))[-1:]
    torch.testing.assert_close(fed2, pre2, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_two_layer_head_drafts_losslessly(method: str, target: Path, tmp_path: Path) -> None:
    head = make_eagle_head(target, tmp_path / "head", method, seed=4, num_layers=2)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=g).tolist()} for n in (4, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = LLM(str(target), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), dtype="float32", block_size=8,
              speculative_config={"method": method, "model": str(head), "num_speculative_tokens": 3})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.get_metrics()["spec_num_drafts"] > 0
    assert len(llm.engine.runner.proposer.kv_cache_spec()) == 2  # one KV cache per head layer


def test_head_missing_a_layer_is_refused(target: Path, tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    folder = make_eagle_head(target, tmp_path / "head", "eagle3", num_layers=2)
    w = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith("layers.1.")}
    save_file(w, str(folder / "model.safetensors"))
    cfg = ModelConfig.from_hf(str(target), "float32")
    with pytest.raises(ValueError, match="lacks weights for"):
        load_eagle_head(str(folder), "eagle3", load_model(cfg))
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2


def test_aux_hidden_states_follow_the_heads_order(target: Path) -> None:
    """EAGLE-3 features come back in the order the head lists its layers, a repeated id repeated
    (a 2-layer target's default ids (0, 1, 1) have one): fc sees exactly 3 x hidden columns."""
    cfg = ModelConfig.from_hf(str(target), "float32")
    model = load_model(cfg)
    kv = allocate_kv_caches([(cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers, 4, 4, torch.float32)
    meta = build_attention_metadata(torch.tensor([3]), torch.tensor([0]), torch.tensor([[0]]), 4)
    with torch.inference_mode():
        _, aux = model(torch.tensor([5, 6, 7]), kv, meta, aux_layer_ids=(2, 0, 2))
        _, sorted_aux = model(torch.tensor([5, 6, 7]), kv, meta, aux_layer_ids=(0, 2))
    assert len(aux) == 3
    assert torch.equal(aux[0], sorted_aux[1]) and torch.equal(aux[1], sorted_aux[0]) and torch.equal(aux[2], aux[0])


def test_aux_ids_follow_vllms_convention_up_to_the_last_layers_output(target: Path) -> None:
    """Aux id j is the residual stream after j target layers: 0 the embeddings, num_layers the last
    layer's output before the final norm (vLLM's convention, which lets EAGLE-3 read what EAGLE-1
    reads). The engine and the demo trainer (which builds the heads' features from HF) agree on every
    id; asking for id num_layers leaves the final hidden state unchanged."""
    from phalanx.demo.eagle import target_features

    cfg = ModelConfig.from_hf(str(target), "float32")
    model = load_model(cfg)
    n = cfg.num_layers
    ids = (0, 1, n // 2, n - 1, n)
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    kv = allocate_kv_caches([(cfg.num_kv_heads, cfg.head_dim)] * n, 4, 4, torch.float32)
    meta = build_attention_metadata(torch.tensor([7]), torch.tensor([0]), torch.tensor([[0, 1]]), 4)
    with torch.inference_mode():
        normed, aux = model(tokens, kv, meta, aux_layer_ids=ids)
        plain, _ = model(tokens, kv, meta)
    last, ref = target_features(load_hf(target), tokens[None], torch.ones(1, 7, dtype=torch.long), list(ids))
    torch.testing.assert_close(torch.cat(aux, dim=-1), ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(normed, last[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(normed, plain)
    assert not torch.allclose(aux[-1], last[0], atol=1e-2)  # id n is taken before the final norm


@pytest.mark.parametrize("ids", [[0, 2, 5], [-1, 1, 2], [1, 2]])
def test_eagle3_aux_ids_out_of_range_are_refused(ids: list[int], target: Path, tmp_path: Path) -> None:
    import json

    folder = make_eagle_head(target, tmp_path / "head", "eagle3")
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"aux layer ids .* invalid for a 4-layer target: three ids in 0\.\.4"):
        load_eagle_head(str(folder), "eagle3", load_model(ModelConfig.from_hf(str(target), "float32")))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_grown_head_starts_as_the_smaller_head(method: str, target: Path, tmp_path: Path) -> None:
    """The demo trainer's growth step (a 2-layer head continued as 3 layers): the new top layer starts
    as the identity, so the grown head computes exactly what the smaller one did; shrinking or
    changing any other setting is refused."""
    import json

    from phalanx.demo.eagle import EagleHead, grow_from, load_head

    hf = load_hf(target)
    small = load_head(make_eagle_head(target, tmp_path / "h2", method, seed=5, num_layers=2), hf)
    emb, lm = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    big = EagleHead({**small.cfg, "num_hidden_layers": 3}, method == "eagle3", emb, lm)
    grow_from(big, small)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, hf.config.vocab_size, (9,), generator=g)
    feats = torch.randn(9, hf.config.hidden_size, generator=g)  # EAGLE-3: already fused by fc
    with torch.no_grad():
        torch.testing.assert_close(big.causal_forward(tokens, feats), small.causal_forward(tokens, feats))
    assert any(p.abs().sum() > 0 for p in big.layers[2].self_attn.q_proj.parameters())  # random, not zero
    with pytest.raises(ValueError, match="at most as many layers"):
        grow_from(small, big)
    other = EagleHead({**small.cfg, "intermediate_size": 2 * small.cfg["intermediate_size"]},
                      method == "eagle3", emb, lm)
    with pytest.raises(ValueError, match="another configuration"):
        grow_from(other, small)
    json.dumps(big.cfg)  # still a plain config
