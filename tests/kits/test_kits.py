"""The small asyncio kits: back-off, problem log, repeat log, block-scoped tasks, awaiting a
value."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog
from devplug._kits.repeats import DISTINCT_PER_EPISODE, RepeatLog
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
        assert not any(repeats.admit("x.refused", reason="first") for _ in range(5))
        assert repeats.admit("y.failed", level="error")  # each event its own episode
        assert logs == []
        await eventually(lambda: logs, what="the interval's summary line")
        # One line for the interval: how many more came.
        assert logs == [
            {
                "event": "x.refused",
                "log_level": "warning",
                "reason": "first",
                "repeated": 5,
                "interval_s": 0.05,
            }
        ]
        # Still an episode: the next one is counted, not news.
        assert not repeats.admit("x.refused", level="error", reason="first")
        repeats.flush()  # at stop: what is owed is written, nothing lost
        assert logs[-1] == {
            "event": "x.refused",
            "log_level": "error",
            "reason": "first",
            "repeated": 1,
            "interval_s": 0.05,
        }
        assert len(logs) == 2
        assert repeats.admit("x.refused", reason="first")  # a new episode after the flush


async def test_a_genuine_refusal_in_a_flood_is_logged_at_once_and_counted_apart() -> None:
    """Issue 25 review (/tmp/review25/rl.py): a kubelet's genuine "unhealthy" refusal in the
    middle of 1,000 bogus ones was summed up as the flood's reason, repeated=1001. Now a
    different reason is news (logged in full when it comes) and keeps its own count, in its
    own category and within one."""
    repeats = RepeatLog(log, interval_s=3600.0)  # the summaries come at flush
    bogus = "unknown device ids: 'x'"
    genuine = "device gpu3 is unhealthy: card0 missing"
    admitted: list[str] = []
    for category in ("not_found", "invalid"):
        for i in range(1000):
            if repeats.admit("allocate.refused", category="not_found", reason=bogus):
                admitted.append(bogus)
            if i == 500 and repeats.admit("allocate.refused", category=category, reason=genuine):
                admitted.append(genuine)
        with structlog.testing.capture_logs() as logs:
            repeats.flush()
        assert admitted == [bogus, genuine], category
        summaries = {(e["reason"], e["repeated"]) for e in logs}
        assert summaries == {(bogus, 999)}  # the genuine one came once: it was logged in full
        admitted.clear()


async def test_a_flood_of_ever_different_reasons_makes_a_bounded_number_of_lines() -> None:
    """A client that varies the ids it names makes every reason new: still at most
    DISTINCT_PER_EPISODE lines in full and one summary per distinct reason plus one for the
    rest per interval, and every occurrence is in a line's count."""
    repeats = RepeatLog(log, interval_s=3600.0)
    total = 10_000
    with structlog.testing.capture_logs() as logs:
        full = sum(
            repeats.admit("allocate.refused", category="not_found", reason=f"ids: 'x{i % 5000}'")
            for i in range(total)
        )
        repeats.flush()
    assert full == DISTINCT_PER_EPISODE == 3
    assert len(logs) <= DISTINCT_PER_EPISODE + 1
    rest = [e for e in logs if e.get("other_reasons")]
    assert len(rest) == 1 and rest[0]["reason"] == "ids: 'x4999'"  # the last of them
    assert full + sum(e["repeated"] for e in logs) == total


async def test_a_distinct_reason_quiet_for_an_interval_frees_its_place() -> None:
    repeats = RepeatLog(log, interval_s=0.5)
    with structlog.testing.capture_logs() as logs:
        assert all(repeats.admit("x.refused", reason=r) for r in ("a", "b", "c"))
        assert not repeats.admit("x.refused", reason="d")  # no place: counted with the rest
        await eventually(lambda: logs, what="the interval's summary line")
        assert logs == [
            {
                "event": "x.refused",
                "log_level": "warning",
                "reason": "d",
                "repeated": 1,
                "other_reasons": True,
                "interval_s": 0.5,
            }
        ]
        # Only "a" goes on: "b" and "c", quiet for an interval, give their places up.
        assert not repeats.admit("x.refused", reason="a")
        await eventually(lambda: len(logs) == 2, what="the second summary")
        assert repeats.admit("x.refused", reason="d")  # news now
        repeats.flush()


async def test_a_quiet_interval_ends_the_episode() -> None:
    repeats = RepeatLog(log, interval_s=0.02)
    with structlog.testing.capture_logs() as logs:
        assert repeats.admit("x.refused")
        await asyncio.sleep(0.1)  # an interval without any: nothing to say
        assert logs == []
        assert repeats.admit("x.refused")  # news again
        repeats.flush()
    assert logs == []
