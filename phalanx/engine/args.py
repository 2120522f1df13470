"""Engine arguments shared by the offline `LLM` and `phalanx serve`, and their conversion into
a validated `EngineConfig`.

Owns: defaults and the max_model_len default. Model names are resolved by ``phalanx.checkpoint``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phalanx.checkpoint import resolve_model_path
from phalanx.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    kv_cache_space: float = 1.0
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact KV block count (tests); overrides kv_cache_space
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dp_lockstep: bool = False
    dp_timeout: float = 60.0
    dp_check_collectives: bool = False
    speculative_config: dict[str, Any] | str | None = None
    # End-of-sequence ids the tokenizer knows besides the checkpoint's (generation_config / config):
    # merged into ModelConfig.eos_token_ids, the one set that both stops requests and is banned before
    # min_tokens. The front end that loads the tokenizer fills it in (LLM, phalanx serve).
    extra_eos_token_ids: tuple[int, ...] = ()

    def create_engine_config(self, *, resolve_dtype: bool = True) -> EngineConfig:
        """`resolve_dtype=False`: the model's dtype stays a name, so that building (checking) the
        configuration imports no torch (``ModelConfig.from_hf``); the API server's check uses it."""
        model = ModelConfig.from_hf(
            resolve_model_path(self.model), self.dtype, self.max_model_len, resolve_dtype=resolve_dtype
        )
        if self.enable_expert_parallel and not model.is_moe:
            raise ValueError("enable_expert_parallel (--enable-expert-parallel) needs an MoE model; this one is dense")
        dp = self.data_parallel_size
        if self.enable_expert_parallel and dp > 1 and model.num_experts < dp:
            raise ValueError(f"expert parallelism over {dp} ranks needs >= {dp} experts, the model has {model.num_experts}")
        extra = [int(t) for t in self.extra_eos_token_ids if int(t) not in model.eos_token_ids]
        if extra:
            model = dataclasses.replace(model, eos_token_ids=(*model.eos_token_ids, *extra))
        max_len = model.max_model_len
        spec = None
        if self.speculative_config is not None:
            from phalanx.spec_decode.config import SpeculativeConfig

            spec = SpeculativeConfig.from_dict(self.speculative_config, model)
        batched = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_space=self.kv_cache_space,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
            ),
            parallel=ParallelConfig(
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                dp_lockstep=self.dp_lockstep,
                dp_timeout_s=self.dp_timeout,
                check_collectives=self.dp_check_collectives,
            ),
            seed=self.seed,
            speculative=spec,
        )
