"""The small asyncio kits: back-off, problem log, repeat log, block-scoped tasks, awaiting a
value."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog
from devplug._kits.repeats import RepeatLog
from devplug._kits.tasks import running
from devplug._kits.values import LatestValue
from devplug.testing import eventually

log = structlog.get_logger("test")


def test_backoff_doubles_up_to_its_maximum_and_resets() -> None:
    backoff = Backoff(1.0, 5.0, jitter=False)
    assert [backoff.next() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.next() == 1.0
    jittered = Backoff(1.0, 5.0)  # +-20 %: many servers do not retry in lock-step
    assert 0.8 <= jittered.next() <= 1.2 and 1.6 <= jittered.next() <= 2.4


def test_a_problem_is_logged_when_new_or_changed_and_quiet_when_repeated() -> None:
    problems = ProblemLog()
    with structlog.testing.capture_logs() as logs:
        assert problems.report(log, "x.failed", "EACCES", key="a")
        assert not problems.report(log, "x.failed", "EACCES", key="a")
        assert problems.report(log, "x.failed", "EACCES", key="b")  # each key its own
        assert problems.report(log, "x.failed", "ENOSPC", key="a", level="warning")
    assert [(e["log_level"], e["reason"]) for e in logs] == [
        ("error", "EACCES"),
        ("debug", "EACCES"),
        ("error", "EACCES"),
        ("warning", "ENOSPC"),
    ]
    assert problems.current("a") == "ENOSPC"
    assert problems.solved("a") and not problems.solved("a")
    assert problems.report(log, "x.failed", "ENOSPC", key="a")  # new again once solved


async def test_a_running_task_stops_with_its_block_and_blocks_stop_in_reverse() -> None:
    stopped: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(name)

    async with asyncio.TaskGroup() as group:
        async with (
            running(group, forever("first"), "first") as first,
            running(group, forever("second"), "second") as second,
        ):
            await asyncio.sleep(0)
            assert not first.done() and not second.done()
        assert first.cancelled() and second.cancelled()
    assert stopped == ["second", "first"]


async def test_wait_for_returns_the_first_value_that_satisfies_and_times_out() -> None:
    value = LatestValue(0)
    assert await value.wait_for(lambda v: v == 0) == 0  # the current value counts
    waiting = asyncio.create_task(value.wait_for(lambda v: v >= 3, timeout=5))
    for number in range(1, 5):
        value.set(number)
        await asyncio.sleep(0)
    assert await waiting == 3
    with pytest.raises(TimeoutError):
        await value.wait_for(lambda v: v > 100, timeout=0.05)


async def test_a_repeated_event_is_logged_once_then_counted_per_interval() -> None:
    repeats = RepeatLog(log, interval_s=0.05)
    with structlog.testing.capture_logs() as logs:
        assert repeats.admit("x.refused", reason="first")  # the caller logs it in full
        assert not any(repeats.admit("x.refused", reason=f"r{n}") for n in range(5))
        assert repeats.admit("y.failed", level="error")  # each event its own episode
        assert logs == []
        await eventually(lambda: logs, what="the interval's summary line")
        # One line for the interval: how many more, and the last one's fields.
        assert logs == [
            {
                "event": "x.refused",
                "log_level": "warning",
                "reason": "r4",
                "repeated": 5,
                "interval_s": 0.05,
            }
        ]
        # Still an episode: the next one is counted, not news.
        assert not repeats.admit("x.refused", level="error", reason="r5")
        repeats.flush()  # at stop: what is owed is written, nothing lost
        assert logs[-1] == {
            "event": "x.refused",
            "log_level": "error",
            "reason": "r5",
            "repeated": 1,
            "interval_s": 0.05,
        }
        assert len(logs) == 2
        assert repeats.admit("x.refused")  # a new episode after the flush


async def test_a_quiet_interval_ends_the_episode() -> None:
    repeats = RepeatLog(log, interval_s=0.02)
    with structlog.testing.capture_logs() as logs:
        assert repeats.admit("x.refused")
        await asyncio.sleep(0.1)  # an interval without any: nothing to say
        assert logs == []
        assert repeats.admit("x.refused")  # news again
        repeats.flush()
    assert logs == []
