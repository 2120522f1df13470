"""Small networking helpers shared by the engine, the benchmarks and the tests."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another process may still
    take it before the caller binds, which callers accept)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, interval_s: float = 0.2) -> str | None:
    """Poll `base_url`/health until it answers 200 while `proc` (the server we started) lives.
    Returns None once healthy, else why not (the caller adds its log and stops the process)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with {proc.returncode} during start-up"
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return f"server did not become healthy in {timeout_s:.0f} s"
