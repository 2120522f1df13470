"""An MoE draft model under expert parallelism loads only this rank's experts, once.

Regression: the draft-model proposer loaded the whole MoE draft, then `build_proposer` reloaded it
sharded (every weight read and packed twice, and all experts resident in between)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.config import ModelConfig
from phalanx.distributed.expert_parallel import EPExchange
from phalanx.layers.moe import SparseMoE
from phalanx.spec_decode import draft_model
from phalanx.spec_decode.config import SpeculativeConfig
from phalanx.spec_decode.proposer import build_proposer
from tests.tiny_models import make_model


@pytest.mark.parametrize("draft_arch", ["MixtralForCausalLM", "LlamaForCausalLM"])
def test_moe_draft_loads_its_expert_shard_once(
    draft_arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = make_model("MixtralForCausalLM", tmp_path / "target")
    draft = make_model(draft_arch, tmp_path / "draft", seed=7, num_hidden_layers=1)
    target_cfg = ModelConfig.from_hf(target, torch.float32, 64)
    spec = SpeculativeConfig.from_dict({"model": str(draft), "num_speculative_tokens": 2}, target_cfg)
    loads: list[tuple[int, int] | None] = []
    real_load = draft_model.load_model

    def counting_load(cfg: ModelConfig, expert_shard: tuple[int, int] | None = None):  # noqa: ANN202
        loads.append(expert_shard)
        return real_load(cfg, expert_shard)

    monkeypatch.setattr(draft_model, "load_model", counting_load)
    group = object()  # stands in for the DP group: installing the exchange issues no collective
    proposer = build_proposer(spec, torch.nn.Identity(), target_cfg, expert_shard=(1, 2), group=group)  # type: ignore[arg-type]
    moes = [m for m in proposer.model.modules() if isinstance(m, SparseMoE)]  # type: ignore[attr-defined]
    if draft_arch == "MixtralForCausalLM":
        assert loads == [(1, 2)]  # one load, of rank 1's experts only
        assert moes and all(m.expert_range == (2, 4) for m in moes)  # 4 experts over 2 ranks
        assert all(isinstance(m.exchange, EPExchange) and m.exchange.group is group for m in moes)
    else:
        assert loads == [None] and not moes  # a dense draft has nothing to shard
