"""API fuzzing: schemathesis generates requests from the server's own OpenAPI schema for
/v1/chat/completions, /v1/completions, /tokenize, /detokenize and /v1/models (valid and invalid
bodies, missing bodies, wrong methods, edge values), sends them to a real `phalanx serve`, and
checks every response: never a 5xx, status codes, content types, headers and bodies as the schema
documents them (phalanx/entrypoints/openai/responses.py). The server is healthy afterwards.

Bounded (a fixed seed, a few dozen examples per operation: ~900 requests); benchmarks/fuzz_api.py
runs the same checks with >= 2,000 requests.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks.fuzz_api import run_schemathesis
from tests.e2e.conftest import start_server

pytestmark = pytest.mark.slow


def test_fuzzing_finds_no_server_error_and_no_schema_violation(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model, tmp_path / "s.log", "--max-model-len", "64", "--api-key", "fuzz-key")
    try:
        summary = run_schemathesis(server.base_url, max_examples=20, seed=1,
                                   headers={"Authorization": "Bearer fuzz-key"})
        assert summary.requests >= 500, summary.output_tail  # the run happened (the ndjson report was read)
        assert summary.by_status[200] >= 50 and summary.by_status[400] >= 100, dict(summary.by_status)
        assert summary.num_5xx == 0, summary.failure_examples
        assert summary.gated_failures() == 0, (dict(summary.check_failures), summary.failure_examples)
        assert summary.exit_code == 0, summary.output_tail
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        assert server.stop() == 0, server.log()[-3000:]
