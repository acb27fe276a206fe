"""devplug.testing.eventually: returns once the condition holds, times out when it never does."""

from __future__ import annotations

import asyncio

import pytest

from devplug.testing import eventually


async def test_eventually_returns_once_the_condition_holds() -> None:
    calls = 0

    def third_time() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    await eventually(third_time, timeout=5, interval=0)
    assert calls == 3


async def test_eventually_times_out_when_the_condition_never_holds() -> None:
    with pytest.raises(TimeoutError):
        await eventually(lambda: False, timeout=0.05)


async def test_eventually_lets_the_loop_run_between_checks() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_soon(done.set)
    await eventually(done.is_set, timeout=5, interval=0)
