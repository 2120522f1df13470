"""Small networking helpers shared by the engine, the benchmarks and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another process may still
    take it before the caller binds, which callers accept)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
