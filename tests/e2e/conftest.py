"""End-to-end fixtures: a tiny chat model and real `phalanx serve` subprocesses on free local ports.

One server (`server`) is shared by the whole test run to keep start-up costs down; tests that must
break a server (kill its engine) start their own with `start_server`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from phalanx.net import free_port, wait_until_healthy
from tests.tiny_models import make_model

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL_NAME = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        import re

        return [int(m) for m in re.findall(r"engine rank \d+ ready \(pid (\d+)", self.log())]

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # Engine processes exit on Shutdown or when they notice their parent is gone; make sure.
        for pid in self.engine_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode


def serve_command(model: Path | str | None, *flags: str) -> list[str]:
    cmd = [sys.executable, "-m", "phalanx.entrypoints.cli", "serve"]
    if model is not None:
        cmd.append(str(model))
    return cmd + list(flags)


def start_server(
    model: Path, log_path: Path, *flags: str, env: dict[str, str] | None = None, timeout: float = 90.0
) -> ServerProcess:
    port = free_port()
    cmd = serve_command(
        model,
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--num-gpu-blocks-override",
        "256",
        "--log-stats-interval",
        "1",
        *flags,
    )
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    server = ServerProcess(proc, port, log_path)
    why = wait_until_healthy(proc, server.base_url, timeout)
    if why is None:
        return server
    server.stop()
    raise RuntimeError(f"{why}:\n{server.log()}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    folder = make_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny_llama"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(tiny_model, log_path, "--api-key", API_KEY, "--max-model-len", "256")
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code}:\n{srv.log()[-3000:]}"


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60.0
    ) as client:
        yield client
