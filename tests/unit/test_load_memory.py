"""What loading leaves resident: the heap that loading freed goes back to the OS
(`models.loader.release_load_buffers`, called by the model runner before it allocates the KV cache)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import LLM
from phalanx.models import loader
from phalanx.worker import model_runner
from tests.tiny_models import make_model

_CHILD = """
import sys
from phalanx.models.loader import release_load_buffers

def anon_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) / 1024

chunks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB in heap-sized pieces (below mmap's threshold)
del chunks[::10]  # keep one in ten, as load-time buffers around live weights do: the heap cannot shrink by itself
kept = chunks[9::10]
del chunks
before = anon_mb()
ok = release_load_buffers()
print(ok, before, anon_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_freed_load_buffers_leave_the_resident_set() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=120)
    ok, before, after = out.stdout.split()
    if ok != "True":
        pytest.skip("this C library has no malloc_trim")
    assert float(before) - float(after) > 100, (before, after)  # most of the ~180 MiB freed comes back


def test_without_malloc_trim_it_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_libc_malloc_trim", lambda: None)
    assert loader.release_load_buffers() is False


def test_the_runner_releases_them_after_loading_before_the_kv_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once per engine, after the model and its drafter are loaded (their load-time copies are
    garbage by then) and before the KV cache exists (the one large allocation that stays)."""
    events: list[str] = []
    allocate = model_runner.allocate_kv_caches
    build = model_runner.build_proposer

    def record_allocate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events.append("kv cache")
        return allocate(*args, **kwargs)

    def record_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events.append("drafter")
        return build(*args, **kwargs)

    monkeypatch.setattr(model_runner, "allocate_kv_caches", record_allocate)
    monkeypatch.setattr(model_runner, "build_proposer", record_build)
    monkeypatch.setattr(model_runner, "release_load_buffers", lambda: events.append("release"))
    folder = make_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    LLM(str(folder), dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert events[:2] == ["drafter", "release"] and set(events[2:]) == {"kv cache"}, events
