"""Engine arguments shared by the offline `LLM` and `phalanx serve`, and their conversion into
a validated `EngineConfig`.

Owns: defaults, resolving built-in model names, the max_model_len default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig


def resolve_model_path(name_or_path: str) -> str:
    """Built-in demo model names map to folders inside the package; anything else is a path."""
    try:
        from phalanx.demo import resolve_model_path as resolve_builtin
    except ImportError:  # demo package absent
        return name_or_path
    return resolve_builtin(name_or_path)


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

    def create_engine_config(self) -> EngineConfig:
        model = ModelConfig.from_hf(resolve_model_path(self.model), self.dtype, self.max_model_len)
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
