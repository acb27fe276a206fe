"""Allocate's log lines: after a delay, or with the next answer, in order, each once."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import structlog

from devplug.kubelet import answer_log
from devplug.kubelet.answer_log import AnswerLog


def written(logs: Sequence[Mapping[str, Any]]) -> list[object]:
    return [e["devices"] for e in logs if e["event"] == "allocate.complete"]


async def past_the_delay() -> None:
    # A timer of our own, due after every line's: the loop runs timers in deadline order.
    await asyncio.sleep(answer_log.DELAY_S + 0.001)


async def test_a_lone_line_is_written_after_the_delay_not_at_the_next_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(answer_log, "DELAY_S", 0.2)
    with structlog.testing.capture_logs() as logs:
        lines = AnswerLog(structlog.get_logger("test"))
        lines.answered([["dev0"]])
        for _ in range(5):
            await asyncio.sleep(0)
        assert written(logs) == []
        await past_the_delay()
    assert written(logs) == [[["dev0"]]]


async def test_back_to_back_answers_write_each_line_once_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(answer_log, "DELAY_S", 0.02)
    with structlog.testing.capture_logs() as logs:
        lines = AnswerLog(structlog.get_logger("test"))
        for n in range(4):
            lines.answered(n)
            await asyncio.sleep(0)  # the next turn: the earlier lines go with this answer
            assert written(logs) == list(range(n))
        await past_the_delay()  # the last line's timer has fired
    assert written(logs) == [0, 1, 2, 3]


async def test_flush_writes_what_waits() -> None:
    with structlog.testing.capture_logs() as logs:
        lines = AnswerLog(structlog.get_logger("test"))
        lines.answered("a")
        lines.answered("b")
        lines.flush()
        assert written(logs) == ["a", "b"]
        await asyncio.sleep(0)
    assert written(logs) == ["a", "b"]


async def test_back_to_back_answers_keep_one_timer_armed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A timer per answer would wake the loop in the middle of later calls for nothing.
    loop = asyncio.get_running_loop()
    armed: list[asyncio.TimerHandle] = []
    call_later = loop.call_later

    def recording(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        armed.append(call_later(delay, callback, *args))
        return armed[-1]

    with structlog.testing.capture_logs():
        lines = AnswerLog(structlog.get_logger("test"))
        with monkeypatch.context() as patched:
            patched.setattr(loop, "call_later", recording)
            for n in range(5):
                lines.answered(n)
                await asyncio.sleep(0)
        assert len(armed) == 5
        assert [timer.cancelled() for timer in armed] == [True] * 4 + [False]
        lines.flush()


async def test_a_line_that_cannot_be_written_is_reported_and_the_others_still_are() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, report: reported.append(report))

    class Unwritable:
        """A logger whose output is gone for one line (stderr closed under it, say)."""

        def __init__(self) -> None:
            self.written: list[object] = []

        def info(self, event: str, devices: object) -> None:
            if devices == "lost":
                raise BrokenPipeError("stderr closed")
            self.written.append(devices)

    logger = Unwritable()
    try:
        lines = AnswerLog(logger)  # type: ignore[arg-type]
        for devices in ("a", "lost", "b"):
            lines.answered(devices)
        lines.flush()
    finally:
        loop.set_exception_handler(None)
    assert logger.written == ["a", "b"]
    assert [type(r["exception"]) for r in reported] == [BrokenPipeError]
