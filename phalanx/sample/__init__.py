"""phalanx.sample: logits -> tokens. Metadata (`metadata.py`), plain sampling (`sampler.py`) and
speculative verification (`rejection.py`)."""

from phalanx.sample.metadata import SamplingMetadata
from phalanx.sample.rejection import RejectionOutput, rejection_sample
from phalanx.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    apply_penalties_and_bans,
    compute_token_logprobs,
    process_logits,
)

__all__ = [
    "LogprobsTensors",
    "RejectionOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties_and_bans",
    "compute_token_logprobs",
    "process_logits",
    "rejection_sample",
]
