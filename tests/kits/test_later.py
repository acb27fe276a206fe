"""devplug._kits.later: calls queued now run together a moment later, none lost at a flush."""

from __future__ import annotations

import asyncio

import structlog

from devplug._kits.later import Later
from devplug.testing import eventually


async def test_queued_calls_run_together_after_the_delay_in_order() -> None:
    ran: list[tuple[int, str]] = []
    later = Later(delay_s=0.05, max_pending=100)
    later.call(ran.append, (1, "a"))
    later.call(lambda **kw: ran.append((2, kw["name"])), name="b")
    await asyncio.sleep(0)  # a turn of the loop is not the delay
    assert ran == [] and len(later) == 2
    await eventually(lambda: ran, timeout=5)
    assert ran == [(1, "a"), (2, "b")] and len(later) == 0


async def test_a_full_queue_runs_at_the_next_turn_and_a_flush_leaves_no_timer_behind() -> None:
    ran: list[int] = []
    later = Later(delay_s=60, max_pending=3)
    for i in range(3):
        later.call(ran.append, i)
    assert ran == []  # not in the caller's own turn...
    await asyncio.sleep(0)
    assert ran == [0, 1, 2]  # ...but at the next: no waiting a minute
    later.call(ran.append, 3)
    later.flush()
    assert ran == [0, 1, 2, 3]
    later.flush()  # nothing left: nothing runs twice
    assert ran == [0, 1, 2, 3]


async def test_a_call_that_raises_is_logged_and_the_others_still_run() -> None:
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    later = Later(delay_s=60, max_pending=100)
    later.call(ran.append, "before")
    later.call(broken)
    later.call(ran.append, "after")
    with structlog.testing.capture_logs() as logs:
        later.flush()
    assert ran == ["before", "after"]
    (failed,) = [e for e in logs if e["event"] == "later.call_failed"]
    assert failed["call"].endswith("broken") and failed["log_level"] == "error"
