"""ModelConfig.from_hf accepts configs written by transformers v4 and v5 (DESIGN §6); ParallelConfig
refuses options that would do nothing, and so does the engine configuration (expert parallelism)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.config import ModelConfig, ParallelConfig

V4 = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "head_dim": None, "eos_token_id": [7, 8],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
}


def _write(folder: Path, cfg: dict, gen: dict | None = None) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


def test_v4_style_config(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf(_write(tmp_path / "v4", V4, {"eos_token_id": 9}))
    assert cfg.dtype == torch.bfloat16  # torch_dtype, with dtype="auto"
    assert cfg.head_dim == 16  # head_dim: null -> hidden / heads
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == (9, 7, 8)  # generation_config first, then config.json


def test_v5_style_config(tmp_path: Path) -> None:
    v5 = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5.update(dtype="float16", head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    cfg = ModelConfig.from_hf(_write(tmp_path / "v5", v5))
    assert cfg.dtype == torch.float16 and cfg.head_dim == 32
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling is None
    assert ModelConfig.from_hf(str(tmp_path / "v5"), "float32").dtype == torch.float32


def test_parallel_options_that_would_do_nothing_are_errors() -> None:
    """`dp_lockstep` with one rank and `check_collectives` without lockstep ranks would be accepted
    and silently ignored: each is a ValueError naming the option and what it needs (the server's
    flags are checked in tests/e2e/test_server_lifecycle.py)."""
    with pytest.raises(ValueError, match=r"dp_lockstep \(--dp-lockstep\) needs data_parallel_size \(-dp\) > 1"):
        ParallelConfig(dp_lockstep=True)
    for kwargs in ({}, {"data_parallel_size": 2}, {"enable_expert_parallel": True}):
        with pytest.raises(ValueError, match="check_collectives .* needs data_parallel_size"):
            ParallelConfig(check_collectives=True, **kwargs)
    assert ParallelConfig(data_parallel_size=2, dp_lockstep=True, check_collectives=True).lockstep(False)
    assert ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, check_collectives=True).lockstep(True)


def test_expert_parallelism_needs_an_moe_model_with_an_expert_a_rank(tmp_path: Path) -> None:
    """`enable_expert_parallel` on a dense model, or over more ranks than the model has experts,
    is a ValueError from the engine configuration itself (the server and any Python caller alike),
    naming the option and what it needs; an MoE model with enough experts is accepted."""
    from phalanx.engine.args import EngineArgs

    dense = _write(tmp_path / "dense", V4)
    with pytest.raises(ValueError, match=r"enable_expert_parallel \(--enable-expert-parallel\) needs an MoE model; this one is dense"):
        EngineArgs(model=dense, enable_expert_parallel=True).create_engine_config(resolve_dtype=False)
    moe = _write(tmp_path / "moe", {**V4, "architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
                                    "num_experts_per_tok": 1})
    with pytest.raises(ValueError, match="expert parallelism over 4 ranks needs >= 4 experts, the model has 2"):
        EngineArgs(model=moe, enable_expert_parallel=True, data_parallel_size=4).create_engine_config(
            resolve_dtype=False)
    cfg = EngineArgs(model=moe, enable_expert_parallel=True, data_parallel_size=2).create_engine_config(
        resolve_dtype=False)
    assert cfg.model.is_moe and cfg.parallel.lockstep(cfg.model.is_moe)
