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


def ephemeral_port_range() -> tuple[int, int]:
    """The range the kernel draws a connecting socket's local port from (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_listen_ports(count: int, host: str = "127.0.0.1", low: int = 20000) -> int:
    """The first of `count` consecutive ports that are free on `host` right now and lie below the
    ephemeral range. A listening port inside that range can be taken by a peer that keeps
    reconnecting to it before it is bound: the kernel may give the connecting socket that very port as
    its source and TCP connects it to itself, after which the bind fails with 'address in use'."""
    import random

    top = min(ephemeral_port_range()[0], 65536) - count
    if top <= low:
        raise RuntimeError(f"no room for {count} ports between {low} and the ephemeral range")
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(low, top)
        try:
            socks = []
            try:
                for port in range(first, first + count):
                    s = socket.socket()
                    socks.append(s)
                    s.bind((host, port))
            finally:
                for s in socks:
                    s.close()
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports found on {host} below the ephemeral range")


def wait_until_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, interval_s: float = 0.2,
                       path: str = "/health") -> str | None:
    """Poll `base_url` + `path` until it answers 200 while `proc` (the server we started) lives.
    Returns None once healthy, else why not (the caller adds its log and stops the process)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with {proc.returncode} during start-up"
        try:
            if httpx.get(f"{base_url}{path}", timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return f"server did not become healthy in {timeout_s:.0f} s"
