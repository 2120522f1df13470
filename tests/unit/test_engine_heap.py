"""The engine process's start-up heap (`core_process.freeze_start_up_heap`): garbage left from
start-up is collected first, then everything still alive leaves the collector's generations for
good, so the full collections of a serving engine walk only what it allocated since. (A served
engine doing it: tests/e2e/test_server_lifecycle.py, its log line.)"""

from __future__ import annotations

import gc
import weakref

from phalanx.engine.core_process import freeze_start_up_heap


class _Node:
    pass


def test_start_up_garbage_is_collected_and_the_rest_frozen() -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # nothing collects the cycle below before the call does
    try:
        cycle = _Node()
        cycle.me = cycle  # type: ignore[attr-defined]  # only the cyclic collector frees it
        gone = weakref.ref(cycle)
        del cycle
        alive = [_Node()]  # tracked by the collector, and still referenced
        assert gone() is not None and any(o is alive for o in gc.get_objects())
        frozen = freeze_start_up_heap()
        assert gone() is None  # collected, not frozen with the rest
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # out of every generation
        fresh = [_Node()]
        assert any(o is fresh for o in gc.get_objects())  # what comes later is collected as before
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
