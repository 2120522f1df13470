"""What the API server does when an engine rank dies while serving: the policy and its budget.

Owns: `RecoveryConfig` (recovery on or off, the restart budget and its backoff, how long a request
may wait for a serving rank, how many times one request may be replayed), `RankState` (the
life cycle of a rank as the API server sees it) and `RestartBudget` (the deaths of one rank, or of
a lockstep group, within a sliding window, and the delay before the next restart).
Does not own: processes and sockets (``core_client``), forming replays from what the front end
received (``output_processor``), carrying them out (``entrypoints.async_llm``).

The budget, on an example (max_restarts=3, window 600 s, backoff 1 s): deaths at t = 0, 5, 9 get
restarts after 0 s, 1 s and 2 s; a fourth death before t = 600 gives the rank up. A rank that
stays up for the window earns its budget back (deaths older than the window are forgotten).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class RankState(enum.Enum):
    STARTING = "starting"  # first process loading the model
    READY = "ready"  # serving (a lockstep rank: its group formed)
    DEAD = "dead"  # exited or failed; its requests went back for replay; a restart is scheduled
    RESPAWNING = "respawning"  # a replacement process is loading the model
    GIVEN_UP = "given_up"  # died more often than the budget allows: never restarted again


@dataclass(frozen=True)
class RecoveryConfig:
    """`enabled=False` is fail-fast (a rank's death fails every in-flight request, /health turns
    503 and the server exits 1), as before recovery existed and as vLLM does."""

    enabled: bool = True
    max_restarts: int = 3  # restarts per rank (lockstep: of the whole group) within restart_window_s
    restart_window_s: float = 600.0
    backoff_s: float = 1.0  # delay before the second restart in the window; doubles each time
    max_backoff_s: float = 30.0
    request_timeout_s: float = 120.0  # how long a request may wait for a serving rank before a 503
    max_replays: int = 3  # a request in flight on ranks that died more often than this fails (503)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("restart_window_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s} and {self.max_backoff_s}"
            )
        if self.max_replays < 0:
            raise ValueError(f"max_replays must be >= 0, got {self.max_replays}")


class RestartBudget:
    """The deaths of one rank (or one lockstep group) within the config's sliding window."""

    def __init__(self, config: RecoveryConfig) -> None:
        self.config = config
        self.deaths: deque[float] = deque()

    def on_death(self, now: float) -> float | None:
        """Record a death at `now` (monotonic seconds); the delay before the restart, or None when
        the budget is spent (the rank is given up)."""
        cfg = self.config
        while self.deaths and now - self.deaths[0] > cfg.restart_window_s:
            self.deaths.popleft()
        self.deaths.append(now)
        n = len(self.deaths)
        if n > cfg.max_restarts:
            return None
        return 0.0 if n == 1 else min(cfg.backoff_s * 2 ** (n - 2), cfg.max_backoff_s)
