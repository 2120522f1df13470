"""Start and stop a `phalanx serve` subprocess for benchmark scripts (loopback only)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from phalanx.net import free_port

REPO = Path(__file__).resolve().parents[1]


def start_server(model: str, flags: list[str], log: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`phalanx serve MODEL FLAGS` on a free port; returns (process, base URL) once /health is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "phalanx.entrypoints.cli", "serve", model, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9
