"""Start and stop a `phalanx serve` subprocess for benchmark scripts (loopback only)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from phalanx.net import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]


def start_server(
    model: str, flags: list[str], log: Path, timeout_s: float = 300, cwd: Path = REPO
) -> tuple[subprocess.Popen, str]:
    """`phalanx serve MODEL FLAGS` on a free port; returns (process, base URL) once /health is 200.
    `cwd`: the checkout whose phalanx runs (`python -m` imports it from there)."""
    port = free_port()
    cmd = [sys.executable, "-m", "phalanx.entrypoints.cli", "serve", model, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    why = wait_until_healthy(proc, url, timeout_s, interval_s=0.5)
    if why is None:
        return proc, url
    if proc.poll() is None:
        proc.kill()
    raise RuntimeError(f"{why}:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9
