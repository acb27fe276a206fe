from __future__ import annotations

import asyncio

import pytest

from devplug._kits.values import LatestValue


async def test_reader_gets_current_then_latest_skipping_intermediate() -> None:
    value = LatestValue(0)
    seen: list[int] = []
    reader_started = asyncio.Event()

    async def read() -> None:
        async for item in value.as_changed():
            seen.append(item)
            reader_started.set()

    task = asyncio.create_task(read())
    await reader_started.wait()
    for i in range(1, 6):
        value.set(i)  # no await in between: the reader cannot see 1..4
    value.close()
    await task
    assert seen == [0, 5]


async def test_close_ends_readers_after_the_final_value() -> None:
    value = LatestValue("a")
    value.set("b")
    value.close()
    assert [v async for v in value.as_changed()] == ["b"]
    with pytest.raises(RuntimeError):
        value.set("c")


async def test_wait_changed_returns_new_version() -> None:
    value = LatestValue(0)
    waiter = asyncio.create_task(value.wait_changed(value.version))
    await asyncio.sleep(0)
    assert not waiter.done()
    value.set(1)
    assert await waiter == 1
