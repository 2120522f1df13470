"""Fixtures shared by the whole suite."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_fp32():  # noqa: ANN201
    """One fp32 SmolLM2-135M-Instruct engine from its GGUF for every test that needs plain fp32
    decoding of the real model (a load is ~10 s of a 2-core CPU). Prefix caching is off, so what
    earlier tests ran leaves nothing behind that could change a later test's arithmetic."""
    from phalanx import LLM
    from tests.real_model import smollm2_gguf

    return LLM(str(smollm2_gguf()), dtype="float32", max_model_len=512, enable_prefix_caching=False)
