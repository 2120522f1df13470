"""Rule 2: no layer guesses an agreement. An expert-parallel MoE forward issued without a voted
batch size (a caller forgot the plan) fails loudly instead of exchanging tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.attention.metadata import build_attention_metadata
from phalanx.config import ModelConfig
from phalanx.distributed.expert_parallel import install_expert_parallel
from phalanx.distributed.group import DPError, DPGroup
from phalanx.models.registry import load_model
from phalanx.net import free_port
from phalanx.worker.model_runner import allocate_kv_caches, target_layer_specs
from tests.tiny_models import make_model


def test_moe_exchange_refuses_an_unvoted_forward(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf(str(make_model("MixtralForCausalLM", tmp_path / "moe")), "float32")
    group = DPGroup(0, 1, f"tcp://127.0.0.1:{free_port()}", 10.0)
    try:
        model = load_model(cfg, expert_shard=(0, 1))
        install_expert_parallel(model, group)
        kv = allocate_kv_caches(target_layer_specs(cfg), 4, 16, cfg.dtype)
        ids = torch.tensor([5, 6, 7])
        meta = build_attention_metadata(torch.tensor([3]), torch.tensor([0]), torch.tensor([[0]]), 16)
        with torch.inference_mode():
            with pytest.raises(DPError, match="got 3 tokens but the vote agreed on None"):
                model(ids, kv, meta)
            with group.context("target forward", agreed_tokens=3):
                hidden, _ = model(ids, kv, meta)  # with the agreement it runs
        assert hidden.shape == (3, cfg.hidden_size)
    finally:
        group.close()
