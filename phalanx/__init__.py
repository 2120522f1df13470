"""phalanx: an LLM serving engine for exact speculative decoding served data-parallel."""

from phalanx.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
