"""A debugging and testing aid: an engine rank that kills itself (SIGKILL) at a chosen point.

Owns: parsing ``PHALANX_DEBUG_KILL_AT`` and arming the kill points in an engine-core process.
Does not own: noticing the death or recovering from it (the API server does, exactly as for a
``kill -9`` from outside: docs/dp-protocol.md, "Failure model and recovery").

An outside ``kill -9`` lands wherever the rank happens to be; these land exactly where a test wants
them, inside the step that is hardest to hit from outside::

    PHALANX_DEBUG_KILL_AT="RANK:STEP:WHERE[:SITE][,...]"

* ``step``: at the start of an engine step, once the rank has run STEP forward steps;
* ``drafter``: inside the speculative proposer, during a step after STEP forward steps;
* ``collective``: inside a data-parallel collective (lockstep ranks), after STEP forward steps, at
  the first collective whose call site contains SITE (e.g. ``drafter pass 2``; default: any).

Only a rank's first process (generation 0) honours it: a replacement started after the death
runs normally, so a test's fault happens once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KILL_AT_ENV = "PHALANX_DEBUG_KILL_AT"
WHERE = ("step", "drafter", "collective")


@dataclass(frozen=True)
class KillPoint:
    rank: int
    step: int
    where: str
    site: str = ""


def parse_kill_points(raw: str) -> list[KillPoint]:
    points = []
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":", 3)
        try:
            if len(parts) < 3:
                raise ValueError
            rank, step, where = int(parts[0]), int(parts[1]), parts[2]
        except ValueError:
            raise ValueError(f"{KILL_AT_ENV}: {item!r} is not RANK:STEP:WHERE[:SITE]") from None
        if where not in WHERE or rank < 0 or step < 0:
            raise ValueError(f"{KILL_AT_ENV}: {item!r}: need RANK >= 0, STEP >= 0 and WHERE in {WHERE}")
        if len(parts) == 4 and where != "collective":
            raise ValueError(f"{KILL_AT_ENV}: {item!r}: only 'collective' takes a SITE")
        points.append(KillPoint(rank, step, where, parts[3] if len(parts) == 4 else ""))
    return points


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillSwitch:
    """The armed kill points of one rank's process; `at_step` is called by the engine loop."""

    def __init__(self, engine: Any, points: list[KillPoint]) -> None:
        self.engine = engine
        self.step_points = [p for p in points if p.where == "step"]
        for p in points:
            if p.where == "drafter":
                self._wrap_proposer(p)
            elif p.where == "collective":
                self._wrap_collectives(p)

    def at_step(self) -> None:
        if any(self.engine.num_steps >= p.step for p in self.step_points):
            _die()

    def _wrap_proposer(self, p: KillPoint) -> None:
        proposer = self.engine.runner.proposer
        if proposer is None:
            raise ValueError(f"{KILL_AT_ENV}: a 'drafter' kill point needs a speculative config")
        propose = proposer.propose

        def propose_or_die(batch: Any) -> Any:
            if self.engine.num_steps >= p.step:
                _die()
            return propose(batch)

        proposer.propose = propose_or_die

    def _wrap_collectives(self, p: KillPoint) -> None:
        group = self.engine.group
        if group is None:
            raise ValueError(f"{KILL_AT_ENV}: a 'collective' kill point needs lockstep ranks")
        collective = group._collective

        def collective_or_die(site: str, *args: Any, **kwargs: Any) -> Any:
            if self.engine.num_steps >= p.step and p.site in f"{group._context}: {site}":
                _die()
            return collective(site, *args, **kwargs)

        group._collective = collective_or_die


def arm(engine: Any, rank: int, generation: int, environ: Mapping[str, str] = os.environ) -> KillSwitch | None:
    """The kill switch for this rank's process, or None when it has no kill point."""
    raw = environ.get(KILL_AT_ENV, "").strip()
    if not raw or generation != 0:
        return None
    points = [p for p in parse_kill_points(raw) if p.rank == rank]
    return KillSwitch(engine, points) if points else None
